"""The composition root: Ray Serve deployments, autoscaling, replica logging and the Serve config."""

"""The API's routes, one router per resource; ``pipeline.api.app`` includes them. Nothing is
imported here: the guards read the page's paths from ``web`` without loading the other routers."""

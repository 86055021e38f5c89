"""vidx pipeline: fetch, decode, embed, index, search; the Ray Serve app, the API and the CLI."""

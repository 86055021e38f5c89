"""How a job is submitted and how a video's row changes: the index task queue, ``queued`` marks, the
per-video state machine and the catalog writes consumers share. The API, the CLI and upkeep reach jobs
only through here; how a job is run is ``pipeline.index``."""

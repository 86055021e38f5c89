"""Log routing inside Ray Serve replicas (every deployment calls it first)."""

from __future__ import annotations

import logging
from typing import Any

#: vidx's own loggers: their INFO lines (one per job, with outcome and stage times) belong in the logs.
PACKAGE_LOGGERS = ("pipeline", "events", "storage")


def route_logs_to_replica(level: int = logging.INFO) -> None:
    """Send vidx's log lines to the replica's log file: Ray Serve configures only the ``ray.serve``
    logger in a replica, so without this INFO lines of other loggers are dropped."""
    serve_logger = logging.getLogger("ray.serve")
    for name in PACKAGE_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        for handler in serve_logger.handlers:
            if handler not in logger.handlers:
                logger.addHandler(handler)
        logger.propagate = not serve_logger.handlers


def logging_config(encoding: str, access_log: bool = False) -> Any:
    """Ray Serve's ``LoggingConfig`` of every vidx deployment: ``encoding`` ``JSON`` writes each line
    as one JSON object, with the fields a line was logged with (``extra``) as keys; ``access_log``:
    a line per request (``serve.access_log``)."""
    from ray.serve.schema import LoggingConfig

    return LoggingConfig(encoding=encoding, enable_access_log=access_log)

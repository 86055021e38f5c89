"""The wall clock of one index job, added up per stage (its log line and metrics report it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


class StageClock:
    """Adds up wall time per pipeline stage of one job."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        #: The stage an exception first left: where the job failed (None while nothing did).
        self.failed_in: str | None = None

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            if self.failed_in is None:
                self.failed_in = name
            raise
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        """Count ``seconds`` under ``name`` (time measured elsewhere, e.g. by a stage's own parts)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def timed(self, name: str, items: Iterator[T]) -> Iterator[T]:
        """``items``, with the time spent producing each one counted under ``name``."""
        while True:
            with self.stage(name):
                item = next(items, None)
            if item is None:
                return
            yield item

    def summary(self) -> str:
        return " ".join(f"{k}={v:.2f}s" for k, v in self.seconds.items())

"""One grouped writer per table (each model's frames table, the text table), shared by the jobs of one
consumer process."""

from __future__ import annotations

import threading
from collections.abc import Callable

from pipeline.settings import WriterSettings
from storage.commits.frames import GroupedFrameWriter
from storage.tables import IndexStore


class FrameWriters:
    """The process's frame writers by table, made on first use: the Celery threads of a replica share
    commits (one writer per model's table), and each task is acked only after the commit holding its rows."""

    def __init__(self, store: IndexStore, settings: WriterSettings, expected: Callable[[], int] | None = None) -> None:
        """``expected``: how many of the process's jobs are on their way to a frame write (see
        ``GroupedFrameWriter``)."""
        self._store = store
        self._settings = settings
        self._expected = expected
        self._writers: dict[str, GroupedFrameWriter] = {}
        self._lock = threading.Lock()

    def __call__(self, table: str) -> GroupedFrameWriter:
        """The writer of ``table`` (the ``writer_for`` an ``Indexer`` takes)."""
        with self._lock:
            if table not in self._writers:
                w = self._settings
                self._writers[table] = GroupedFrameWriter(
                    self._store.table_for(table),
                    max_videos=w.group_max_videos,
                    max_rows=w.group_max_rows,
                    wait_s=w.group_wait_s,
                    commit_timeout_s=w.commit_timeout_s,
                    stall_after_s=w.stall_after_s,
                    expected=self._expected,
                )
            return self._writers[table]

    def health(self) -> str | None:
        """None while every writer works; else which one does not and why."""
        with self._lock:
            writers = dict(self._writers)
        for table, writer in writers.items():
            if (problem := writer.health()) is not None:
                return f"the frame writer of {table}: {problem}"
        return None

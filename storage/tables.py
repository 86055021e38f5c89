"""The index database as one object: the catalog, the frames tables, the model lifecycle and the
leases over one connection.

Each table is its own module (``storage.catalog``, ``storage.frames``, ``storage.texts``, ``storage.models``,
``storage.leases``; frames and text tables over ``storage.rows``); schemas live there and nowhere else. ANN
index upkeep is ``pipeline.upkeep.maintenance``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from storage.catalog import Catalog
from storage.config import S3Settings
from storage.db import IndexDatabase
from storage.frames import FRAMES, FrameTable
from storage.leases import Leases
from storage.models import ModelRegistry
from storage.texts import TEXT_PREFIX, TextTable

T = TypeVar("T", FrameTable, TextTable)


class IndexStore:
    """The tables of one LanceDB database in the index bucket."""

    def __init__(self, s3: S3Settings, uri: str | None = None) -> None:
        """``uri`` overrides the database location (a local directory in unit tests, or another S3 prefix)."""
        self.db = IndexDatabase(s3, uri)
        self.catalog = Catalog(self.db)
        #: The table named ``frames`` (indexes from before per-model tables; unit tests and benchmarks).
        self.frames = FrameTable(self.db)
        self.models = ModelRegistry(self.db)
        self.leases = Leases(self.db)
        self._tables: dict[str, FrameTable] = {FRAMES: self.frames}
        self._texts: dict[str, TextTable] = {}
        self._lock = threading.Lock()

    def frames_table(self, name: str) -> FrameTable:
        """The frames table ``name`` (one handle per name, kept)."""
        return self._kept(self._tables, FrameTable, name)

    def text_table(self, name: str) -> TextTable:
        """The text table ``name`` (one handle per name, kept)."""
        return self._kept(self._texts, TextTable, name)

    def _kept(self, kept: dict[str, T], make: Callable[[IndexDatabase, str], T], name: str) -> T:
        with self._lock:
            table = kept.get(name)
            if table is None:
                table = kept[name] = make(self.db, name)
            return table

    def table_for(self, name: str) -> FrameTable | TextTable:
        """The table ``name`` of a catalog entry: a text table for ``text-*`` names, else a frames table."""
        return self.text_table(name) if name.startswith(TEXT_PREFIX) else self.frames_table(name)

    def active_frames(self) -> FrameTable:
        """The active model's frames table, as the lifecycle row says now (``frames`` before any model is set)."""
        active = self.models.read().active
        return self.frames if active is None else self.frames_table(active.table)

    def forget(self, name: str) -> None:
        """Drop the kept handle of table ``name`` (after the table itself was dropped)."""
        with self._lock:
            if name != FRAMES:
                self._tables.pop(name, None)
            self._texts.pop(name, None)

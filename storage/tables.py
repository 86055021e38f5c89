"""The index database as one object: the catalog, the frames and the leases over one connection.

Each table is its own module (``storage.catalog``, ``storage.frames``, ``storage.leases``); schemas
live there and nowhere else. ANN index upkeep is ``storage.maintenance``.
"""

from __future__ import annotations

from storage.catalog import Catalog
from storage.config import S3Settings
from storage.db import IndexDatabase
from storage.frames import FrameTable
from storage.leases import Leases


class IndexStore:
    """The tables of one LanceDB database in the index bucket."""

    def __init__(self, s3: S3Settings, uri: str | None = None) -> None:
        """``uri`` overrides the database location (a local directory in unit tests, or another S3 prefix)."""
        self.db = IndexDatabase(s3, uri)
        self.catalog = Catalog(self.db)
        self.frames = FrameTable(self.db)
        self.leases = Leases(self.db)

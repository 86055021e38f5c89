"""One LanceDB database in the index bucket: the connection, its table handles, and the helpers every
table module shares (SQL quoting, write-error conversion)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar

import lancedb
import pyarrow as pa

from storage.config import S3Settings
from storage.errors import TransientError

log = logging.getLogger(__name__)

#: Marks a column as the table's (unenforced) primary key: Lance then detects concurrent inserts of one key.
PRIMARY_KEY = {"lance-schema:unenforced-primary-key": "true"}

P = ParamSpec("P")
R = TypeVar("R")


def sql_quote(value: str) -> str:
    """``value`` as a SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


def merge_on(table: Any, key: str) -> Any:
    """``table.merge_insert(key)``, never through a scalar index: with an index on the key Lance takes
    a merge plan that records no inserted keys for its conflict check (lance#4585), so two commits
    inserting one new key would both land. Lookups by id still use the BTREE indexes."""
    return table.merge_insert(key).use_index(False)


def storage_options(s3: S3Settings) -> dict[str, str]:
    return {
        "endpoint": s3.endpoint_url,
        "allow_http": "true" if s3.endpoint_url.startswith("http://") else "false",
        "region": s3.region,
        "aws_access_key_id": s3.access_key.get_secret_value(),
        "aws_secret_access_key": s3.secret_key.get_secret_value(),
    }


def write_errors_are_transient(write: Callable[P, R]) -> Callable[P, R]:
    """Table writes fail under commit conflicts (``Too many concurrent writers``) and object-store
    hiccups as Lance ``RuntimeError``/``OSError``s: retrying can help, so they become ``TransientError``
    (first line only: Lance messages carry paths, never credentials, but can be long)."""

    @functools.wraps(write)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return write(*args, **kwargs)
        except (RuntimeError, OSError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise TransientError(f"index table write failed: {first}") from exc

    return wrapper


def read_errors_are_transient(read: Callable[P, R]) -> Callable[P, R]:
    """Reads fail the same way when the store hiccups; callers answer 503, not 500."""

    @functools.wraps(read)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return read(*args, **kwargs)
        except (RuntimeError, OSError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise TransientError(f"index table read failed: {first}") from exc

    return wrapper


class IndexDatabase:
    """The LanceDB database at ``uri`` (``s3.index_uri`` by default; a local directory in unit tests)."""

    def __init__(self, s3: S3Settings, uri: str | None = None) -> None:
        self.uri = uri or s3.index_uri
        self.storage_options = storage_options(s3) if self.uri.startswith("s3://") else None
        # Long-lived handles (API, consumers) must see other processes' commits at once.
        self.connection = self.connect(timedelta(0))

    def connect(self, consistency: timedelta) -> Any:
        """Another connection to the same database, re-checking the latest version at most every ``consistency``."""
        return lancedb.connect(self.uri, storage_options=self.storage_options, read_consistency_interval=consistency)

    def create(self, name: str, schema: pa.Schema) -> Any:
        return self.connection.create_table(name, schema=schema, exist_ok=True)

    def open(self, name: str) -> Any | None:
        """The table ``name``, or None before anything created it."""
        try:
            return self.connection.open_table(name)
        except (ValueError, FileNotFoundError):
            return None

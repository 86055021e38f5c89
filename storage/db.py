"""One LanceDB database in the index bucket: the connection, its table handles, and the helpers every
table module shares (SQL quoting, write-error conversion)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Generic, ParamSpec, TypeVar

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


#: A merge's update condition for compare-and-set rows: the source row is the target's next revision.
NEXT_REVISION = "target.rev + 1 = source.rev"


def compare_and_set(table: Any, key: str, row: pa.Table, expected_rev: int) -> bool:
    """Merge the one row ``row`` (revision ``expected_rev + 1`` in its ``rev`` column) into ``table`` on
    ``key`` if the row there still holds revision ``expected_rev`` (0: there must be none); whether it landed."""
    merge = merge_on(table, key)
    if expected_rev == 0:
        result = merge.when_not_matched_insert_all().execute(row)
    else:
        result = merge.when_matched_update_all(where=NEXT_REVISION).execute(row)
    return int(result.num_updated_rows) + int(result.num_inserted_rows) > 0


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
    return _errors_are_transient(write, "write")


def read_errors_are_transient(read: Callable[P, R]) -> Callable[P, R]:
    """Reads fail the same way when the store hiccups; callers answer 503, not 500."""
    return _errors_are_transient(read, "read")


def _errors_are_transient(call: Callable[P, R], what: str) -> Callable[P, R]:
    @functools.wraps(call)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return call(*args, **kwargs)
        except (RuntimeError, OSError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise TransientError(f"index table {what} failed: {first}") from exc

    return wrapper


#: Longest a read waits for the manifest check it needs (one another reader runs, or the next one);
#: past it the read fails as transient.
FRESH_WAIT_S = 30.0


class FreshTable:
    """A table handle for reads that must see every commit finished before the read began, at the cost
    of one manifest check shared by the readers waiting at that moment.

    A connection that re-checks the manifest on every call (``read_consistency_interval=0``) checks
    it several times per query (the schema alone is asked for three times), each a round trip to the
    object store, and concurrent readers queue behind each other's checks. This handle never checks
    on its own (interval None); ``table()`` runs ``checkout_latest`` once and returns the handle to
    every reader that arrived before that check began — a check begun after a read arrived sees every
    commit that read must see. Versions only move forward: nothing else may ``checkout`` this handle.
    """

    def __init__(self, open_table: Callable[[], Any]) -> None:
        self._open = open_table
        self._table: Any = None
        self._cond = threading.Condition()
        self._began = 0  # checks begun
        self._done = 0  # the latest check that ended well (checks run one at a time, in order)
        self._running = False

    def table(self) -> Any:
        """The handle, at a version no older than the latest when this call began.

        Raises:
            RuntimeError, OSError: the check failed (Lance's errors, as a read's).
            TimeoutError: no check this read can use ended within ``FRESH_WAIT_S``.
        """
        deadline = time.monotonic() + FRESH_WAIT_S
        with self._cond:
            want = self._began + 1  # the next check to begin begins after now
            while self._done < want:
                if not self._running:
                    self._running = True
                    self._began += 1
                    mine = self._began
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no manifest check ended within {FRESH_WAIT_S:g}s")
                self._cond.wait(left)
            else:
                return self._table
        ok = False
        try:
            if self._table is None:
                self._table = self._open()  # opening reads the latest manifest
            else:
                self._table.checkout_latest()
            ok = True
            return self._table
        finally:
            with self._cond:
                self._running = False
                if ok:
                    self._done = mine
                self._cond.notify_all()


K = TypeVar("K")
V = TypeVar("V")


class SharedLookups(Generic[K, V]):
    """Lookups by key that concurrent callers share: every key asked for while a query runs goes into
    the next query, one for all of them (``fetch`` takes the keys and returns what it found, by key).

    A lookup never takes the answer of a query that began before it arrived (that query may have read
    an older version), so each answer is as fresh as a query of its own begun when the lookup began,
    at the price of one query per wave of callers instead of one per caller. Queries run one at a
    time; a failed query fails every lookup that joined it.
    """

    def __init__(self, fetch: Callable[[list[K]], Mapping[K, V]], wait_s: float = FRESH_WAIT_S) -> None:
        self._fetch = fetch
        self._wait_s = wait_s
        self._cond = threading.Condition()
        self._pending: _Wave[K, V] | None = None  # the next query's keys, not begun yet
        self._running = False

    def get(self, key: K) -> V | None:
        """What a query begun after this call found for ``key`` (None: nothing).

        Raises:
            TransientError: the query failed (its error chained), or none could begin within ``wait_s``.
        """
        deadline = time.monotonic() + self._wait_s
        with self._cond:
            wave = self._pending
            if wave is None:
                wave = self._pending = _Wave()
            wave.keys.add(key)
            while not wave.done:
                if not self._running and self._pending is wave:
                    self._running, self._pending = True, None
                    wave.started_at = time.monotonic()
                    break  # this caller runs the wave's query
                # Bounded twice over: for the wave to begin, then for its own query (not the one before).
                if wave.started_at is not None:
                    deadline = max(deadline, wave.started_at + self._wait_s)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransientError(f"no shared lookup answered within {self._wait_s:g}s")
                self._cond.wait(left)
            else:
                if wave.error is not None and not isinstance(wave.error, TransientError):
                    # Not the store's hiccup (a row that can't be read, a bug): each key asks on its own,
                    # so it fails only the lookup it belongs to, as a lookup of its own would.
                    return self._fetch([key]).get(key)
                return wave.answer(key)
        try:
            wave.found = dict(self._fetch(sorted(wave.keys, key=repr)))
        except BaseException as exc:  # every joined lookup sees it (none reads "no row"); this one too
            wave.error = exc
            if isinstance(exc, TransientError) or not isinstance(exc, Exception):
                raise
        finally:
            with self._cond:
                wave.done, self._running = True, False
                self._cond.notify_all()
        if wave.error is not None:
            return self._fetch([key]).get(key)  # as the joined lookups do (above)
        return wave.answer(key)


class _Wave(Generic[K, V]):
    """The keys of one shared query and its outcome."""

    def __init__(self) -> None:
        self.keys: set[K] = set()
        self.started_at: float | None = None
        self.done = False
        self.found: dict[K, V] = {}
        self.error: BaseException | None = None

    def answer(self, key: K) -> V | None:
        if self.error is not None:
            raise TransientError(str(self.error) or type(self.error).__name__) from self.error
        return self.found.get(key)


class IndexDatabase:
    """The LanceDB database at ``uri`` (``s3.index_uri`` by default; a local directory in unit tests)."""

    def __init__(self, s3: S3Settings, uri: str | None = None) -> None:
        self.uri = uri or s3.index_uri
        self.storage_options = storage_options(s3) if self.uri.startswith("s3://") else None
        # Long-lived handles (API, consumers) must see other processes' commits at once.
        self.connection = self.connect(timedelta(0))

    def connect(self, consistency: timedelta | None) -> Any:
        """Another connection to the same database, re-checking the latest version at most every
        ``consistency`` (None: only when asked, ``checkout_latest``)."""
        return lancedb.connect(self.uri, storage_options=self.storage_options, read_consistency_interval=consistency)

    def create(self, name: str, schema: pa.Schema) -> Any:
        return self.connection.create_table(name, schema=schema, exist_ok=True)

    def fresh(self, name: str) -> FreshTable:
        """A ``FreshTable`` over table ``name`` (which must exist), on a connection of its own."""
        connection = self.connect(None)
        return FreshTable(lambda: connection.open_table(name))

    def table_names(self, max_pages: int = 1000) -> list[str]:
        """Every table of the database (paged; at most ``max_pages`` pages)."""
        names: list[str] = []
        token: str | None = None
        for _ in range(max_pages):
            page = self.connection.list_tables(page_token=token)
            names.extend(page.tables)
            token = page.page_token
            if not token:
                break
        return names

    def drop(self, name: str) -> None:
        """Drop table ``name`` (nothing when it does not exist)."""
        self.connection.drop_table(name, ignore_missing=True)

    def open(self, name: str) -> Any | None:
        """The table ``name``, or None before anything created it."""
        try:
            return self.connection.open_table(name)
        except (ValueError, FileNotFoundError):
            return None

"""The ``models`` table: which embedding model answers searches, which one is being backfilled, and
which tables are kept from models retired (``vidx reindex``, docs/operations.md).

Each model's vectors live in a frames table of their own, named from the model id, its dimension
and a generation (a backfill always starts an empty table, so nothing an aborted run left behind is
ever read). The whole lifecycle is one row, changed only by compare-and-set on its revision: the
switch from the old model to the new one is that row's one write.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa

from storage.db import (
    PRIMARY_KEY,
    FreshTable,
    IndexDatabase,
    compare_and_set,
    read_errors_are_transient,
    write_errors_are_transient,
)
from storage.frames import FRAMES
from storage.sampling import Sampling, SamplingStrategy


@dataclass(frozen=True, slots=True)
class ModelIndex:
    """What one frames table holds for one video: ``frames`` rows of ``fingerprint``, embedded by
    ``model`` from frames picked by ``sampling``."""

    table: str
    model: str
    fingerprint: str
    frames: int
    sampling: Sampling

    def to_json(self) -> dict[str, Any]:
        """The stored entry (an interval sampling is stored as its ``every_s``, as ever)."""
        if self.sampling.strategy is not SamplingStrategy.INTERVAL:
            raise ValueError(f"no stored form for sampling {self.sampling.label!r}")
        entry = {"table": self.table, "model": self.model, "fingerprint": self.fingerprint, "frames": self.frames}
        return {**entry, "every_s": self.sampling.every_s}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> ModelIndex:
        sampling = Sampling(entry["every_s"])
        return cls(entry["table"], entry["model"], entry["fingerprint"], entry["frames"], sampling)


MODELS = "models"
#: The one row's key.
STATE_KEY = "lifecycle"
#: The table indexes built before per-model tables used (adopted as the first model's table).
LEGACY_FRAMES = FRAMES
#: Longest model slug in a table name (the id's hash keeps names of long ids distinct).
MAX_SLUG = 40
#: A text table's "model": this and the text pipeline's id.
TEXT_MODEL_PREFIX = "text:"

MODELS_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False, metadata=PRIMARY_KEY),
        #: The lifecycle as JSON (``ModelState.to_json``).
        pa.field("state", pa.string(), nullable=False),
        pa.field("rev", pa.int64(), nullable=False),
        pa.field("updated_at", pa.timestamp("us", tz="UTC"), nullable=False),
    ]
)


def table_name(model: str, dim: int, generation: str | None = None) -> str:
    """``frames-<model slug>-<hash>-<dim>d-<generation>``: readable, distinct per model id, and new
    for every backfill (LanceDB names allow letters, digits, ``_``, ``-`` and ``.``)."""
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")[-MAX_SLUG:].strip("-") or "model"
    digest = hashlib.sha256(model.encode()).hexdigest()[:8]
    return f"frames-{slug}-{digest}-{dim}d-{generation or secrets.token_hex(3)}"


@dataclass(frozen=True, slots=True)
class ModelTable:
    """One model's frames table."""

    model: str
    dim: int
    table: str

    @classmethod
    def new(cls, model: str, dim: int) -> ModelTable:
        return cls(model, dim, table_name(model, dim))

    @classmethod
    def for_text(cls, pipeline: str) -> ModelTable:
        """The text table of text pipeline ``pipeline`` (``TextSettings.pipeline_id``): its
        "model" is ``text:<pipeline>``, it has no vectors (dim 0), and a new generation per switch."""
        from storage.texts import text_table_name

        return cls(f"{TEXT_MODEL_PREFIX}{pipeline}", 0, text_table_name(pipeline, secrets.token_hex(3)))

    @property
    def is_text(self) -> bool:
        return self.model.startswith(TEXT_MODEL_PREFIX)

    @property
    def pipeline(self) -> str | None:
        """The text pipeline of a text table (None for a frames table)."""
        return self.model.removeprefix(TEXT_MODEL_PREFIX) if self.is_text else None


@dataclass(frozen=True, slots=True)
class Backfill:
    """A backfill to ``ModelState.target`` in progress."""

    started_at: datetime
    #: Every job whose claim lands after this reads the target among the live models: from then on
    #: an in-flight video no longer holds the switch back (``pipeline.upkeep.backfill``).
    live_from: datetime
    #: Started by the settings (a configured model that differs from the active one), not by a person.
    auto: bool = False
    #: The last progress the coordinator wrote: videos that need the target, those that have it.
    total: int = 0
    done: int = 0
    #: ``done`` when this run of the coordinator began (the rate counts only what it did).
    done_at_resume: int = 0
    resumed_at: datetime | None = None
    progress_at: datetime | None = None
    failed: int = 0
    #: Every video has the target, yet the switch waits: for what (None: it does not, or not yet),
    #: and since when (a restarted coordinator goes on counting the wait's bound from there).
    waiting_for: str | None = None
    waiting_since: datetime | None = None


@dataclass(frozen=True, slots=True)
class ModelState:
    """The lifecycle row. ``active`` answers searches; ``target`` (during a backfill) is written by
    every job as well; ``text`` is the text pipeline's table, for the words of the videos (text jobs fill
    it: docs/design/text.md); ``retired`` tables are kept until ``vidx reindex --cleanup``."""

    active: ModelTable | None = None
    target: ModelTable | None = None
    backfill: Backfill | None = None
    retired: tuple[ModelTable, ...] = ()
    switched_at: datetime | None = None
    text: ModelTable | None = None
    rev: int = 0
    updated_at: datetime | None = None
    #: Top-level keys of the stored row this version does not know (a newer release wrote them), as
    #: JSON: written back as they were, so a rollback's writes keep what the newer release relies on.
    unknown: str = field(default="{}", compare=False, repr=False)

    def live(self) -> list[ModelTable]:
        """The frames tables every index job writes: the active one first, then the target."""
        return [t for t in (self.active, self.target) if t is not None]

    def tables(self) -> list[ModelTable]:
        """Every table the lifecycle names live: ``live``, then the text table (always last: a row's
        first entry is the active model's)."""
        return [*self.live(), *([self.text] if self.text is not None else [])]

    def evolve(self, **changes: Any) -> ModelState:
        return replace(self, **changes)

    def to_json(self) -> str:
        data = asdict(self)
        for kept_out in ("rev", "updated_at", "unknown"):
            data.pop(kept_out)
        unknown = {k: v for k, v in json.loads(self.unknown).items() if k not in data}
        return json.dumps({**unknown, **data}, default=_iso, sort_keys=True)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> ModelState:
        data = json.loads(row["state"])
        backfill = data.get("backfill")
        known = {f.name for f in fields(cls)}
        return cls(
            unknown=json.dumps({k: v for k, v in data.items() if k not in known}, sort_keys=True),
            active=_table(data.get("active")),
            target=_table(data.get("target")),
            backfill=None if backfill is None else _backfill(backfill),
            retired=tuple(t for t in map(_table, data.get("retired") or []) if t is not None),
            switched_at=_time(data.get("switched_at")),
            text=_table(data.get("text")),
            rev=int(row["rev"]),
            updated_at=row["updated_at"],
        )


def _iso(value: Any) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"not JSON: {type(value).__name__}")


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def _backfill(data: dict[str, Any]) -> Backfill:
    """A row's backfill; keys this version does not know (written by a newer one) are left out, so a
    rollback still reads the lifecycle."""
    times = ("started_at", "live_from", "resumed_at", "progress_at", "waiting_since")
    known = {f.name for f in fields(Backfill)}
    values: dict[str, Any] = {k: (_time(v) if k in times else v) for k, v in data.items() if k in known}
    return Backfill(**values)


def _table(value: dict[str, Any] | None) -> ModelTable | None:
    return None if value is None else ModelTable(str(value["model"]), int(value["dim"]), str(value["table"]))


class ModelRegistry:
    """The ``models`` table of one index database (one row)."""

    def __init__(self, db: IndexDatabase) -> None:
        self._db = db
        self._table: Any = None
        self._fresh: FreshTable | None = None
        #: The state as of one table version (versions are immutable: that version says just that).
        self._read_cache: tuple[int, ModelState] | None = None

    def _models(self) -> Any:
        if self._table is None:
            self._table = self._db.create(MODELS, MODELS_SCHEMA)
        return self._table

    @read_errors_are_transient
    def read(self) -> ModelState:
        """The lifecycle as of a version no older than the latest when the call began (empty before
        the first write). The manifest is checked every time; the row is read only when the table's
        version moved since the last read (every index job reads this before it settles: the model
        switch is rare, and each read of the row was a scan on the object store)."""
        if self._fresh is None:
            self._models()
            self._fresh = self._db.fresh(MODELS)
        table = self._fresh.table()
        # The version first: the shared handle only moves forward, so rows read after it are of that
        # version or a later one, and a later one is never looked up under this key again.
        version = int(table.version)
        cached = self._read_cache
        if cached is not None and cached[0] == version:
            return cached[1]
        rows = table.search().limit(1).to_list()
        state = ModelState.from_row(rows[0]) if rows else ModelState()
        self._read_cache = (version, state)
        return state

    @write_errors_are_transient
    def write(self, state: ModelState, expected_rev: int) -> ModelState | None:
        """Write ``state`` if the row still holds revision ``expected_rev`` (0: no row yet); the row as
        written, or None when another writer got there first."""
        written = state.evolve(rev=expected_rev + 1, updated_at=datetime.now(UTC))
        row = {"key": STATE_KEY, "state": written.to_json(), "rev": written.rev, "updated_at": written.updated_at}
        data = pa.Table.from_pylist([row], schema=MODELS_SCHEMA)
        return written if compare_and_set(self._models(), "key", data, expected_rev) else None

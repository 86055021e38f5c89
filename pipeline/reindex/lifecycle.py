"""Model lifecycle operations: the start-up check of the configured model against the index, and
``vidx reindex`` (start, abort, cleanup, status) over the ``models`` row (``storage.models``).

The backfill itself, and the switch when it completes, are ``pipeline.upkeep.backfill``'s. Every change
here is one compare-and-set of the lifecycle row; a change that loses to another writer is decided
again on what that writer left.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from storage.errors import ModelConfigError, ReindexRefused, TransientError
from storage.models import LEGACY_FRAMES, Backfill, ModelState, ModelTable

if TYPE_CHECKING:
    from pipeline.settings import Settings
    from storage.models import ModelRegistry
    from storage.tables import IndexStore

log = logging.getLogger(__name__)

#: Rounds a lifecycle change goes while other writers keep changing the row.
MAX_ROUNDS = 5
#: A cached lifecycle older than this many refresh intervals is not used when a re-read fails.
STALE_AFTER_REFRESHES = 10
#: Prefix of every per-model frames table (``storage.models.table_name``).
TABLE_PREFIX = "frames-"

#: The embedding size of a model id, read from its configuration (``pipeline.embedding.config.model_dim``).
DimOf = Callable[[str], int]


class LiveModels:
    """The lifecycle as last read, re-read at most every ``refresh_s`` (index jobs and searches ask
    per call). A failed re-read falls back on the last state while it is younger than
    ``STALE_AFTER_REFRESHES`` intervals, then raises."""

    def __init__(self, registry: ModelRegistry, refresh_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._refresh_s = refresh_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state: ModelState | None = None
        self._read_at = 0.0

    def state(self) -> ModelState:
        """Raises:
        TransientError: the row could not be read and no recent state is known.
        """
        with self._lock:
            now = self._clock()
            if self._state is not None and now - self._read_at < self._refresh_s:
                return self._state
            try:
                self._state = self._registry.read()
                self._read_at = now
            except TransientError:
                if self._state is None or now - self._read_at > STALE_AFTER_REFRESHES * self._refresh_s:
                    raise
                log.warning("model lifecycle re-read failed; using the state read %.0fs ago", now - self._read_at)
            return self._state

    def live(self) -> list[ModelTable]:
        """The tables an index job writes (active first). Raises TransientError before any model is set."""
        live = self.state().live()
        if not live:
            raise TransientError("the index has no active model yet (the app sets it at start-up)")
        return live

    def text(self) -> ModelTable | None:
        """The text table the index names, as last read (None: no source was ever on; callers also
        look at ``TextSettings.on``: a table named while every source is off now is left alone)."""
        return self.state().text

    def live_now(self) -> list[ModelTable]:
        """``live`` read afresh, whatever the cache holds (an index job asks once before it settles).

        Raises:
            TransientError: the row could not be read.
        """
        state = self._registry.read()
        with self._lock:
            self._state, self._read_at = state, self._clock()
        live = state.live()
        if not live:
            raise TransientError("the index has no active model yet (the app sets it at start-up)")
        return live

    def active(self) -> ModelTable:
        active = self.state().active
        if active is None:
            raise TransientError("the index has no active model yet (the app sets it at start-up)")
        return active


def status_json(state: ModelState, configured: str | None = None, now: datetime | None = None) -> dict[str, Any]:
    """The lifecycle for ``vidx reindex --status``, the admin API and the web page: the models,
    and during a backfill its progress (done/total, rate, ETA)."""
    now = now or datetime.now(UTC)

    def model(t: ModelTable | None) -> dict[str, Any] | None:
        return None if t is None else {"model": t.model, "dim": t.dim, "table": t.table}

    out: dict[str, Any] = {
        "state": "backfilling" if state.target is not None else ("empty" if state.active is None else "idle"),
        "active": model(state.active),
        "target": model(state.target),
        "retired": [model(t) for t in state.retired],
        "text": model(state.text),
        "configured": configured,
        "switched_at": state.switched_at.isoformat() if state.switched_at else None,
        "progress": None,
    }
    b = state.backfill
    if state.target is not None and b is not None:
        since = b.resumed_at or b.started_at
        elapsed = max((now - since).total_seconds(), 0.0)
        gained = max(b.done - b.done_at_resume, 0)
        rate = gained / elapsed if elapsed > 0 and gained else 0.0
        left = max(b.total - b.done, 0)
        out["progress"] = {
            "done": b.done,
            "total": b.total,
            "failed": b.failed,
            "rate_per_s": round(rate, 4),
            "eta_s": round(left / rate, 1) if rate > 0 else None,
            "started_at": b.started_at.isoformat(),
            "progress_at": b.progress_at.isoformat() if b.progress_at else None,
            "auto": b.auto,
            "waiting_for": b.waiting_for,
            "waiting_since": b.waiting_since.isoformat() if b.waiting_since else None,
        }
    return out


class ModelLifecycle:
    """The lifecycle operations of one index (see the module docstring)."""

    def __init__(self, store: IndexStore, settings: Settings, dim_of: DimOf) -> None:
        self._store = store
        self._registry = store.models
        self._settings = settings
        self._dim_of = dim_of

    @property
    def configured(self) -> str:
        return self._settings.model.id

    def state(self) -> ModelState:
        return self._registry.read()

    def status(self) -> dict[str, Any]:
        return status_json(self._registry.read(), self.configured)

    def live_grace_s(self) -> float:
        """How long after a backfill starts a job may still run on a lifecycle read before it: the
        oldest lifecycle a job may use, the longest catalog write, the claim's delay (a first start
        claims only after ``serve.claim_after_s``) and the clocks' leeway."""
        r = self._settings.reindex
        # A job may run on a lifecycle read up to STALE_AFTER_REFRESHES intervals old (re-reads failing).
        oldest_read_s = STALE_AFTER_REFRESHES * r.live_refresh_s
        s = self._settings
        return oldest_read_s + s.writer.catalog_write_timeout_s + s.serve.claim_after_s + r.clock_skew_s

    # -- start-up ---------------------------------------------------------------------------------
    def preflight(self) -> ModelState:
        """``preflight_model``, then ``preflight_text`` (see each).

        Raises:
            ModelConfigError: the configuration and the index disagree (the message says how to fix it).
            ModelUnavailable: a model's configuration can't be read.
            TransientError: the index can't be read or written.
        """
        return self.preflight_text(self.preflight_model())

    def preflight_text(self, state: ModelState) -> ModelState:
        """Hold the configured text pipeline (``TextSettings.pipeline_id``) against the index: name its
        table when the index has none, and when the pipeline changed, a new table (the old one retired:
        every video's words are read again). A configuration with every source off writes nothing: it
        only does not read words (the index keeps its table for replicas that do). A pipeline the
        index switched away from (a retired one) is followed, with a warning, as a model is: a replica
        of the old configuration restarting mid-rollout must not switch back (to return to it on
        purpose, drop the retired tables first: ``vidx reindex --cleanup``).

        Raises:
            TransientError: the index can't be read or written.
        """
        pid = self._settings.text.pipeline_id()
        if pid == "none":
            return state
        for _ in range(MAX_ROUNDS):
            have = state.text.pipeline if state.text is not None else None
            if have == pid:
                return state
            if pid in (t.pipeline for t in state.retired):
                log.warning("the text pipeline %r was switched away from; the index reads words with %r", pid, have)
                return state
            table = ModelTable.for_text(pid)
            retired = state.retired + ((state.text,) if state.text is not None else ())
            written = self._registry.write(state.evolve(text=table, retired=retired), state.rev)
            if written is not None:
                log.info("text pipeline: %s, in table %s", pid, table.table)
                return written
            state = self._registry.read()
        raise TransientError("the model lifecycle row kept changing at start-up")

    def preflight_model(self) -> ModelState:
        """Hold the configured model against the index before the app starts: set the first model
        of an empty index, and refuse (``ModelConfigError``) a model whose dimension differs from its
        table's, or a configured model the index has never been on (unless ``reindex.auto``: then a
        backfill to it starts). A configured model the index switched away from is followed by a
        warning, not refused: the setting lags a ``vidx reindex``, and a replica restarting must not
        take the app down.

        Raises:
            ModelConfigError: the configuration and the index disagree (the message says how to fix it).
            ModelUnavailable: a model's configuration can't be read.
            TransientError: the index can't be read or written.
        """
        configured = self.configured
        dim = self._dim_of(configured)
        for _ in range(MAX_ROUNDS):
            state = self._registry.read()
            if state.active is None:
                first = self._first_table(configured, dim)
                if self._registry.write(ModelState(active=first), state.rev) is None:
                    continue
                log.info("model lifecycle: %s (dim %d) answers, in table %s", first.model, first.dim, first.table)
                state = self._registry.read()
            active = state.active
            assert active is not None
            known = configured in (t.model for t in state.live())
            if known or self._settings.reindex.auto:
                self._check_dims(state, configured, dim)
            if known:
                return state
            if not self._settings.reindex.auto and configured in (t.model for t in state.retired):
                # The index switched away from it (``vidx reindex``) and the setting was not updated
                # yet: follow the index rather than take the app down on a replica's restart.
                log.warning(
                    "VIDX_MODEL__ID is %r, which the index switched away from; %r answers. Set "
                    "VIDX_MODEL__ID=%s to silence this",
                    configured,
                    active.model,
                    active.model,
                )
                return state
            if not self._settings.reindex.auto:
                raise ModelConfigError(
                    f"the index answers with model {active.model!r} but VIDX_MODEL__ID is {configured!r}: "
                    f"run `vidx reindex --model {configured}` to switch without downtime, set "
                    f"VIDX_REINDEX__AUTO=true to start that switch at start-up, or set VIDX_MODEL__ID back"
                )
            if state.target is not None:
                raise ModelConfigError(
                    f"a backfill to {state.target.model!r} is running but VIDX_MODEL__ID is {configured!r}: "
                    f"configure {state.target.model!r}, or stop it with `vidx reindex --abort` first"
                )
            started = self._write_target(state, configured, dim, auto=True)
            if started is not None:
                log.info(
                    "model lifecycle: VIDX_MODEL__ID %s differs from %s: backfill started", configured, active.model
                )
                return started
        raise TransientError("the model lifecycle row kept changing at start-up")

    def _first_table(self, model: str, dim: int) -> ModelTable:
        """The first model's table: a new one, or the ``frames`` table of an index built before
        per-model tables, adopted under the model its rows say built it."""
        legacy = self._store.frames.table()
        if legacy is None:
            return ModelTable.new(model, dim)
        held = int(legacy.schema.field("vector").type.list_size)
        rows = legacy.search().select(["model"]).limit(1).to_list()
        built_by = str(rows[0]["model"]) if rows else model
        if built_by != model:
            # Another model's vectors, whatever their size: adopted under that model, so the usual
            # start-up rules decide (refused, or switched by a backfill with ``reindex.auto``).
            return ModelTable(built_by, held, LEGACY_FRAMES)
        if held != dim:
            raise ModelConfigError(
                f"the index's frames table holds {held}-dimensional vectors but model {model!r} makes {dim}: "
                f"set VIDX_MODEL__ID to the model that built the index, then switch with `vidx reindex --model`"
            )
        return ModelTable(model, dim, LEGACY_FRAMES)

    def _check_dims(self, state: ModelState, configured: str, dim: int) -> None:
        for table in state.live():
            made = dim if table.model == configured else self._dim_of(table.model)
            if made != table.dim:
                raise ModelConfigError(
                    f"model {table.model!r} now makes {made}-dimensional vectors but its table {table.table} "
                    f"holds {table.dim}: the checkpoint behind that id changed. Give the new checkpoint its "
                    f"own id and switch to it with `vidx reindex --model`"
                )
            opened = self._store.frames_table(table.table).table()
            if opened is not None and int(opened.schema.field("vector").type.list_size) != table.dim:
                raise ModelConfigError(f"table {table.table} does not hold {table.dim}-dimensional vectors")

    # -- vidx reindex -----------------------------------------------------------------------------
    def start(self, model: str) -> ModelState:
        """Start a backfill to ``model`` (the same one again: nothing changes).

        Raises:
            ReindexRefused: nothing is indexed yet, ``model`` is already active, or a backfill to
                another model is running.
            ModelUnavailable: ``model``'s configuration can't be read.
        """
        dim = self._dim_of(model)
        for _ in range(MAX_ROUNDS):
            state = self._registry.read()
            if state.active is None:
                raise ReindexRefused("the index has no model yet: start the app with VIDX_MODEL__ID set")
            if state.active.model == model:
                raise ReindexRefused(f"{model!r} is already the active model")
            if state.target is not None:
                if state.target.model == model:
                    return state
                raise ReindexRefused(
                    f"a backfill to {state.target.model!r} is running: `vidx reindex --abort` it first"
                )
            if self._settings.reindex.auto and model != self.configured:
                raise ReindexRefused(
                    f"VIDX_REINDEX__AUTO is on and VIDX_MODEL__ID is {self.configured!r}: the next start would "
                    f"switch back. Set VIDX_MODEL__ID={model} and restart instead"
                )
            started = self._write_target(state, model, dim, auto=False)
            if started is not None:
                return started
        raise TransientError("the model lifecycle row kept changing")

    def _write_target(self, state: ModelState, model: str, dim: int, *, auto: bool) -> ModelState | None:
        now = datetime.now(UTC)
        backfill = Backfill(started_at=now, live_from=now + timedelta(seconds=self.live_grace_s()), auto=auto)
        return self._registry.write(state.evolve(target=ModelTable.new(model, dim), backfill=backfill), state.rev)

    def abort(self) -> ModelState:
        """Stop the backfill and drop its partial table; the active model goes on answering.

        Raises:
            ReindexRefused: no backfill is running.
        """
        for _ in range(MAX_ROUNDS):
            state = self._registry.read()
            if state.target is None:
                raise ReindexRefused("no backfill is running")
            left = self._registry.write(state.evolve(target=None, backfill=None), state.rev)
            if left is not None:
                self._drop(state.target.table)
                log.info("backfill to %s aborted; dropped %s", state.target.model, state.target.table)
                return left
        raise TransientError("the model lifecycle row kept changing")

    def cleanup(self) -> list[str]:
        """Drop the tables of retired models and text pipelines, and per-model frames tables no
        lifecycle names (left by an aborted backfill's late writes). Returns the tables dropped."""
        names = set(self._store.db.table_names())  # listed before the state is read: see below
        for _ in range(MAX_ROUNDS):
            state = self._registry.read()
            # A backfill started meanwhile names its table in the state before any job creates it,
            # so a table listed above that belongs to a live model is in this state.
            live = {t.table for t in state.tables()}
            retired = [t.table for t in state.retired if t.table not in live]
            # Text tables go only when retired: one the row no longer names may be the live one of a
            # row an older release rewrote without its ``text`` (a rollback mid-rollout).
            strays = sorted(n for n in names if n.startswith(TABLE_PREFIX) and n not in live and n not in retired)
            if state.retired and self._registry.write(state.evolve(retired=()), state.rev) is None:
                continue
            dropped = [n for n in [*retired, *strays] if n in names]
            for name in dropped:
                self._drop(name)
            return dropped
        raise TransientError("the model lifecycle row kept changing")

    def _drop(self, name: str) -> None:
        self._store.db.drop(name)
        self._store.forget(name)

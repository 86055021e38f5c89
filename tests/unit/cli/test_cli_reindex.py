"""``vidx reindex`` over a real LanceDB index in a local directory: status, start (again: no change;
another model: refused), abort (its table dropped), cleanup, and ``--wait`` following a switch, an
abort or its timeout while another thread changes the lifecycle row. No model is loaded: the model
dimensions come from a table."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

import pipeline.cli.reindex as cli_reindex
from pipeline.cli.main import app
from pipeline.cli.upload import TIMEOUT_EXIT
from pipeline.settings import Settings
from storage.config import S3Settings
from storage.errors import ModelUnavailable
from storage.models import Backfill, ModelState, ModelTable
from storage.tables import IndexStore
from tests.unit.cli.cli_fakes import offline_env, services_reachable

DIMS = {"model-a": 8, "model-b": 16, "model-c": 4}


def dim_of(model: str) -> int:
    if model not in DIMS:
        raise ModelUnavailable(f"model {model!r} can't be read (VIDX_MODEL__ID)")
    return DIMS[model]


@pytest.fixture
def empty_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> IndexStore:
    """An index with no model yet, in a local directory; every ``vidx reindex`` opens its own
    connection to it (settings at unused ports, every probe answering, fast polls)."""
    offline_env(tmp_path, monkeypatch)
    services_reachable(monkeypatch)
    uri = str(tmp_path / "index")

    def own_store(settings: Settings) -> IndexStore:
        return IndexStore(settings.s3, uri=uri)

    monkeypatch.setattr(cli_reindex, "index_store", own_store)
    monkeypatch.setattr(cli_reindex, "model_dim", dim_of)
    monkeypatch.setattr(cli_reindex, "WAIT_POLL_S", 0.05)
    return IndexStore(S3Settings(), uri=uri)


@pytest.fixture
def index(empty_index: IndexStore) -> IndexStore:
    """The index answering with model-a."""
    store = empty_index
    assert store.models.write(ModelState(active=ModelTable.new("model-a", 8)), 0) is not None
    return store


def vidx(*args: str) -> Result:
    return CliRunner().invoke(app, ["reindex", *args])


def status_of(*args: str) -> dict[str, Any]:
    result = vidx(*args, "--json")
    assert result.exit_code == 0, result.output
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


@contextmanager
def meanwhile(action: Callable[[], None], after_s: float = 0.3) -> Iterator[None]:
    """Run ``action`` on another thread ``after_s`` into the block (a second actor on the index)."""
    errors: list[BaseException] = []

    def run() -> None:
        time.sleep(after_s)
        try:
            action()
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(timeout=30)
    assert not errors, errors


def write(store: IndexStore, change: Callable[[ModelState], ModelState]) -> None:
    state = store.models.read()
    assert store.models.write(change(state), state.rev) is not None


def switch(store: IndexStore) -> None:
    """What the app's coordinator does when the backfill completes: one write of the row."""

    def switched(state: ModelState) -> ModelState:
        assert state.active is not None and state.target is not None
        return state.evolve(
            active=state.target,
            target=None,
            backfill=None,
            retired=(*state.retired, state.active),
            switched_at=datetime.now(UTC),
        )

    write(store, switched)


def progress(done: int, total: int, started_s_ago: float = 100.0) -> Callable[[ModelState], ModelState]:
    def counted(state: ModelState) -> ModelState:
        assert state.backfill is not None
        began = datetime.now(UTC) - timedelta(seconds=started_s_ago)
        backfill = Backfill(
            started_at=began,
            live_from=began,
            total=total,
            done=done,
            resumed_at=began,
            progress_at=datetime.now(UTC),
        )
        return state.evolve(backfill=backfill)

    return counted


# -- status, start, refusals ----------------------------------------------------------------------------


def test_status_of_an_index_with_no_model_yet(empty_index: IndexStore) -> None:
    status = status_of("--status")
    assert (status["state"], status["active"], status["target"], status["progress"]) == ("empty", None, None, None)
    result = vidx("--status")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[:2] == ["state       empty", "active      -"]
    refused = vidx("--model", "model-b")
    assert refused.exit_code == 1
    assert refused.stderr.strip().splitlines() == [
        "vidx: the index has no model yet: start the app with VIDX_MODEL__ID set"
    ]


def test_start_shows_the_backfill_and_search_keeps_the_active_model(index: IndexStore) -> None:
    active = index.models.read().active
    assert active is not None
    result = vidx("--model", " model-b ")
    assert result.exit_code == 0, result.output
    target = index.models.read().target
    assert target is not None and (target.model, target.dim) == ("model-b", 16)
    assert result.stdout.splitlines() == [
        f"backfill to model-b started (dim 16, table {target.table}); search keeps answering with model-a until "
        "it completes. Follow with `vidx reindex --status` or --wait",
        "the backfill runs inside the app: it proceeds only while the app runs (`vidx status`)",
    ]
    status = status_of("--status")
    assert status["state"] == "backfilling"
    assert status["active"] == {"model": "model-a", "dim": 8, "table": active.table}
    assert status["target"] == {"model": "model-b", "dim": 16, "table": target.table}
    assert status["progress"]["done"] == 0 and status["progress"]["auto"] is False
    human = vidx("--status").stdout.splitlines()
    assert human[:3] == [
        "state       backfilling",
        f"active      model-a (dim 8, table {active.table})",
        f"target      model-b (dim 16, table {target.table})",
    ]
    # No round has counted the videos yet: no "0/0".
    assert "progress    not counted yet" in human


def test_starting_the_same_model_again_changes_nothing(index: IndexStore) -> None:
    assert vidx("--model", "model-b").exit_code == 0
    before = index.models.read()
    again = vidx("--model", "model-b")
    assert again.exit_code == 0, again.output
    assert again.stdout.startswith("a backfill to model-b is already running")
    assert index.models.read() == before
    as_json = status_of("--model", "model-b")
    assert before.target is not None and as_json["target"]["table"] == before.target.table


def test_starting_another_model_during_a_backfill_is_refused_in_one_line(index: IndexStore) -> None:
    assert vidx("--model", "model-b").exit_code == 0
    before = index.models.read()
    refused = vidx("--model", "model-c")
    assert refused.exit_code == 1
    assert refused.stderr.strip().splitlines() == [
        "vidx: a backfill to 'model-b' is running: `vidx reindex --abort` it first"
    ]
    assert refused.stdout == "" and index.models.read() == before
    active = vidx("--model", "model-a")
    assert active.exit_code == 1 and "vidx: 'model-a' is already the active model" in active.stderr


def test_a_model_whose_config_cant_be_read_is_one_line(index: IndexStore) -> None:
    result = vidx("--model", "no/such-model")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == ["vidx: model 'no/such-model' can't be read (VIDX_MODEL__ID)"]
    assert index.models.read().target is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give exactly one of --model ID, --status, --abort, --cleanup"),
        (["--status", "--abort"], "give exactly one of --model ID, --status, --abort, --cleanup"),
        (["--status", "--wait"], "--wait goes with --model ID"),
        (["--model", "  "], "--model needs a model id"),
    ],
)
def test_options_that_dont_go_together_fail_in_one_line(index: IndexStore, args: list[str], message: str) -> None:
    result = vidx(*args)
    assert result.exit_code == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"vidx: {message}")


def test_progress_is_shown_as_done_of_total_with_rate_and_eta(index: IndexStore) -> None:
    assert vidx("--model", "model-b").exit_code == 0
    write(index, progress(done=40, total=100, started_s_ago=100))
    status = status_of("--status")["progress"]
    assert (status["done"], status["total"]) == (40, 100)
    assert status["rate_per_s"] == pytest.approx(0.4, rel=0.05) and status["eta_s"] == pytest.approx(150, rel=0.05)
    [line] = [text for text in vidx("--status").stdout.splitlines() if text.startswith("progress")]
    assert line.startswith("progress    40/100 (40.0%), 0.40/s, ETA 2m ")


def test_status_says_what_a_done_backfill_waits_for(index: IndexStore) -> None:
    assert vidx("--model", "model-b").exit_code == 0
    waits = "the vector index of the new table (300000 rows; index maintenance builds it)"
    done = progress(done=100, total=100)
    write(index, lambda state: (s := done(state)).evolve(backfill=replace(s.backfill, waiting_for=waits)))
    assert status_of("--status")["progress"]["waiting_for"] == waits
    [line] = [text for text in vidx("--status").stdout.splitlines() if text.startswith("switch")]
    assert line == f"switch      waits for {waits}"


# -- abort and cleanup ----------------------------------------------------------------------------------


def test_abort_goes_back_to_idle_and_drops_the_target_table(index: IndexStore) -> None:
    assert vidx("--model", "model-b").exit_code == 0
    target = index.models.read().target
    assert target is not None
    index.frames_table(target.table).table(dim=target.dim)  # a backfill job created it
    assert index.db.open(target.table) is not None
    result = vidx("--abort")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == (
        "backfill to model-b aborted and its table dropped; the active model answers as before"
    )
    state = index.models.read()
    assert state.target is None and state.backfill is None and state.active is not None
    assert state.active.model == "model-a"
    assert index.db.open(target.table) is None
    again = vidx("--abort", "--json")
    assert again.exit_code == 1 and again.stdout == ""
    assert again.stderr.strip().splitlines() == ["vidx: no backfill is running"]


def test_cleanup_drops_the_retired_models_tables(index: IndexStore) -> None:
    assert vidx("--model", "model-b").exit_code == 0
    old = index.models.read().active
    assert old is not None
    index.frames_table(old.table).table(dim=old.dim)
    switch(index)
    status = status_of("--status")
    assert status["state"] == "idle" and status["active"]["model"] == "model-b" and status["switched_at"]
    assert status["retired"] == [{"model": "model-a", "dim": 8, "table": old.table}]
    human = vidx("--status").stdout
    assert f"retired     {old.table} (model-a)  — drop with `vidx reindex --cleanup`" in human
    cleaned = vidx("--cleanup", "--json")
    assert cleaned.exit_code == 0, cleaned.output
    answer = json.loads(cleaned.stdout)
    assert answer["dropped"] == [old.table] and answer["status"]["retired"] == []
    assert index.db.open(old.table) is None
    assert vidx("--cleanup").stdout.splitlines()[0] == "dropped 0 table(s)"


# -- --wait ---------------------------------------------------------------------------------------------


def test_wait_gives_up_after_its_timeout_and_the_backfill_goes_on(index: IndexStore) -> None:
    began = time.monotonic()
    result = vidx("--model", "model-b", "--wait", "--timeout", "0.3")
    assert result.exit_code == TIMEOUT_EXIT, result.output
    assert time.monotonic() - began < 10
    [line] = [text for text in result.stderr.splitlines() if text.startswith("vidx:")]
    assert "not done after 0.3s" in line and "vidx reindex --status" in line
    state = index.models.read()
    assert state.target is not None and state.target.model == "model-b"


def test_wait_follows_the_backfill_until_another_actor_switches(index: IndexStore) -> None:
    def coordinator() -> None:
        # Once the command has started the backfill (however slow the machine), it counts and switches.
        deadline = time.monotonic() + 20
        while index.models.read().target is None and time.monotonic() < deadline:
            time.sleep(0.05)
        write(index, progress(done=1, total=2))
        time.sleep(0.2)
        switch(index)

    with meanwhile(coordinator):
        result = vidx("--model", "model-b", "--wait", "--timeout", "30", "--json")
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert status["state"] == "idle" and status["active"]["model"] == "model-b" and status["switched_at"]
    assert "\r" not in result.stderr


def test_wait_for_a_backfill_already_running_ends_at_its_switch(index: IndexStore) -> None:
    assert vidx("--model", "model-b").exit_code == 0
    with meanwhile(lambda: switch(index)):
        result = vidx("--model", "model-b", "--wait", "--timeout", "30")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("a backfill to model-b is already running")
    assert "model-b answers searches now" in lines
    # Once switched, waiting for it again is done at once.
    again = vidx("--model", "model-b", "--wait", "--timeout", "5")
    assert again.exit_code == 0 and again.stdout.startswith("model-b is already the active model")


def test_wait_exits_3_when_the_backfill_is_aborted_under_it(index: IndexStore) -> None:
    def abort() -> None:
        write(index, lambda state: state.evolve(target=None, backfill=None))

    with meanwhile(abort):
        result = vidx("--model", "model-b", "--wait", "--timeout", "30")
    assert result.exit_code == 3, result.output
    [line] = [text for text in result.stderr.splitlines() if text.startswith("vidx:")]
    assert line == "vidx: the backfill to model-b ended without switching (aborted?); model-a still answers"


def test_the_index_unreachable_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offline_env(tmp_path, monkeypatch)
    result = vidx("--status")
    assert result.exit_code == 1
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("vidx: MinIO is not reachable at ") and "vidx up" in line

"""``vidx reindex``: switch the index to another embedding model without downtime — start a backfill
to it, follow it, abort it, drop what retired models left (``pipeline.reindex.lifecycle``).

It reads and writes the lifecycle row in the index directly, so it works while the app is down; the
backfill itself runs inside the app and proceeds only while the app runs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from pipeline.cli.common import CliError, settings_of
from pipeline.cli.errors import errors, minio
from pipeline.cli.output import bars_on, print_json, progress_bar
from pipeline.cli.upload import TIMEOUT_EXIT
from pipeline.settings import Settings
from storage.errors import TransientError

if TYPE_CHECKING:
    from pipeline.reindex.lifecycle import ModelLifecycle
    from storage.tables import IndexStore

#: Exit status of ``--wait`` when the backfill ended without switching to the model (aborted): not 1,
#: which is any failure to run the command, so a script can tell the two apart.
ABORTED_EXIT = 3
#: How often ``--wait`` reads the lifecycle.
WAIT_POLL_S = 2.0
#: ``--wait``'s default bound: a backfill re-embeds every video, which can take hours.
DEFAULT_WAIT_TIMEOUT_S = 24 * 3600.0
#: Without a progress bar (stderr not a terminal), ``--wait`` prints a progress line at most this often.
WAIT_LINE_EVERY_S = 30.0
#: Width of the labels of the human status.
LABEL_CHARS = 12


def index_store(settings: Settings) -> IndexStore:
    """The index the lifecycle row lives in (a seam for tests)."""
    from storage.tables import IndexStore

    return IndexStore(settings.s3)


def model_dim(model: str) -> int:
    """The embedding size of ``model``, from its configuration (no weights are loaded).

    Raises:
        ModelUnavailable: the model's configuration can't be read.
    """
    from pipeline.embedding.config import model_dim as read_dim

    return read_dim(model)


def open_lifecycle(settings: Settings) -> ModelLifecycle:
    from pipeline.reindex.lifecycle import ModelLifecycle

    return ModelLifecycle(index_store(settings), settings, dim_of=model_dim)


# -- what people read -----------------------------------------------------------------------------------


def duration(seconds: float) -> str:
    """``1h 02m``, ``4m 05s``, ``12s``."""
    total = round(max(seconds, 0.0))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def describe_model(model: dict[str, Any] | None) -> str:
    return "-" if model is None else f"{model['model']} (dim {model['dim']}, table {model['table']})"


def describe_progress(progress: dict[str, Any]) -> str:
    """``done/total (x%), rate/s, ETA`` of a backfill."""
    done, total = int(progress["done"]), int(progress["total"])
    pct = f" ({100 * done / total:.1f}%)" if total else ""
    rate = float(progress.get("rate_per_s") or 0.0)
    eta = progress.get("eta_s")
    parts = [f"{done}/{total}{pct}", f"{rate:.2f}/s" if rate else "rate not known yet"]
    parts.append(f"ETA {duration(float(eta))}" if eta is not None else "ETA not known yet")
    if progress.get("failed"):
        parts.append(f"{progress['failed']} failed")
    return ", ".join(parts)


def status_lines(status: dict[str, Any]) -> list[str]:
    """The lifecycle for people: one labelled line per fact."""

    def line(label: str, value: str) -> str:
        return f"{label:<{LABEL_CHARS}}{value}"

    lines = [line("state", status["state"]), line("active", describe_model(status["active"]))]
    if status["target"] is not None:
        lines.append(line("target", describe_model(status["target"])))
        progress = status.get("progress")
        # Before the coordinator's first round the counts are zeros, not a count.
        counted = progress if progress and progress.get("progress_at") else None
        lines.append(line("progress", describe_progress(counted) if counted else "not counted yet"))
        if progress and progress.get("waiting_for"):
            lines.append(line("switch", f"waits for {progress['waiting_for']}"))
        if progress and progress.get("auto"):
            lines.append(line("started by", "VIDX_REINDEX__AUTO (the app's configured model)"))
    text = status.get("text")
    lines.append(line("text", f"{text['model'].removeprefix('text:')} in {text['table']}" if text else "-"))
    retired = status.get("retired") or []
    lines.append(
        line("retired", ", ".join(f"{t['table']} ({t['model']})" for t in retired) if retired else "-")
        + ("  — drop with `vidx reindex --cleanup`" if retired else "")
    )
    if status.get("switched_at"):
        lines.append(line("switched at", str(status["switched_at"])))
    active, configured = status["active"], status.get("configured")
    if active is not None and status["target"] is None and configured and configured != active["model"]:
        lines.append(
            line(
                "note",
                f"VIDX_MODEL__ID here is {configured!r}: set it to {active['model']!r} before the app next starts",
            )
        )
    return lines


def _echo_status(status: dict[str, Any]) -> None:
    for text in status_lines(status):
        typer.echo(text)


# -- the command ----------------------------------------------------------------------------------------


def reindex(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Option("--model", metavar="ID", help="Start a backfill to this model (hub id or checkpoint directory)."),
    ] = None,
    show_status: Annotated[
        bool, typer.Option("--status", help="Show the models and a running backfill's progress.")
    ] = False,
    abort: Annotated[
        bool, typer.Option("--abort", help="Stop the backfill and drop its table; the active model stays.")
    ] = False,
    cleanup: Annotated[
        bool,
        typer.Option(
            "--cleanup", help="Drop the tables of retired models and text pipelines (and of aborted backfills)."
        ),
    ] = False,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            help="With --model: follow the backfill until the switch (exit 0), an abort (exit 3) or --timeout (124).",
        ),
    ] = False,
    timeout_s: Annotated[
        float,
        typer.Option(
            "--timeout",
            metavar="SECONDS",
            min=0.0,
            help="With --wait: give up waiting after this long (24 h by default); the backfill goes on.",
        ),
    ] = DEFAULT_WAIT_TIMEOUT_S,
    as_json: Annotated[bool, typer.Option("--json", help="Print the lifecycle as JSON.")] = False,
) -> None:
    """Switch the index to another embedding model without downtime: --model ID starts a backfill to a
    new table while search keeps answering with the active model, which is switched atomically when it
    completes. Give exactly one of --model, --status, --abort, --cleanup."""
    settings = settings_of(ctx)
    with errors():
        model_id = _model_asked(model, show_status, abort, cleanup, wait)
    with errors(minio(settings)):
        lifecycle = open_lifecycle(settings)
        if model_id is not None:
            _start(lifecycle, model_id, wait=wait, as_json=as_json)
            if wait:
                _wait_for_switch(lifecycle, model_id, timeout_s, as_json)
        elif abort:
            _abort(lifecycle, as_json)
        elif cleanup:
            _cleanup(lifecycle, as_json)
        else:
            _show_status(lifecycle, as_json)


def _model_asked(model: str | None, show_status: bool, abort: bool, cleanup: bool, wait: bool) -> str | None:
    """The model ``--model`` asks for (None: another action was chosen).

    Raises:
        CliError: not exactly one action, ``--wait`` without ``--model``, or an empty model id.
    """
    if sum((model is not None, show_status, abort, cleanup)) != 1:
        raise CliError("give exactly one of --model ID, --status, --abort, --cleanup")
    if wait and model is None:
        raise CliError("--wait goes with --model ID (the same ID again follows a backfill already running)")
    model_id = None if model is None else model.strip()
    if model_id == "":
        raise CliError("--model needs a model id")
    return model_id


def _show_status(lifecycle: ModelLifecycle, as_json: bool) -> None:
    status = lifecycle.status()
    if as_json:
        print_json(status)
    else:
        _echo_status(status)


def _cleanup(lifecycle: ModelLifecycle, as_json: bool) -> None:
    dropped = lifecycle.cleanup()
    status = lifecycle.status()
    if as_json:
        print_json({"dropped": dropped, "status": status})
    else:
        typer.echo(f"dropped {len(dropped)} table(s){': ' + ', '.join(dropped) if dropped else ''}")
        _echo_status(status)


def _abort(lifecycle: ModelLifecycle, as_json: bool) -> None:
    """Raises ReindexRefused when no backfill is running."""
    before = lifecycle.state()
    lifecycle.abort()
    status = lifecycle.status()
    if as_json:
        print_json(status)
        return
    target = f" to {before.target.model}" if before.target is not None else ""
    typer.echo(f"backfill{target} aborted and its table dropped; the active model answers as before")
    _echo_status(status)


def _start(lifecycle: ModelLifecycle, model: str, *, wait: bool, as_json: bool) -> None:
    """Start the backfill to ``model`` (with ``wait``, one already running, or already done, is fine).

    Raises:
        ReindexRefused: the lifecycle's state does not allow it (the message says what to do).
    """
    from pipeline.reindex.lifecycle import status_json

    before = lifecycle.state()
    if wait and before.active is not None and before.active.model == model and before.target is None:
        if not as_json:
            typer.echo(f"{model} is already the active model")
        return
    running = before.target is not None and before.target.model == model
    state = lifecycle.start(model)
    if as_json:
        if not wait:
            print_json(status_json(state, lifecycle.configured))
        return
    active, target = state.active, state.target
    assert active is not None and target is not None
    if running:
        typer.echo(f"a backfill to {model} is already running (dim {target.dim}, table {target.table})")
    else:
        typer.echo(
            f"backfill to {model} started (dim {target.dim}, table {target.table}); search keeps answering "
            f"with {active.model} until it completes. Follow with `vidx reindex --status` or --wait"
        )
    typer.echo("the backfill runs inside the app: it proceeds only while the app runs (`vidx status`)")


class _Progress:
    """A backfill's progress on stderr: a bar on a terminal, else a line when it moved, at most
    every ``WAIT_LINE_EVERY_S`` (nothing with ``--json``)."""

    def __init__(self, bar: Any, model: str, as_json: bool) -> None:
        self._bar, self._model = bar, model
        self._lines = not as_json and not bars_on(as_json)
        self._shown: int | None = None
        self._shown_at = 0.0

    def show(self, progress: dict[str, Any]) -> None:
        done, total = int(progress["done"]), int(progress["total"])
        self._bar.total = total
        self._bar.n = min(done, total)
        self._bar.set_postfix_str(describe_progress(progress).split(", ", 1)[-1], refresh=False)
        self._bar.refresh()
        now = time.monotonic()
        due = self._shown is None or now - self._shown_at >= WAIT_LINE_EVERY_S
        if self._lines and done != self._shown and due:
            typer.echo(f"backfill {self._model}: {describe_progress(progress)}", err=True)
            self._shown, self._shown_at = done, now


def _wait_for_switch(lifecycle: ModelLifecycle, model: str, timeout_s: float, as_json: bool) -> None:
    """Poll the lifecycle until ``model`` is active (return), the backfill to it is gone (exit 3) or
    ``timeout_s`` passed (exit 124). A lifecycle that can't be read is retried until the deadline."""
    from pipeline.reindex.lifecycle import status_json

    deadline = time.monotonic() + timeout_s
    status: dict[str, Any] | None = None
    last_error: str | None = None
    bar_format = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}{postfix}"
    with progress_bar(0, as_json=as_json, desc=f"backfill {model}", bar_format=bar_format) as bar:
        shown = _Progress(bar, model, as_json)
        while True:
            try:
                state = lifecycle.state()
            except TransientError as exc:  # the store blipping: ask again until the deadline
                last_error = str(exc)
            else:
                status, last_error = status_json(state, lifecycle.configured), None
                if state.active is not None and state.active.model == model:
                    break
                if state.target is None or state.target.model != model:
                    _ended(status, model, as_json)
                if status["progress"]:
                    shown.show(status["progress"])
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _timed_out(status, model, timeout_s, last_error, as_json)
            time.sleep(min(WAIT_POLL_S, remaining))
    assert status is not None  # the loop ends only on a status that shows the switch
    if as_json:
        print_json(status)
        return
    typer.echo(f"{model} answers searches now")
    _echo_status(status)


def _ended(status: dict[str, Any], model: str, as_json: bool) -> NoReturn:
    if as_json:
        print_json(status)
    target = status["target"]
    other = f"; a backfill to {target['model']} runs instead" if target is not None else ""
    active = status["active"]["model"] if status["active"] else "none"
    typer.echo(
        f"vidx: the backfill to {model} ended without switching (aborted?){other}; {active} still answers",
        err=True,
    )
    raise typer.Exit(ABORTED_EXIT)


def _timed_out(
    status: dict[str, Any] | None, model: str, timeout_s: float, last_error: str | None, as_json: bool
) -> NoReturn:
    if as_json and status is not None:
        print_json(status)
    progress = (status or {}).get("progress")
    where = describe_progress(progress) if progress else "no progress counted yet"
    why = f"; last error: {last_error}" if last_error else ""
    typer.echo(
        f"vidx: the backfill to {model} is not done after {timeout_s:g}s ({where}){why} — it goes on while the "
        "app runs; follow with `vidx reindex --status` or wait longer (--timeout)",
        err=True,
    )
    raise typer.Exit(TIMEOUT_EXIT)

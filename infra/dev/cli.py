"""The local stack's commands of ``vidx``: ``up``, ``down``, ``status``, ``demo`` and ``tiny-model``.

The dev tooling adds them to the CLI through the ``vidx.cli`` entry point (pyproject.toml, ``register``):
the product's CLI never imports ``infra``; everything else it does talks to a deployed app through its
API, MinIO and RabbitMQ.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.cli.common import ApiClient, CliError, settings_of
from pipeline.cli.errors import errors
from pipeline.cli.output import Column, print_json, table
from pipeline.settings import Settings


def up(ctx: typer.Context) -> None:
    """Start the local stack (RabbitMQ, MinIO, Ray, the Serve app) under the state dir."""
    from infra.dev import stack

    with errors():
        stack.up(settings_of(ctx), echo=typer.echo)


def down(ctx: typer.Context) -> None:
    """Stop everything 'vidx up' started."""
    from infra.dev import stack

    with errors():
        stack.down(settings_of(ctx), echo=typer.echo)


def status(ctx: typer.Context, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Show whether each component of the local stack runs."""
    from infra.dev import stack

    with errors():
        settings = settings_of(ctx)
        components = stack.status(settings)
    answer = _app_status(settings) if any(c.name == "app" and c.running for c in components) else None
    check = answer.get("check") if answer else None
    services: dict[str, Any] = (answer or {}).get("services") or {}
    if as_json:
        print_json(
            [
                *(c.to_dict() for c in components),
                {"name": "check", "detail": _describe_check(check), "state": check},
                *({"name": name, "state": state} for name, state in services.items()),
            ]
        )
        return
    rows = [
        (c.name, "running" if c.running else "stopped", None if c.detail == "stopped" else c.detail) for c in components
    ]
    table(
        [Column("COMPONENT"), Column("STATE"), Column("DETAIL", fold=True)],
        [*rows, ("check", _check_verdict(check), _describe_check(check)), *map(_service_row, services.items())],
        empty="no components",
    )


def _service_row(item: tuple[str, dict[str, Any]]) -> tuple[str, str, str]:
    """A background service of the app: alive or stopped, and how long ago it last succeeded."""
    name, state = item
    last_ok = state.get("last_ok")
    ago = f"last success {max(0.0, time.time() - float(last_ok)):.0f}s ago" if last_ok else "no success yet"
    return name, "running" if state.get("alive") else "stopped", ago


def _check_verdict(state: dict[str, Any] | None) -> str:
    if state is None:
        return "unknown"
    last = state.get("last")
    if not last:
        return "pending"
    return "drift" if last["inconsistencies"] else "ok"


def _app_status(settings: Settings) -> dict[str, Any] | None:
    """The running app's ``/v1/status`` (None when it can't be asked)."""
    try:
        answer: dict[str, Any] = ApiClient(settings).request("GET", "/v1/status")
    except CliError:
        return None
    return answer


def _describe_check(state: dict[str, Any] | None) -> str:
    if state is None:
        return "unknown (the app is not answering)"
    last = state.get("last")
    if not last:
        return f"no round yet ({state.get('rounds', 0)} rounds; every VIDX_CHECK__INTERVAL_S)"
    kinds = ", ".join(f"{k} {n}" for k, n in last["counts"].items() if n) or "none"
    error = f"; last error: {state['last_error']}" if state.get("last_error") else ""
    return (
        f"last round {last['started_at']}: {last['inconsistencies']} inconsistencies ({kinds}), "
        f"{last['in_flight']} in flight, {last['submitted']} repairs submitted{error}"
    )


def tiny_model(
    directory: Annotated[Path, typer.Argument(help="Where to write the checkpoint.")],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Build a tiny random SigLIP checkpoint (offline; for tests and demos, not for real search)."""
    with errors():
        from infra.dev.tinymodel import build_tiny_siglip

        path = build_tiny_siglip(directory, seed=seed).resolve()
    typer.echo(f"tiny SigLIP checkpoint written to {path}")
    typer.echo(f"use it with: export VIDX_MODEL__ID={path}")


def demo(ctx: typer.Context) -> None:
    """Start the stack, upload generated sample videos, wait until indexed, search them."""
    with errors():
        from infra.dev.demo import run_demo

        run_demo(settings_of(ctx), typer.echo)


def register(app: typer.Typer) -> None:
    """The ``vidx.cli`` entry point: add the local stack's commands to ``app``."""
    app.command()(up)
    app.command()(down)
    app.command()(status)
    app.command("tiny-model")(tiny_model)
    app.command()(demo)

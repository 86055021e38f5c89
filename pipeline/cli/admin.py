"""Operator commands of the ``vidx`` CLI over the held queues: ``vidx dlq list|replay`` and
``vidx parked list|replay``, one pair of commands (``held_app``) built for each queue.

They talk to the broker directly rather than through the API, so they work while the app is down —
which is when they are needed most.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic

import typer

from events.deadletters import DeadLetter, DeadLetterQueue
from events.held import H, HeldQueue, ReplayReport
from events.parked import ParkedEvent, ParkedQueue
from pipeline.cli.common import settings_of
from pipeline.cli.errors import Component, errors, minio, rabbitmq
from pipeline.cli.output import Column, print_json, table
from pipeline.settings import Settings
from storage.errors import InvalidInput

#: What ``--json`` says of each option.
JSON_HELP = "Print JSON."


@dataclass(frozen=True, slots=True)
class HeldCommands(Generic[H]):
    """What ``vidx dlq`` and ``vidx parked`` differ in; their commands are written once, in ``held_app``."""

    name: str
    help: str
    list_help: str
    replay_help: str
    #: One held message and its ids, as the help and the errors name them.
    one: str
    ids: str
    #: The queue's class: what it is called and what it holds.
    kind: type[HeldQueue[H]]
    open: Callable[[Settings], HeldQueue[H]]
    columns: tuple[Column, ...]
    row: Callable[[H], tuple[object, ...]]
    #: One replayed message in the replay's answer.
    replayed: Callable[[H], dict[str, Any]]
    replay: Callable[[Settings, list[str] | None], ReplayReport[H]]
    #: The services a replay contacts (a listing contacts only the broker).
    replay_uses: tuple[Callable[[Settings], Component], ...]


def _ids_or_all(ids: list[str] | None, replay_all: bool, what: str) -> None:
    if bool(ids) == replay_all:
        raise InvalidInput(f"name {what} or pass --all (not both)")


def _when(at: datetime | None) -> str | None:
    return at.strftime("%Y-%m-%d %H:%M:%S") if at else None


def held_app(spec: HeldCommands[Any]) -> typer.Typer:
    """``list`` and ``replay`` over the held queue ``spec`` names."""
    app = typer.Typer(help=spec.help, no_args_is_help=True, rich_markup_mode=None)
    # Defaults, not Annotated: the help texts differ per queue, and annotations (strings here) are
    # resolved in the module's namespace, where a closure's values aren't.
    limit_option = typer.Option(100, help="List at most this many.", min=1)
    json_option = typer.Option(False, "--json", help=JSON_HELP)
    ids_argument = typer.Argument(None, help=f"{spec.ids.capitalize()} (from 'vidx {spec.name} list').")
    all_option = typer.Option(False, "--all", help=f"Replay every {spec.one}.")

    @app.command("list", help=spec.list_help)
    def list_held(ctx: typer.Context, limit: int = limit_option, as_json: bool = json_option) -> None:
        settings = settings_of(ctx)
        with errors(rabbitmq(settings)):
            items = spec.open(settings).list(limit)
        if as_json:
            print_json([item.summary() for item in items])
            return
        table(spec.columns, [spec.row(item) for item in items], empty=f"no {spec.kind.holds}")

    @app.command("replay", help=spec.replay_help)
    def replay_held(
        ctx: typer.Context,
        ids: list[str] | None = ids_argument,
        replay_all: bool = all_option,
        as_json: bool = json_option,
    ) -> None:
        settings = settings_of(ctx)
        with errors():
            _ids_or_all(ids, replay_all, spec.ids)
        with errors(*(use(settings) for use in spec.replay_uses)):
            report = spec.replay(settings, None if replay_all else ids)
            missing = sorted(set(ids or []) - {item.id for item in report.replayed})
        replayed = [spec.replayed(item) for item in report.replayed]
        if as_json:
            print_json({"replayed": replayed, "remaining": report.remaining, "missing": missing})
        else:
            for item in replayed:
                typer.echo(f"replayed {item['id']}  {item.get('uri') or ' '.join(item.get('uris', [])) or '-'}")
            typer.echo(f"{len(replayed)} replayed, {report.remaining} left in the {spec.kind.what}")
        if missing:
            typer.echo(f"vidx: not found: {', '.join(missing)}", err=True)
            raise typer.Exit(1)

    return app


# -- the dead-letter queue and the parked queue ---------------------------------------------------------


def _dead_letter_queue(settings: Settings) -> DeadLetterQueue:
    from pipeline.jobs.taskqueue import dead_letter_queue  # imports Ray: only when a command needs it

    return dead_letter_queue(settings)


def _replay_dead_letters(settings: Settings, ids: list[str] | None) -> ReplayReport[DeadLetter]:
    from pipeline.jobs.taskqueue import dead_letter_queue, queueing_sink
    from storage.tables import IndexStore

    return dead_letter_queue(settings).replay(queueing_sink(settings, IndexStore(settings.s3)), ids)


def _replay_parked(settings: Settings, ids: list[str] | None) -> ReplayReport[ParkedEvent]:
    return ParkedQueue(settings.amqp).replay(ids)


DEAD_LETTERS: HeldCommands[DeadLetter] = HeldCommands(
    name="dlq",
    help="The dead-letter queue: jobs that failed for good.",
    list_help="Failed jobs: id, when, attempts, uri, reason. The queue is left as it was.",
    replay_help="Queue the jobs of dead letters again (after fixing their cause) and remove those letters.",
    one="dead letter",
    ids="dead-letter ids",
    kind=DeadLetterQueue,
    open=_dead_letter_queue,
    columns=(
        Column("ID"),
        Column("FAILED AT"),
        Column("ATTEMPTS", right=True),
        Column("KIND"),
        Column("VIDEO", fold=True),
        Column("REASON", fold=True),
    ),
    row=lambda d: (d.id, _when(d.failed_at), d.attempts, d.kind.value, d.uri, d.reason),
    replayed=lambda d: {"id": d.id, "uri": d.uri},
    replay=_replay_dead_letters,
    replay_uses=(rabbitmq, minio),
)

PARKED: HeldCommands[ParkedEvent] = HeldCommands(
    name="parked",
    help="Parked bucket events: messages the event router gave up on.",
    list_help="Parked events: id, when, attempts, objects, reason. The queue is left as it was.",
    replay_help=(
        "Hand parked events to the router again (after fixing their cause) and remove them from the parked queue."
    ),
    one="parked event",
    ids="parked event ids",
    kind=ParkedQueue,
    open=lambda settings: ParkedQueue(settings.amqp),
    columns=(
        Column("ID"),
        Column("PARKED AT"),
        Column("ATTEMPTS", right=True),
        Column("OBJECTS", fold=True),
        Column("REASON", fold=True),
    ),
    row=lambda e: (e.id, _when(e.parked_at), e.attempts, " ".join(e.uris), e.reason),
    replayed=lambda e: {"id": e.id, "uris": list(e.uris)},
    replay=_replay_parked,
    replay_uses=(rabbitmq,),
)

dlq_app = held_app(DEAD_LETTERS)
parked_app = held_app(PARKED)

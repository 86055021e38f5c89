"""Operator commands of the ``vidx`` CLI: ``vidx reconcile``, ``vidx dlq list|replay`` and
``vidx parked list|replay``.

They talk to the services directly (object store, catalog, broker) rather than through the API, so
they work while the app is down — which is when they are needed most.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import typer

from events.deadletters import DeadLetterQueue
from events.parked import ParkedQueue
from pipeline.cli.check import configured_buckets, print_findings
from pipeline.cli.common import settings_of
from pipeline.cli.errors import errors, minio, rabbitmq
from pipeline.cli.output import Column, print_json, table
from pipeline.settings import Settings
from storage.errors import InvalidInput

dlq_app = typer.Typer(
    help="The dead-letter queue: jobs that failed for good.", no_args_is_help=True, rich_markup_mode=None
)
parked_app = typer.Typer(
    help="Parked bucket events: messages the event router gave up on.", no_args_is_help=True, rich_markup_mode=None
)


#: What ``--json`` says of each option.
JSON_HELP = "Print JSON."


def dead_letter_queue(settings: Settings) -> DeadLetterQueue:
    return DeadLetterQueue(settings.amqp.url.get_secret_value(), settings.serve.failed_queue)


def _ids_or_all(ids: list[str] | None, replay_all: bool, what: str) -> None:
    if bool(ids) == replay_all:
        raise InvalidInput(f"name {what} or pass --all (not both)")


def _when(at: datetime | None) -> str | None:
    return at.strftime("%Y-%m-%d %H:%M:%S") if at else None


def reconcile(
    ctx: typer.Context,
    bucket: Annotated[
        list[str] | None,
        typer.Option("--bucket", "-b", metavar="BUCKET", help="A configured bucket (repeatable; default: all)."),
    ] = None,
    prefix: Annotated[str, typer.Option(help="Only keys under this prefix.")] = "",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report the drift; submit nothing.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="One line per change.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print each bucket's report as JSON.")] = False,
) -> None:
    """Compare buckets with the index and queue the jobs that repair drift: objects never indexed,
    indexed at an old version, index entries whose object is gone, rows that disagree with the
    catalog (``vidx check --repair``, one summary per bucket)."""
    settings = settings_of(ctx)
    uses = (minio(settings),) if dry_run else (minio(settings), rabbitmq(settings))
    reports = []
    with errors():
        buckets = configured_buckets(settings, bucket)
    with errors(*uses):
        from pipeline.index.taskqueue import queueing_sink
        from pipeline.upkeep.check import build_checker
        from storage.tables import IndexStore

        store = IndexStore(settings.s3)
        checker = build_checker(settings, store, None if dry_run else queueing_sink(settings, store))
        for name in buckets:
            report = checker.run([name], prefix=prefix, repair=not dry_run)
            reports.append(report)
            if not as_json:
                if verbose:
                    print_findings(report.found)
                typer.echo(report.summary())
    if as_json:
        print_json([report.as_json() for report in reports])


@dlq_app.command("list")
def dlq_list(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(help="List at most this many.", min=1)] = 100,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Failed jobs: id, when, attempts, uri, reason. The queue is left as it was."""
    settings = settings_of(ctx)
    with errors(rabbitmq(settings)):
        letters = dead_letter_queue(settings).list(limit)
    if as_json:
        print_json([letter.summary() for letter in letters])
        return
    table(
        [
            Column("ID"),
            Column("FAILED AT"),
            Column("ATTEMPTS", right=True),
            Column("KIND"),
            Column("VIDEO", fold=True),
            Column("REASON", fold=True),
        ],
        [
            (letter.id, _when(letter.failed_at), letter.attempts, letter.kind.value, letter.uri, letter.reason)
            for letter in letters
        ],
        empty="no dead letters",
    )


@dlq_app.command("replay")
def dlq_replay(
    ctx: typer.Context,
    ids: Annotated[list[str] | None, typer.Argument(help="Dead-letter ids (from 'vidx dlq list').")] = None,
    replay_all: Annotated[bool, typer.Option("--all", help="Replay every dead letter.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Queue the jobs of dead letters again (after fixing their cause) and remove those letters."""
    settings = settings_of(ctx)
    with errors():
        _ids_or_all(ids, replay_all, "dead-letter ids")
    with errors(rabbitmq(settings), minio(settings)):
        from pipeline.index.taskqueue import queueing_sink
        from storage.tables import IndexStore

        report = dead_letter_queue(settings).replay(
            queueing_sink(settings, IndexStore(settings.s3)), None if replay_all else ids
        )
        missing = sorted(set(ids or []) - {letter.id for letter in report.replayed})
    replayed = [{"id": letter.id, "uri": letter.uri} for letter in report.replayed]
    _replayed(replayed, report.remaining, missing, "dead-letter queue", as_json)


def _replayed(replayed: list[dict[str, Any]], remaining: int, missing: list[str], queue: str, as_json: bool) -> None:
    if as_json:
        print_json({"replayed": replayed, "remaining": remaining, "missing": missing})
    else:
        for item in replayed:
            typer.echo(f"replayed {item['id']}  {item.get('uri') or ' '.join(item.get('uris', [])) or '-'}")
        typer.echo(f"{len(replayed)} replayed, {remaining} left in the {queue}")
    if missing:
        typer.echo(f"vidx: not found: {', '.join(missing)}", err=True)
        raise typer.Exit(1)


@parked_app.command("list")
def parked_list(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(help="List at most this many.", min=1)] = 100,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Parked events: id, when, attempts, objects, reason. The queue is left as it was."""
    settings = settings_of(ctx)
    with errors(rabbitmq(settings)):
        events = ParkedQueue(settings.amqp).list(limit)
    if as_json:
        print_json([event.summary() for event in events])
        return
    table(
        [
            Column("ID"),
            Column("PARKED AT"),
            Column("ATTEMPTS", right=True),
            Column("OBJECTS", fold=True),
            Column("REASON", fold=True),
        ],
        [(e.id, _when(e.parked_at), e.attempts, " ".join(e.uris), e.reason) for e in events],
        empty="no parked events",
    )


@parked_app.command("replay")
def parked_replay(
    ctx: typer.Context,
    ids: Annotated[list[str] | None, typer.Argument(help="Parked event ids (from 'vidx parked list').")] = None,
    replay_all: Annotated[bool, typer.Option("--all", help="Replay every parked event.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Hand parked events to the router again (after fixing their cause) and remove them from the parked queue."""
    settings = settings_of(ctx)
    with errors():
        _ids_or_all(ids, replay_all, "parked event ids")
    with errors(rabbitmq(settings)):
        report = ParkedQueue(settings.amqp).replay(None if replay_all else ids)
        missing = sorted(set(ids or []) - {event.id for event in report.replayed})
    replayed = [{"id": event.id, "uris": list(event.uris)} for event in report.replayed]
    _replayed(replayed, report.remaining, missing, "parked queue", as_json)

"""Operator commands of the ``vidx`` CLI: ``vidx reconcile``, ``vidx dlq list|replay`` and
``vidx parked list|replay``.

They talk to the services directly (object store, catalog, broker) rather than through the API, so
they work while the app is down — which is when they are needed most.
"""

from __future__ import annotations

from typing import Annotated

import typer

from events.parked import ParkedQueue
from pipeline.cli_common import errors, print_json, settings_of
from pipeline.deadletters import DeadLetterQueue
from pipeline.settings import Settings
from storage.errors import InvalidInput

dlq_app = typer.Typer(
    help="The dead-letter queue: jobs that failed for good.", no_args_is_help=True, rich_markup_mode=None
)
parked_app = typer.Typer(
    help="Parked bucket events: messages the event router gave up on.", no_args_is_help=True, rich_markup_mode=None
)


def dead_letter_queue(settings: Settings) -> DeadLetterQueue:
    return DeadLetterQueue(settings.amqp.url.get_secret_value(), settings.serve.failed_queue)


def reconcile(
    ctx: typer.Context,
    bucket: Annotated[
        list[str] | None,
        typer.Option("--bucket", "-b", metavar="BUCKET", help="A configured bucket (repeatable; default: all)."),
    ] = None,
    prefix: Annotated[str, typer.Option(help="Only keys under this prefix.")] = "",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report the drift; submit nothing.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="One line per change.")] = False,
) -> None:
    """Compare buckets with the index and queue the jobs that repair drift: objects never indexed,
    indexed at an old version, index entries whose object is gone, rows that disagree with the
    catalog (``vidx check --repair``, one summary per bucket)."""
    with errors():
        from pipeline.check import build_checker
        from pipeline.taskqueue import queueing_sink
        from storage.tables import IndexStore

        settings = settings_of(ctx)
        buckets = bucket or settings.s3.buckets
        foreign = [b for b in buckets if b not in settings.s3.buckets]
        if foreign:
            raise InvalidInput(f"not a configured bucket: {', '.join(foreign)} (VIDX_S3__BUCKETS)")
        store = IndexStore(settings.s3)
        checker = build_checker(settings, store, None if dry_run else queueing_sink(settings, store))
        for name in buckets:
            report = checker.run([name], prefix=prefix, repair=not dry_run)
            if verbose:
                for item in report.found:
                    typer.echo(f"{item.finding.value:<16} {item.uri or item.video_id}  ({item.detail})")
            typer.echo(report.summary())


@dlq_app.command("list")
def dlq_list(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(help="List at most this many.", min=1)] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Failed jobs: id, when, attempts, uri, reason. The queue is left as it was."""
    with errors():
        letters = dead_letter_queue(settings_of(ctx)).list(limit)
    if as_json:
        print_json([letter.summary() for letter in letters])
        return
    if not letters:
        typer.echo("no dead letters")
    for letter in letters:
        when = letter.failed_at.strftime("%Y-%m-%d %H:%M:%S") if letter.failed_at else "-"
        attempts = letter.attempts if letter.attempts is not None else "?"
        typer.echo(f"{letter.id}  {when}  {attempts} attempts  {letter.uri or '-'}  {letter.reason}")


@dlq_app.command("replay")
def dlq_replay(
    ctx: typer.Context,
    ids: Annotated[list[str] | None, typer.Argument(help="Dead-letter ids (from 'vidx dlq list').")] = None,
    replay_all: Annotated[bool, typer.Option("--all", help="Replay every dead letter.")] = False,
) -> None:
    """Queue the jobs of dead letters again (after fixing their cause) and remove those letters."""
    with errors():
        if bool(ids) == replay_all:
            raise InvalidInput("name dead-letter ids or pass --all (not both)")
        from pipeline.taskqueue import queueing_sink
        from storage.tables import IndexStore

        settings = settings_of(ctx)
        report = dead_letter_queue(settings).replay(
            queueing_sink(settings, IndexStore(settings.s3)), None if replay_all else ids
        )
        missing = sorted(set(ids or []) - {letter.id for letter in report.replayed})
    for letter in report.replayed:
        typer.echo(f"replayed {letter.id}  {letter.uri}")
    typer.echo(f"{len(report.replayed)} replayed, {report.remaining} left in the dead-letter queue")
    if missing:
        typer.echo(f"vidx: not found: {', '.join(missing)}", err=True)
        raise typer.Exit(1)


@parked_app.command("list")
def parked_list(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(help="List at most this many.", min=1)] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Parked events: id, when, attempts, objects, reason. The queue is left as it was."""
    with errors():
        events = ParkedQueue(settings_of(ctx).amqp).list(limit)
    if as_json:
        print_json([event.summary() for event in events])
        return
    if not events:
        typer.echo("no parked events")
    for event in events:
        when = event.parked_at.strftime("%Y-%m-%d %H:%M:%S") if event.parked_at else "-"
        attempts = event.attempts if event.attempts is not None else "?"
        typer.echo(f"{event.id}  {when}  {attempts} attempts  {' '.join(event.uris) or '-'}  {event.reason}")


@parked_app.command("replay")
def parked_replay(
    ctx: typer.Context,
    ids: Annotated[list[str] | None, typer.Argument(help="Parked event ids (from 'vidx parked list').")] = None,
    replay_all: Annotated[bool, typer.Option("--all", help="Replay every parked event.")] = False,
) -> None:
    """Hand parked events to the router again (after fixing their cause) and remove them from the parked queue."""
    with errors():
        if bool(ids) == replay_all:
            raise InvalidInput("name parked event ids or pass --all (not both)")
        report = ParkedQueue(settings_of(ctx).amqp).replay(None if replay_all else ids)
        missing = sorted(set(ids or []) - {event.id for event in report.replayed})
    for event in report.replayed:
        typer.echo(f"replayed {event.id}  {' '.join(event.uris) or '-'}")
    typer.echo(f"{len(report.replayed)} replayed, {report.remaining} left in the parked queue")
    if missing:
        typer.echo(f"vidx: not found: {', '.join(missing)}", err=True)
        raise typer.Exit(1)

"""``vidx check``: hold bucket, catalog and frames against each other, report each inconsistency by
kind, and with ``--repair`` submit the jobs that fix them; ``vidx reconcile`` is ``vidx check --repair``.
Talks to the services directly (object store, index tables, broker), so it works while the app is down."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from pipeline.cli.common import settings_of
from pipeline.cli.errors import errors, minio, rabbitmq
from pipeline.cli.output import Column, print_json, table
from pipeline.settings import Settings
from storage.errors import InvalidInput

if TYPE_CHECKING:
    from pipeline.upkeep.check import Inconsistency

#: Exit status when the check found inconsistencies (0: none; 1: the check itself failed).
FOUND_EXIT = 3
#: Columns of a list of findings.
FINDING_COLUMNS = (Column("FINDING"), Column("VIDEO", fold=True), Column("DETAIL", fold=True))


def configured_buckets(settings: Settings, chosen: list[str] | None) -> list[str]:
    """``chosen`` (default: every configured bucket). Raises InvalidInput naming a foreign one."""
    buckets = chosen or settings.s3.buckets
    foreign = [b for b in buckets if b not in settings.s3.buckets]
    if foreign:
        raise InvalidInput(f"not a configured bucket: {', '.join(foreign)} (VIDX_S3__BUCKETS)")
    return buckets


def print_findings(found: list[Inconsistency]) -> None:
    """A table of ``found`` (nothing when empty: the summary line says so)."""
    if found:
        table(FINDING_COLUMNS, [(i.finding.value, i.uri or i.video_id, i.detail) for i in found], empty="")


#: The options ``vidx check`` and its alias ``vidx reconcile`` share.
Buckets = Annotated[
    list[str] | None,
    typer.Option("--bucket", "-b", metavar="BUCKET", help="A configured bucket (repeatable; default: all)."),
]
Prefix = Annotated[str, typer.Option(help="Only keys under this prefix.")]
Grace = Annotated[
    float | None,
    typer.Option(
        "--grace", metavar="SECONDS", help="Grace for queued/indexing rows and new objects (default: settings)."
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print the report as JSON.")]


def check(
    ctx: typer.Context,
    bucket: Buckets = None,
    prefix: Prefix = "",
    repair: Annotated[bool, typer.Option("--repair", help="Submit the jobs that fix what is found.")] = False,
    grace_s: Grace = None,
    as_json: AsJson = False,
) -> None:
    """Check that the index holds exactly the bucket: indexed videos have exactly their rows, deleted
    ones none, no frame id twice, nothing stuck queued/indexing. Exits 3 when it finds inconsistencies."""
    settings = settings_of(ctx)
    with errors():
        buckets = configured_buckets(settings, bucket)
    with errors(*((minio(settings), rabbitmq(settings)) if repair else (minio(settings),))):
        from pipeline.jobs.taskqueue import queueing_sink
        from pipeline.upkeep.check import build_checker
        from storage.tables import IndexStore

        if grace_s is not None:
            grace = {"in_flight_grace_s": grace_s, "new_object_grace_s": grace_s}
            settings = settings.model_copy(update={"check": settings.check.model_copy(update=grace)})
        store = IndexStore(settings.s3)
        checker = build_checker(settings, store, queueing_sink(settings, store) if repair else None)
        report = checker.run(buckets, prefix=prefix, repair=repair)
    if as_json:
        print_json(report.as_json())
    else:
        print_findings(report.found)
        typer.echo(report.summary())
    if report.inconsistencies and not repair:
        raise typer.Exit(FOUND_EXIT)


def reconcile(
    ctx: typer.Context,
    bucket: Buckets = None,
    prefix: Prefix = "",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report the drift; submit nothing (vidx check).")] = False,
    # Kept so that old scripts still run: findings are always listed, as by vidx check.
    verbose: Annotated[bool, typer.Option("--verbose", "-v", hidden=True)] = False,
    grace_s: Grace = None,
    as_json: AsJson = False,
) -> None:
    """Alias of 'vidx check --repair': queue the jobs that repair drift between buckets and index.
    With --dry-run it is 'vidx check' (exits 3 when it finds inconsistencies)."""
    check(ctx, bucket, prefix, repair=not dry_run, grace_s=grace_s, as_json=as_json)

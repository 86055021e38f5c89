"""The ``vidx`` command line: the local stack, uploads, and the HTTP API (search, videos, index).

Settings are built once, in the callback. Every failure ends with one line on stderr and a non-zero
exit status, never a traceback.
"""

from __future__ import annotations

import logging
import mimetypes
import unicodedata
import webbrowser
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from pipeline.cli.admin import dlq_app, parked_app
from pipeline.cli.check import check, reconcile
from pipeline.cli.common import ApiClient, CliError, settings_of
from pipeline.cli.deploy import serve_config
from pipeline.cli.errors import errors, fail, minio, rabbitmq
from pipeline.cli.output import Column, print_json, table
from pipeline.cli.reindex import reindex
from pipeline.cli.upload import upload, wait
from pipeline.settings import Settings
from storage.sampling import hms

app = typer.Typer(
    name="vidx",
    help="Video moment search: MinIO bucket events -> RabbitMQ -> Ray Serve -> SigLIP -> LanceDB.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _main(ctx: typer.Context) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # pika logs every refused connection attempt while we wait for the broker.
    logging.getLogger("pika").setLevel(logging.CRITICAL)
    try:
        ctx.obj = Settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        fail(f"invalid settings: {where}: {first['msg']} (from VIDX_{where.upper().replace('.', '__')})", 2)


# -- data -----------------------------------------------------------------------------------------------

# Uploading and waiting for indexing live in their own module.
app.command()(upload)
app.command()(wait)


@app.command()
def search(
    ctx: typer.Context,
    text: Annotated[str | None, typer.Argument(help="What to look for, in words.")] = None,
    image: Annotated[Path | None, typer.Option("--image", help="Search with a picture instead.")] = None,
    k: Annotated[int, typer.Option("-k", help="How many moments.")] = 10,
    sources: Annotated[
        str | None,
        typer.Option(help="Text search through these only: visual, subtitle, ocr, speech (comma separated)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
) -> None:
    """Find the moments that best match a text or an image. Words in quotes are an exact phrase; the
    words a moment matched (subtitles, on-screen text, speech) are shown *marked*."""
    with errors():
        if (text is None) == (image is None):
            raise CliError("give either a TEXT or --image FILE")
        api = ApiClient(settings_of(ctx))
        if image is not None:
            with image.open("rb") as f:
                mime = mimetypes.guess_type(image.name)[0] or "application/octet-stream"
                answer = api.request(
                    "POST", "/v1/search/image", params={"k": k}, files={"image": (image.name, f, mime)}
                )
        else:
            params: dict[str, Any] = {"q": text, "k": k}
            if sources is not None:
                params["sources"] = sources
            answer = api.request("GET", "/v1/search", params=params)
    if as_json:
        print_json(answer)
        return
    results = answer.get("results", [])
    # With words among the results the scores are fused ranks (small numbers): one more digit, and
    # what found each moment (the frames, a text source) and the words it matched.
    worded = any(r.get("text") for r in results)
    columns = [Column("SCORE", right=True), Column("VIDEO", fold=True), Column("MOMENT"), Column("BEST")]
    if worded:
        columns.append(Column("FOUND BY"))
    if worded:
        columns.append(Column("WORDS", fold=True))
    columns.append(Column("PLAY", fold=True))
    rows = []
    for r in results:
        row = [
            f"{r['score']:.4f}" if worded else f"{r['score']:.3f}",
            r["uri"],
            f"{hms(r['start_s'], 1)}–{hms(r['end_s'], 1)}",
            hms(r["ts_s"], 1),
        ]
        if worded:
            row.append("+".join(r.get("sources") or ["visual"]))
            row.append(marked(r.get("text") or "", r.get("text_marks") or []))
        row.append(r["video_url"])
        rows.append(tuple(row))
    table(columns, rows, empty="no moments found")
    model = f", answered by {answer['model']}" if answer.get("model") else ""
    typer.echo(f"({len(results)} moments in {answer.get('took_ms', 0):.0f} ms{model})", err=True)


@app.command()
def videos(
    ctx: typer.Context,
    status_: Annotated[str | None, typer.Option("--status", help="queued|indexing|indexed|failed|deleted")] = None,
    uri: Annotated[str | None, typer.Option(help="One video by its s3:// URI.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many (one page, newest first; 1000 at most).")] = 100,
    cursor: Annotated[str | None, typer.Option(help="The next page: the cursor the last page ended with.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
) -> None:
    """List videos in the catalog with their indexing status, newest first, a page at a time."""
    params: dict[str, Any] = {"limit": limit}
    if status_:
        params["status"] = status_
    if uri:
        params["uri"] = uri
    if cursor:
        params["cursor"] = cursor
    with errors():
        answer = ApiClient(settings_of(ctx)).request("GET", "/v1/videos", params=params)
    if as_json:
        print_json(answer)
        return
    rows = answer.get("videos", [])
    columns = [Column("STATUS"), Column("FRAMES", right=True), Column("DURATION", right=True), Column("URI", fold=True)]
    errors_seen = any(v.get("error") for v in rows)
    table(
        columns + ([Column("ERROR", fold=True)] if errors_seen else []),
        [
            (
                v["status"],
                v["frames"],
                hms(v["duration_s"], 1) if v.get("duration_s") is not None else None,
                v["uri"],
                *([v.get("error")] if errors_seen else []),
            )
            for v in rows
        ],
        empty="no videos",
    )
    if answer.get("next_cursor"):
        typer.echo(f"(more: vidx videos --cursor {answer['next_cursor']})", err=True)


@app.command()
def index(
    ctx: typer.Context,
    uri: Annotated[str, typer.Argument(help="s3://bucket/key of a video")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
) -> None:
    """Queue a video for (re)indexing."""
    with errors():
        answer = ApiClient(settings_of(ctx)).request("POST", "/v1/index", json={"uri": uri})
    if as_json:
        print_json(answer)
        return
    typer.echo(f"{answer['status']}: {uri} (video {answer['video_id']}, task {answer['task_id']})")


def _prepare_services(settings: Settings) -> None:
    """Declare the event queue, create the buckets and subscribe them (idempotent)."""
    import pika

    from events.subscribe import declare_event_topology, prepare_buckets
    from pipeline.cli.common import minio_client

    connection = pika.BlockingConnection(pika.URLParameters(settings.amqp.url.get_secret_value()))
    declare_event_topology(connection.channel(), settings.amqp)
    connection.close()
    prepare_buckets(minio_client(settings), settings.s3.buckets, settings.s3.index_bucket, settings.amqp.queue_arns)


@app.command()
def serve(ctx: typer.Context) -> None:
    """Run the Ray Serve app in the foreground on a local Ray instance (containers; see infra/compose.yaml).
    MinIO and RabbitMQ must already be reachable at the configured URLs."""
    settings = settings_of(ctx)
    with errors(rabbitmq(settings), minio(settings)):
        import ray
        from ray import serve as ray_serve

        from pipeline.serve.app import build_app

        _prepare_services(settings)
        from pipeline.embedding.config import model_dim
        from pipeline.reindex.lifecycle import ModelLifecycle
        from storage.tables import IndexStore

        # A configured model the index isn't on is refused here, in one line, before Ray starts.
        ModelLifecycle(IndexStore(settings.s3), settings, model_dim).preflight()
        ray.init(address="local", num_cpus=settings.serve.ray_num_cpus, include_dashboard=False)
        ray_serve.start(http_options={"host": settings.serve.host, "port": settings.serve.port})
        ray_serve.run(
            build_app(settings), name=settings.serve.app_name, route_prefix=settings.serve.route_prefix, blocking=True
        )


@app.command("open")
def open_page(
    ctx: typer.Context,
    print_only: Annotated[bool, typer.Option("--print", help="Only print the URL; open no browser.")] = False,
) -> None:
    """Open the web page (search, moments, player, uploads) in a browser; prints its URL."""
    url = settings_of(ctx).api_url.rstrip("/") + "/"
    typer.echo(url)
    if print_only:
        return
    with errors():
        opened = webbrowser.open(url)
    if not opened:
        fail("no web browser found (set BROWSER, or open the URL above yourself; `vidx open --print` only prints it)")


# The operator commands live in their own module; registered here, after the helpers they import.

app.command()(reconcile)
app.command()(check)
app.command()(reindex)
app.command("serve-config")(serve_config)
app.add_typer(dlq_app, name="dlq")
app.add_typer(parked_app, name="parked")


#: The entry-point group through which other packages add commands: each entry is a function that
#: takes this ``typer.Typer`` and registers its commands on it (the local stack's, ``infra.dev.cli``).
PLUGIN_GROUP = "vidx.cli"


def register_plugins(target: typer.Typer) -> list[str]:
    """Let every installed ``vidx.cli`` entry point add its commands to ``target``; returns the names of
    those that could not (each said in one line on stderr: a broken plugin leaves the rest of the CLI working)."""
    failed = []
    for plugin in sorted(entry_points(group=PLUGIN_GROUP), key=lambda ep: ep.name):
        try:
            plugin.load()(target)
        except Exception as exc:  # an installed plugin that can't load: say so, keep the CLI
            failed.append(plugin.name)
            typer.echo(f"vidx: the {plugin.name!r} commands ({plugin.value}) could not be loaded: {exc}", err=True)
    return failed


register_plugins(app)


def main() -> None:
    """Console-script entry point."""
    app()


def marked(text: str, spans: list[list[int]]) -> str:
    """``text`` with the matched words between asterisks (``spans``: [start, end) character offsets);
    control characters (a subtitle track is the uploader's) are shown as spaces, never sent to the terminal."""
    text = "".join(" " if unicodedata.category(c) == "Cc" else c for c in text)
    out, at = [], 0
    for start, end in sorted((int(a), int(b)) for a, b in spans):
        if start < at or end > len(text):
            continue
        out += [text[at:start], "*", text[start:end], "*"]
        at = end
    return "".join([*out, text[at:]])


if __name__ == "__main__":
    main()

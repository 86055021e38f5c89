"""The ``vidx`` command line: the local stack, uploads, and the HTTP API (search, videos, index).

Settings are built once, in the callback. Every failure ends with one line on stderr and a non-zero
exit status, never a traceback.
"""

from __future__ import annotations

import logging
import mimetypes
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from pipeline.cli_admin import dlq_app, parked_app, reconcile
from pipeline.cli_check import check
from pipeline.cli_common import (
    WAIT_LIST_LIMIT,
    WAIT_POLL_S,
    ApiClient,
    CliError,
    errors,
    fail,
    format_moment,
    hms,
    print_json,
    settings_of,
)
from pipeline.settings import Settings

app = typer.Typer(
    name="vidx",
    help="Video moment search: MinIO bucket events -> RabbitMQ -> Ray Serve -> SigLIP -> LanceDB.",
    no_args_is_help=True,
    add_completion=False,
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


# -- the local stack ------------------------------------------------------------------------------------


@app.command()
def up(ctx: typer.Context) -> None:
    """Start the local stack (RabbitMQ, MinIO, Ray, the Serve app) under the state dir."""
    from infra.dev import stack

    with errors():
        stack.up(settings_of(ctx), echo=typer.echo)


@app.command()
def down(ctx: typer.Context) -> None:
    """Stop everything 'vidx up' started."""
    from infra.dev import stack

    with errors():
        stack.down(settings_of(ctx), echo=typer.echo)


@app.command()
def status(ctx: typer.Context, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Show whether each component of the local stack runs."""
    from infra.dev import stack

    with errors():
        settings = settings_of(ctx)
        components = stack.status(settings)
    check = _check_state(settings) if any(c.name == "app" and c.running for c in components) else None
    if as_json:
        print_json(
            [*(c.to_dict() for c in components), {"name": "check", "detail": _describe_check(check), "state": check}]
        )
        return
    for c in components:
        typer.echo(f"{c.name:<9} {'running' if c.running else 'stopped':<8} {c.detail}")
    typer.echo(f"{'check':<9} {_describe_check(check)}")


def _check_state(settings: Settings) -> dict[str, Any] | None:
    """The scheduled check's last round, from the running app (None when it can't be asked)."""
    try:
        state: dict[str, Any] | None = ApiClient(settings).request("GET", "/v1/status").get("check")
    except CliError:
        return None
    return state


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


# -- data -----------------------------------------------------------------------------------------------


def _files(paths: list[Path]) -> list[tuple[Path, str]]:
    """(file, key suffix) for each file, directories expanded recursively."""
    out: list[tuple[Path, str]] = []
    for path in paths:
        if path.is_dir():
            files = sorted(f for f in path.rglob("*") if f.is_file())
            out += [(f, f.relative_to(path.parent).as_posix()) for f in files]
        elif path.is_file():
            out.append((path, path.name))
        else:
            raise CliError(f"no such file: {path}")
    return out


class _Progress:
    """minio-py's progress protocol over one tqdm bar (bytes of all files)."""

    def __init__(self, bar: Any) -> None:
        self._bar = bar

    def set_meta(self, object_name: str, total_length: int) -> None:
        self._bar.set_postfix_str(object_name, refresh=False)

    def update(self, size: int) -> None:
        self._bar.update(size)


@app.command()
def upload(
    ctx: typer.Context,
    paths: Annotated[list[Path], typer.Argument(help="Files or directories to upload.")],
    bucket: Annotated[str | None, typer.Option(help="Target bucket (default: the first watched).")] = None,
    prefix: Annotated[str, typer.Option(help="Key prefix, e.g. 'holiday/'.")] = "",
) -> None:
    """Upload videos to a watched bucket; each upload is indexed through its bucket event."""
    from minio.error import MinioException
    from tqdm import tqdm

    from infra.dev.stack import minio_client

    settings = settings_of(ctx)
    target = bucket or settings.s3.upload_bucket
    with errors():
        files = _files(paths)
        client = minio_client(settings)
        total = sum(f.stat().st_size for f, _ in files)
        uris: list[str] = []
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr) as bar:
            for path, name in files:
                key = f"{prefix}{name}"
                content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
                try:
                    client.fput_object(target, key, str(path), content_type=content_type, progress=_Progress(bar))
                except (MinioException, ValueError) as exc:
                    raise CliError(f"upload of {path} to s3://{target}/{key} failed: {exc}") from exc
                except OSError as exc:  # urllib3 connection errors
                    raise CliError(f"object store not reachable at {settings.s3.endpoint_url}: run 'vidx up'") from exc
                uris.append(f"s3://{target}/{key}")
        for uri in uris:
            typer.echo(uri)


@app.command()
def search(
    ctx: typer.Context,
    text: Annotated[str | None, typer.Argument(help="What to look for, in words.")] = None,
    image: Annotated[Path | None, typer.Option("--image", help="Search with a picture instead.")] = None,
    k: Annotated[int, typer.Option("-k", help="How many moments.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
) -> None:
    """Find the moments that best match a text or an image."""
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
            answer = api.request("GET", "/v1/search", params={"q": text, "k": k})
    if as_json:
        print_json(answer)
        return
    results = answer.get("results", [])
    if not results:
        typer.echo("no moments found")
    for r in results:
        typer.echo(format_moment(r))
    typer.echo(f"({len(results)} moments in {answer.get('took_ms', 0):.0f} ms)", err=True)


@app.command()
def videos(
    ctx: typer.Context,
    status_: Annotated[str | None, typer.Option("--status", help="queued|indexing|indexed|failed|deleted")] = None,
    uri: Annotated[str | None, typer.Option(help="One video by its s3:// URI.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many.")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
) -> None:
    """List videos in the catalog with their indexing status."""
    params: dict[str, Any] = {"limit": limit}
    if status_:
        params["status"] = status_
    if uri:
        params["uri"] = uri
    with errors():
        answer = ApiClient(settings_of(ctx)).request("GET", "/v1/videos", params=params)
    if as_json:
        print_json(answer)
        return
    rows = answer.get("videos", [])
    if not rows:
        typer.echo("no videos")
    for v in rows:
        duration = hms(v["duration_s"]) if v.get("duration_s") is not None else "-"
        line = f"{v['status']:<9} {v['frames']:>6} frames  {duration:>10}  {v['uri']}"
        typer.echo(line + (f"  ({v['error']})" if v.get("error") else ""))


@app.command()
def index(ctx: typer.Context, uri: Annotated[str, typer.Argument(help="s3://bucket/key of a video")]) -> None:
    """Queue a video for (re)indexing."""
    with errors():
        answer = ApiClient(settings_of(ctx)).request("POST", "/v1/index", json={"uri": uri})
    typer.echo(f"{answer['status']}: {uri} (video {answer['video_id']}, task {answer['task_id']})")


@app.command("tiny-model")
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


@app.command()
def wait(
    ctx: typer.Context,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 600.0,
    count: Annotated[int, typer.Option(help="At least this many videos indexed.")] = 1,
) -> None:
    """Wait until COUNT videos are indexed and none is queued or indexing."""
    deadline = time.monotonic() + timeout
    with errors():
        api = ApiClient(settings_of(ctx))
        counts: dict[str, int] = {}
        last_error = "no answer yet"
        while True:
            try:
                rows = api.request("GET", "/v1/videos", params={"limit": WAIT_LIST_LIMIT})["videos"]
                counts = {}
                for v in rows:
                    counts[v["status"]] = counts.get(v["status"], 0) + 1
                busy = counts.get("queued", 0) + counts.get("indexing", 0)
                if counts.get("indexed", 0) >= count and busy == 0:
                    break
            except CliError as exc:  # the API may still be starting
                last_error = str(exc)
            if time.monotonic() >= deadline:
                summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or last_error
                raise CliError(f"not done after {timeout:.0f}s: {summary}")
            time.sleep(WAIT_POLL_S)
    typer.echo(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))


def _prepare_services(settings: Settings) -> None:
    """Declare the event queue, create the buckets and subscribe them (idempotent)."""
    import pika

    from events.subscribe import declare_event_topology, prepare_buckets
    from infra.dev.stack import minio_client

    connection = pika.BlockingConnection(pika.URLParameters(settings.amqp.url.get_secret_value()))
    declare_event_topology(connection.channel(), settings.amqp)
    connection.close()
    prepare_buckets(minio_client(settings), settings.s3.buckets, settings.s3.index_bucket, settings.amqp.queue_arn)


@app.command()
def serve(ctx: typer.Context) -> None:
    """Run the Ray Serve app in the foreground on a local Ray instance (containers; see infra/compose.yaml).
    MinIO and RabbitMQ must already be reachable at the configured URLs."""
    with errors():
        import ray
        from ray import serve as ray_serve

        from pipeline.deployments import build_app

        settings = settings_of(ctx)
        _prepare_services(settings)
        ray.init(address="local", num_cpus=settings.serve.ray_num_cpus, include_dashboard=False)
        ray_serve.start(http_options={"host": settings.serve.host, "port": settings.serve.port})
        ray_serve.run(
            build_app(settings), name=settings.serve.app_name, route_prefix=settings.serve.route_prefix, blocking=True
        )


@app.command()
def demo(ctx: typer.Context) -> None:
    """Start the stack, upload generated sample videos, wait until indexed, search them."""
    with errors():
        from infra.dev.demo import run_demo

        run_demo(settings_of(ctx), typer.echo)


# The operator commands live in their own module; registered here, after the helpers they import.

app.command()(reconcile)
app.command()(check)
app.add_typer(dlq_app, name="dlq")
app.add_typer(parked_app, name="parked")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()

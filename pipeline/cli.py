"""The ``vidx`` command line: the local stack, uploads, and the HTTP API (search, videos, index).

Settings are built once, in the callback. Every failure ends with one line on stderr and a non-zero
exit status, never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mimetypes
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError

from pipeline.errors import VidxError
from pipeline.settings import Settings

#: How long one API call may take (a search embeds the query on a CPU).
HTTP_TIMEOUT_S = 60.0
WAIT_POLL_S = 2.0
WAIT_LIST_LIMIT = 1000

app = typer.Typer(
    name="vidx",
    help="Video moment search: MinIO bucket events -> RabbitMQ -> Ray Serve -> SigLIP -> LanceDB.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


class CliError(VidxError):
    """Raised for a failure the command reports in one line."""


def _fail(message: str, code: int = 1) -> NoReturn:
    typer.echo(message if message.startswith("vidx") else f"vidx: {message}", err=True)
    raise typer.Exit(code)


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """Turns every expected failure into one line on stderr and exit status 1."""
    try:
        yield
    except VidxError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc))
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except typer.Exit:
        raise
    except Exception as exc:  # a library error we did not anticipate: still one line, no traceback
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        _fail(f"{type(exc).__name__}: {first}"[:300])


def _settings(ctx: typer.Context) -> Settings:
    settings: Settings = ctx.obj
    return settings


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
        _fail(f"invalid settings: {where}: {first['msg']} (from VIDX_{where.upper().replace('.', '__')})", 2)


# -- HTTP API -------------------------------------------------------------------------------------------


class ApiClient:
    """The vidx HTTP API; errors become one-line ``CliError``s.

    Sends the configured API key (``VIDX_API_KEY``, ``VIDX_API_KEYS``, ``VIDX_API_KEY_FILE``), else
    the one ``vidx up`` keeps under the state dir; ``admin=True`` sends the admin key instead.
    """

    def __init__(self, settings: Settings, admin: bool = False) -> None:
        import httpx

        from pipeline.stack import client_key

        self.url = settings.api_url
        key = client_key(settings, admin=admin)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=HTTP_TIMEOUT_S)
        which = "VIDX_ADMIN_KEY or VIDX_ADMIN_KEY_FILE" if admin else "VIDX_API_KEY or VIDX_API_KEY_FILE"
        self._key_hint = f"sent {'a' if key else 'no'} key; set {which}, or use the state dir of 'vidx up'"

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.ConnectError as exc:
            raise CliError(f"vidx API not reachable at {self.url}: run 'vidx up'") from exc
        except httpx.TimeoutException as exc:
            raise CliError(f"vidx API at {self.url} did not answer within {HTTP_TIMEOUT_S:.0f}s") from exc
        except httpx.HTTPError as exc:
            raise CliError(f"vidx API at {self.url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                text = response.text.strip()
                message = text.splitlines()[0] if text else response.reason_phrase
            if response.status_code in (401, 403):
                message += f" ({self._key_hint})"
            raise CliError(f"{method} {path} failed ({response.status_code}): {message}")
        return response.json()


def _hms(seconds: float) -> str:
    minutes, s = divmod(max(seconds, 0.0), 60)
    hours, minutes = divmod(int(minutes), 60)
    return f"{hours:02d}:{minutes:02d}:{s:04.1f}"


def format_moment(r: dict[str, Any]) -> str:
    """One line per moment: score, video, span, best second, playable link."""
    return (
        f"{r['score']:6.3f}  {r['uri']}  {_hms(r['start_s'])}–{_hms(r['end_s'])}  "
        f"best {_hms(r['ts_s'])}  {r['video_url']}"
    )


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


# -- the local stack ------------------------------------------------------------------------------------


@app.command()
def up(ctx: typer.Context) -> None:
    """Start the local stack (RabbitMQ, MinIO, Ray, the Serve app) under the state dir."""
    from pipeline import stack

    with _errors():
        stack.up(_settings(ctx), echo=typer.echo)


@app.command()
def down(ctx: typer.Context) -> None:
    """Stop everything 'vidx up' started."""
    from pipeline import stack

    with _errors():
        stack.down(_settings(ctx), echo=typer.echo)


@app.command()
def status(ctx: typer.Context, as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Show whether each component of the local stack runs."""
    from pipeline import stack

    with _errors():
        components = stack.status(_settings(ctx))
    if as_json:
        _print_json([c.to_dict() for c in components])
        return
    for c in components:
        typer.echo(f"{c.name:<9} {'running' if c.running else 'stopped':<8} {c.detail}")


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

    from pipeline.stack import minio_client

    settings = _settings(ctx)
    target = bucket or settings.s3.upload_bucket
    with _errors():
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
    with _errors():
        if (text is None) == (image is None):
            raise CliError("give either a TEXT or --image FILE")
        api = ApiClient(_settings(ctx))
        if image is not None:
            with image.open("rb") as f:
                mime = mimetypes.guess_type(image.name)[0] or "application/octet-stream"
                answer = api.request(
                    "POST", "/v1/search/image", params={"k": k}, files={"image": (image.name, f, mime)}
                )
        else:
            answer = api.request("GET", "/v1/search", params={"q": text, "k": k})
    if as_json:
        _print_json(answer)
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
    with _errors():
        answer = ApiClient(_settings(ctx)).request("GET", "/v1/videos", params=params)
    if as_json:
        _print_json(answer)
        return
    rows = answer.get("videos", [])
    if not rows:
        typer.echo("no videos")
    for v in rows:
        duration = _hms(v["duration_s"]) if v.get("duration_s") is not None else "-"
        line = f"{v['status']:<9} {v['frames']:>6} frames  {duration:>10}  {v['uri']}"
        typer.echo(line + (f"  ({v['error']})" if v.get("error") else ""))


@app.command()
def index(ctx: typer.Context, uri: Annotated[str, typer.Argument(help="s3://bucket/key of a video")]) -> None:
    """Queue a video for (re)indexing."""
    with _errors():
        answer = ApiClient(_settings(ctx)).request("POST", "/v1/index", json={"uri": uri})
    typer.echo(f"{answer['status']}: {uri} (video {answer['video_id']}, task {answer['task_id']})")


@app.command("tiny-model")
def tiny_model(
    directory: Annotated[Path, typer.Argument(help="Where to write the checkpoint.")],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Build a tiny random SigLIP checkpoint (offline; for tests and demos, not for real search)."""
    with _errors():
        from pipeline.tinymodel import build_tiny_siglip

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
    with _errors():
        api = ApiClient(_settings(ctx))
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
    from pipeline.stack import minio_client

    connection = pika.BlockingConnection(pika.URLParameters(settings.amqp.url.get_secret_value()))
    declare_event_topology(connection.channel(), settings.amqp)
    connection.close()
    prepare_buckets(minio_client(settings), settings.s3.buckets, settings.s3.index_bucket, settings.amqp.queue_arn)


@app.command()
def serve(ctx: typer.Context) -> None:
    """Run the Ray Serve app in the foreground on a local Ray instance (containers; see infra/compose.yaml).
    MinIO and RabbitMQ must already be reachable at the configured URLs."""
    with _errors():
        import ray
        from ray import serve as ray_serve

        from pipeline.deployments import build_app

        settings = _settings(ctx)
        _prepare_services(settings)
        ray.init(address="local", num_cpus=settings.serve.ray_num_cpus, include_dashboard=False)
        ray_serve.start(http_options={"host": settings.serve.host, "port": settings.serve.port})
        ray_serve.run(
            build_app(settings), name=settings.serve.app_name, route_prefix=settings.serve.route_prefix, blocking=True
        )


@app.command()
def demo(ctx: typer.Context) -> None:
    """Start the stack, upload generated sample videos, wait until indexed, search them."""
    with _errors():
        from pipeline.demo import run_demo

        run_demo(_settings(ctx), typer.echo)


# The operator commands live in their own module; registered here, after the helpers they import.
from pipeline.cli_admin import dlq_app, reconcile  # noqa: E402

app.command()(reconcile)
app.add_typer(dlq_app, name="dlq")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()

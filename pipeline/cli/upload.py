"""``vidx upload PATH… [--wait]`` and ``vidx wait``: put videos into a watched bucket (a bar of bytes)
and watch them get indexed (a bar of videos settled), every wait bounded by its ``--timeout``.

An upload is indexed through its bucket event, so the CLI knows a video settled when its catalog row
changed after the upload (``updated_at`` differs from the one seen just before) and is indexed, failed
or deleted; an upload of the very content already there changes no row, so its current row is the answer.
"""

from __future__ import annotations

import mimetypes
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.cli.common import HTTP_TIMEOUT_S, ApiClient, ApiError, CliError, settings_of
from pipeline.cli.errors import errors, minio, redact
from pipeline.cli.output import Column, print_json, progress_bar, table
from storage.ids import s3_uri, video_id

#: Exit status when ``--wait`` (or ``vidx wait``) ran out of time, as timeout(1); failures exit 1.
TIMEOUT_EXIT = 124
WAIT_POLL_S = 2.0
#: The API's largest listing (newest first).
WAIT_LIST_LIMIT = 1000
#: When the listing is full, at most this many unseen videos are looked up one by one per round.
WAIT_PROBES_PER_ROUND = 20
#: Catalog states that end a video's indexing.
SETTLED = frozenset({"indexed", "failed", "deleted"})


@dataclass
class Uploaded:
    """One uploaded object and, once settled, how its indexing ended."""

    uri: str
    video_id: str
    #: ``updated_at`` of its catalog row just before the upload (None: it had none).
    before: str | None = None
    #: The same content as the object it replaced (same ETag, unversioned bucket): no job changes its row.
    unchanged: bool = False
    #: The last status seen (None: not in the catalog yet); final once ``settled``.
    status: str | None = None
    error: str | None = None
    frames: int | None = None
    settled: bool = False

    def settle(self, row: dict[str, Any] | None) -> bool:
        """Take ``row`` (the API's video, or None); True when it ends this upload's wait."""
        if row is None:
            return False
        self.status = row.get("status")
        if self.status not in SETTLED or (not self.unchanged and row.get("updated_at") == self.before):
            return False
        self.error, self.frames, self.settled = row.get("error"), row.get("frames"), True
        if self.status == "deleted":
            self.error = "deleted: the object is gone from the bucket"
        return True

    @property
    def failed(self) -> bool:
        return self.settled and self.status != "indexed"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["before"], out["unchanged"]
        return out


class IndexWait:
    """Polls the API until every upload settled or ``timeout_s`` passed; no call outlives the deadline.

    Raises ApiError for an answer that waiting won't change (4xx: a refused key, a foreign bucket);
    an unreachable or failing API (it may be restarting) is retried until the deadline.
    """

    def __init__(
        self,
        api: ApiClient,
        uploads: list[Uploaded],
        timeout_s: float,
        poll_s: float = WAIT_POLL_S,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._api, self._uploads, self._timeout_s, self._poll_s = api, uploads, timeout_s, poll_s
        self._clock, self._sleep = clock, sleep
        self._deadline = 0.0
        self.last_error: str | None = None

    def _get(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        remaining = self._deadline - self._clock()
        if remaining <= 0:
            raise TimeoutError
        videos: list[dict[str, Any]] = self._api.request(
            "GET", "/v1/videos", params=params, timeout_s=min(HTTP_TIMEOUT_S, remaining)
        )["videos"]
        return videos

    def _round(self, pending: list[Uploaded], on_settled: Callable[[Uploaded], None]) -> list[Uploaded]:
        rows = self._get({"limit": WAIT_LIST_LIMIT})
        by_uri = {row["uri"]: row for row in rows}
        probed: list[Uploaded] = []
        for upload in pending:
            row = by_uri.get(upload.uri)
            if row is None and len(rows) >= WAIT_LIST_LIMIT and len(probed) < WAIT_PROBES_PER_ROUND:
                probed.append(upload)
                row = next(iter(self._get({"uri": upload.uri})), None)
            if upload.settle(row):
                on_settled(upload)
        # The ones looked up go last: the next round looks up others.
        return [u for u in pending if not u.settled and u not in probed] + [u for u in probed if not u.settled]

    def run(self, on_settled: Callable[[Uploaded], None]) -> list[Uploaded]:
        """Wait; returns the uploads still not settled at the deadline (empty when all settled)."""
        self._deadline = self._clock() + self._timeout_s
        pending = [u for u in self._uploads if not u.settled]
        while pending:
            try:
                pending = self._round(pending, on_settled)
            except TimeoutError:
                break
            except ApiError as exc:
                if exc.status is not None and exc.status < 500:
                    raise
                self.last_error = str(exc)
            remaining = self._deadline - self._clock()
            if not pending or remaining <= 0:
                break
            self._sleep(min(self._poll_s, remaining))
        return pending


# -- vidx upload ----------------------------------------------------------------------------------------


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


def _etag(client: Any, bucket: str, key: str) -> str | None:
    """The ETag of the object there now (None: none)."""
    from minio.error import S3Error

    try:
        return str(client.stat_object(bucket, key).etag or "").strip('"') or None
    except S3Error as exc:
        if exc.code in ("NoSuchKey", "NoSuchObject", "ResourceNotFound"):
            return None
        raise


def _put(client: Any, bucket: str, key: str, path: Path, bar: Any) -> Any:
    from minio.error import S3Error

    content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    try:
        return client.fput_object(bucket, key, str(path), content_type=content_type, progress=_Progress(bar))
    except S3Error as exc:
        if exc.code == "NoSuchBucket":
            raise CliError(
                f"MinIO has no bucket {bucket} — run `vidx up` (it creates the watched buckets), or choose --bucket"
            ) from exc
        raise
    except ValueError as exc:
        raise CliError(f"upload of {path} to s3://{bucket}/{key} failed: {exc}") from exc


def upload(
    ctx: typer.Context,
    paths: Annotated[list[Path], typer.Argument(help="Files or directories to upload.")],
    bucket: Annotated[str | None, typer.Option(help="Target bucket (default: the first watched).")] = None,
    prefix: Annotated[str, typer.Option(help="Key prefix, e.g. 'holiday/'.")] = "",
    wait: Annotated[bool, typer.Option("--wait", help="Then wait until every upload is indexed or failed.")] = False,
    timeout_s: Annotated[
        float, typer.Option("--timeout", metavar="SECONDS", min=0.0, help="With --wait: give up after this long.")
    ] = 600.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (no progress bars).")] = False,
) -> None:
    """Upload videos to a watched bucket; each upload is indexed through its bucket event. With --wait,
    exits 1 if any failed (listing why) and 124 if any is still not settled after --timeout."""
    from pipeline.cli.common import minio_client

    settings = settings_of(ctx)
    target = bucket or settings.s3.upload_bucket
    with errors():
        files = _files(paths)
        if wait and target not in settings.s3.buckets:
            raise CliError(f"bucket {target} is not watched (VIDX_S3__BUCKETS), so --wait would never end")
    with errors(minio(settings)):
        api = ApiClient(settings) if wait else None
        client = minio_client(settings)
        uploads: dict[str, Uploaded] = {}
        total = sum(f.stat().st_size for f, _ in files)
        with progress_bar(total, as_json=as_json, unit="B", unit_scale=True, unit_divisor=1024) as bar:
            for path, name in files:
                key = f"{prefix}{name}"
                item = Uploaded(s3_uri(target, key), video_id(target, key))
                old_etag = None
                if api is not None:
                    before = api.request("GET", "/v1/videos", params={"uri": item.uri})["videos"]
                    item.before = before[0]["updated_at"] if before else None
                    old_etag = _etag(client, target, key)
                result = _put(client, target, key, path, bar)
                if api is not None:
                    new_etag = str(result.etag or "").strip('"')
                    item.unchanged = old_etag is not None and old_etag == new_etag and result.version_id is None
                uploads[item.uri] = item
    if api is None:
        if as_json:
            print_json([{"uri": u.uri, "video_id": u.video_id} for u in uploads.values()])
        else:
            for uri in uploads:
                typer.echo(uri)
        return
    _wait_for(api, list(uploads.values()), timeout_s, as_json)


def _wait_for(api: ApiClient, uploads: list[Uploaded], timeout_s: float, as_json: bool) -> None:
    counts = {"indexed": 0, "failed": 0}
    with errors(), progress_bar(len(uploads), as_json=as_json, desc="indexing", unit="video") as bar:
        bar.set_postfix_str("0 indexed, 0 failed")

        def on_settled(upload: Uploaded) -> None:
            counts["failed" if upload.failed else "indexed"] += 1
            bar.set_postfix_str(f"{counts['indexed']} indexed, {counts['failed']} failed", refresh=False)
            bar.update(1)

        waiter = IndexWait(api, uploads, timeout_s, poll_s=WAIT_POLL_S)
        pending = waiter.run(on_settled)
    if as_json:
        print_json([u.to_dict() for u in uploads])
    else:
        table(
            [Column("STATUS"), Column("FRAMES", right=True), Column("URI", fold=True), Column("ERROR", fold=True)],
            [(u.status if u.settled else f"{u.status or 'unseen'}…", u.frames, u.uri, u.error) for u in uploads],
            empty="nothing uploaded",
        )
    failed = [u for u in uploads if u.failed]
    for u in failed:
        typer.echo(redact(f"vidx: failed: {u.uri}: {u.error or u.status}"), err=True)
    if pending:
        seen = ", ".join(f"{u.uri} ({u.status or 'not in the catalog yet'})" for u in pending[:5])
        more = f" and {len(pending) - 5} more" if len(pending) > 5 else ""
        why = f"; last error: {redact(waiter.last_error)}" if waiter.last_error else ""
        typer.echo(
            f"vidx: {len(pending)} of {len(uploads)} videos not settled within {timeout_s:g}s: {seen}{more}{why}"
            " — wait longer (--timeout, `vidx wait`) or follow with `vidx videos`",
            err=True,
        )
        raise typer.Exit(TIMEOUT_EXIT)
    if failed:
        typer.echo(f"vidx: {len(failed)} of {len(uploads)} videos failed", err=True)
        raise typer.Exit(1)


# -- vidx wait ------------------------------------------------------------------------------------------


def wait(
    ctx: typer.Context,
    timeout_s: Annotated[
        float, typer.Option("--timeout", metavar="SECONDS", min=0.0, help="Give up after this long.")
    ] = 600.0,
    count: Annotated[int, typer.Option(help="At least this many videos indexed.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the counts by status as JSON.")] = False,
) -> None:
    """Wait until COUNT videos are indexed and none is queued or indexing (exit 124 after --timeout)."""
    api = ApiClient(settings_of(ctx))
    clock = time.monotonic
    deadline = clock() + timeout_s
    counts: dict[str, int] = {}
    last_error = "no answer yet"
    with errors():
        while (remaining := deadline - clock()) > 0:
            try:
                # The catalog's counts by status (one column read), not a listing: right at any size.
                answer = api.request("GET", "/v1/status", timeout_s=min(HTTP_TIMEOUT_S, remaining))
                counts = {s: n for s, n in (answer.get("videos") or {}).items() if n}
                if counts.get("indexed", 0) >= count and counts.get("queued", 0) + counts.get("indexing", 0) == 0:
                    break
            except ApiError as exc:  # the API may still be starting
                if exc.status is not None and exc.status < 500:
                    raise
                last_error = str(exc)
            time.sleep(max(0.0, min(WAIT_POLL_S, deadline - clock())))
        else:
            summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or last_error
            typer.echo(f"vidx: not done after {timeout_s:g}s: {summary}", err=True)
            raise typer.Exit(TIMEOUT_EXIT)
    if as_json:
        print_json(counts)
    else:
        typer.echo(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))

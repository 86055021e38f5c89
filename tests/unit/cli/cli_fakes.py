"""Stand-ins for what the ``vidx`` CLI talks to: the HTTP API (an ``httpx.MockTransport`` over a dict
of catalog rows), MinIO (an in-memory ``minio_client``) and the TCP probes of ``pipeline.cli.errors``."""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from storage.ids import video_id

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def services_reachable(monkeypatch: pytest.MonkeyPatch, reachable: bool = True) -> None:
    """Every probe of ``pipeline.cli.errors`` answers ``reachable`` (no socket is opened)."""
    from pipeline.cli.errors import Component

    monkeypatch.setattr(Component, "reachable", lambda self, timeout_s=0.0: reachable)


def video_row(uri: str, status: str, *, at: int = 0, error: str | None = None, frames: int = 0) -> dict[str, Any]:
    bucket, key = uri.removeprefix("s3://").split("/", 1)
    return {
        "video_id": video_id(bucket, key),
        "uri": uri,
        "status": status,
        "error": error,
        "frames": frames,
        "duration_s": 12.5 if status == "indexed" else None,
        "model": "tiny",
        "updated_at": (T0 + timedelta(seconds=at)).isoformat(),
    }


@dataclass
class FakeApi:
    """The vidx API over ``rows`` (uri -> video row). ``on_list`` runs before each listing (a test
    moves videos along there); ``status`` answers every request with that status instead."""

    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    on_list: Callable[[FakeApi], None] | None = None
    status: int | None = None
    calls: list[str] = field(default_factory=list)
    lists: int = 0
    timeouts: list[float] = field(default_factory=list)
    #: The query parameters of each search.
    search_params: list[dict[str, str]] = field(default_factory=list)

    def put(self, uri: str, status: str, **kwargs: Any) -> None:
        self.rows[uri] = video_row(uri, status, **kwargs)

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(f"{request.method} {request.url.path}")
        self.timeouts.append(float(request.extensions.get("timeout", {}).get("read") or 0.0))
        if self.status is not None:
            return httpx.Response(self.status, json={"error": {"code": "x", "message": "refused by the stand-in"}})
        params = request.url.params
        path = request.url.path
        if path == "/v1/videos":
            if "uri" in params:
                row = self.rows.get(params["uri"])
                return httpx.Response(200, json={"videos": [row] if row else []})
            self.lists += 1
            if self.on_list is not None:
                self.on_list(self)
            rows = sorted(self.rows.values(), key=lambda r: r["updated_at"], reverse=True)
            if "status" in params:
                rows = [r for r in rows if r["status"] == params["status"]]
            start, limit = (
                int(params.get("cursor", 0)),
                int(params.get("limit", 100)),
            )  # the stand-in's cursor: an offset
            more = len(rows) > start + limit
            page = {"videos": rows[start : start + limit], "next_cursor": str(start + limit) if more else None}
            return httpx.Response(200, json=page)
        if path == "/v1/search":
            result = {
                "video_id": "v1",
                "uri": "s3://videos/clips/dog.mp4",
                "score": 0.8125,
                "start_s": 3.0,
                "end_s": 7.5,
                "ts_s": 4.0,
                "thumbnail_url": "/v1/frames/v1-4/thumbnail",
                "video_url": "http://127.0.0.1:9000/videos/clips/dog.mp4?X-Amz-Signature=abc#t=4.0",
            }
            self.search_params.append(dict(params))
            if "boat" in params.get("q", ""):  # a moment its words matched
                result |= {
                    "score": 0.0325,
                    "sources": ["visual", "subtitle"],
                    "text": "A red boat leaves",
                    "text_source": "subtitle",
                    "text_marks": [[2, 5], [6, 10]],
                }
            return httpx.Response(200, json={"results": [result], "took_ms": 12.0})
        if path == "/v1/index":
            uri = json.loads(request.content)["uri"]
            return httpx.Response(202, json={"video_id": "v1", "task_id": "t1", "status": "queued", "uri": uri})
        if path == "/v1/status":
            counts: dict[str, int] = {}
            for row in self.rows.values():
                counts[row["status"]] = counts.get(row["status"], 0) + 1
            return httpx.Response(200, json={"check": None, "videos": counts})
        return httpx.Response(404, json={"error": {"code": "not_found", "message": f"no route {path}"}})

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeApi:
        """Every ``ApiClient`` made from here on talks to this stand-in (with the key it would send)."""
        from pipeline.cli.common import ApiClient

        real_init = ApiClient.__init__

        def init(client: ApiClient, settings: Any, admin: bool = False) -> None:
            real_init(client, settings, admin)
            headers = client._client.headers
            client._client = httpx.Client(
                base_url=client.url, headers=headers, transport=httpx.MockTransport(self.handle)
            )

        monkeypatch.setattr(ApiClient, "__init__", init)
        return self


@dataclass
class Written:
    etag: str
    version_id: str | None = None


class FakeMinio:
    """``minio_client(settings)``: objects in a dict, ETags from their bytes."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], bytes] = {}

    def stat_object(self, bucket: str, key: str) -> Any:
        from minio.error import S3Error

        if (bucket, key) not in self.objects:
            raise S3Error(None, "NoSuchKey", "no such key", key, "r", "h")  # type: ignore[arg-type]
        return Written(f'"{hashlib.md5(self.objects[bucket, key]).hexdigest()}"')

    def fput_object(self, bucket: str, key: str, path: str, content_type: str, progress: Any) -> Written:
        data = Path(path).read_bytes()
        progress.set_meta(key, len(data))
        self.objects[bucket, key] = data
        progress.update(len(data))
        return Written(hashlib.md5(data).hexdigest())

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeMinio:
        import infra.dev.stack as stack
        from pipeline.cli import common

        monkeypatch.setattr(stack, "minio_client", lambda settings: self)
        monkeypatch.setattr(common, "minio_client", lambda settings: self)
        return self


def unused_port() -> int:
    """A loopback port where nothing listens (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def offline_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Settings pointing at an empty state dir and at ports where nothing listens, no keys; the state dir."""
    state = tmp_path / "state"
    monkeypatch.setenv("VIDX_STATE_DIR", str(state))
    monkeypatch.setenv("VIDX_SERVE__PORT", str(unused_port()))
    monkeypatch.setenv("VIDX_S3__ENDPOINT_URL", f"http://127.0.0.1:{unused_port()}")
    monkeypatch.setenv("VIDX_AMQP__URL", f"amqp://guest:guest@127.0.0.1:{unused_port()}/%2F")
    for name in ("VIDX_API_KEY", "VIDX_API_KEYS", "VIDX_API_KEY_FILE", "VIDX_ADMIN_KEY", "VIDX_ADMIN_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    return state

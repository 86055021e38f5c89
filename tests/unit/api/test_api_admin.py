"""The /v1/admin routes: dead letters, parked events and reconcile (stand-in services) and the model
lifecycle (a real one over a LanceDB index in a local directory), behind the admin key."""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from events.deadletters import DeadLetter, FailureKind
from events.held import ReplayReport
from events.jobs import IndexJob, JobOp, JobSink, JobSource
from events.parked import ParkedEvent
from pipeline.api.app import create_app
from pipeline.api.routes.admin import admin_router
from pipeline.reindex.lifecycle import ModelLifecycle
from pipeline.settings import Settings
from pipeline.upkeep.check import CheckReport, Finding, Inconsistency
from storage.config import S3Settings
from storage.errors import ModelUnavailable
from storage.models import ModelState, ModelTable
from storage.tables import IndexStore
from tests.unit.api.test_api import FakeJobs, FakeSearch, FakeStore

API_KEY = "user-key-0123456789abcdef"
ADMIN_KEY = "admin-key-0123456789abcdef"
JOB = IndexJob(op=JobOp.INDEX, bucket="videos", key="a.mp4", source=JobSource.EVENT)


class FakeLetters:
    def __init__(self) -> None:
        self.letters = [
            DeadLetter(id="t1", kind=FailureKind.PERMANENT, reason="not a video: a text file", attempts=1, job=JOB),
            DeadLetter(id="t2", kind=FailureKind.EXHAUSTED, reason="gave up after 4 attempts: x", attempts=4, job=JOB),
        ]
        self.replayed: list[IndexJob] = []

    def list(self, limit: int | None = None) -> list[DeadLetter]:
        return self.letters[:limit]

    def replay(self, sink: JobSink, ids: Collection[str] | None = None) -> ReplayReport[DeadLetter]:
        chosen = [d for d in self.letters if ids is None or d.id in ids]
        for letter in chosen:
            assert letter.job is not None
            sink.submit(letter.job)
            self.replayed.append(letter.job)
        self.letters = [d for d in self.letters if d not in chosen]
        return ReplayReport(replayed=chosen, remaining=len(self.letters))


class FakeParked:
    def __init__(self) -> None:
        self.events = [
            ParkedEvent(id="p1", reason="not JSON: Expecting value", attempts=1, parked_at=None, body=b"\xff"),
            ParkedEvent(
                id="p2",
                reason="gave up after 5 attempts: task queue unavailable",
                attempts=5,
                parked_at=None,
                body=b"{}",
                uris=("s3://videos/a.mp4",),
            ),
        ]
        self.replayed: list[ParkedEvent] = []

    def list(self, limit: int | None = None) -> list[ParkedEvent]:
        return self.events[:limit]

    def replay(self, ids: Collection[str] | None = None) -> ReplayReport[ParkedEvent]:
        chosen = [e for e in self.events if ids is None or e.id in ids]
        self.replayed.extend(chosen)
        self.events = [e for e in self.events if e not in chosen]
        return ReplayReport(replayed=chosen, remaining=len(self.events))


def admin_client(
    parked: FakeParked | None = None,
    lifecycle: ModelLifecycle | None = None,
) -> tuple[TestClient, FakeLetters, FakeJobs, list[tuple[str, str, bool]]]:
    settings = Settings(api_keys=[SecretStr(API_KEY)], admin_key=SecretStr(ADMIN_KEY))
    store, jobs, letters = FakeStore(), FakeJobs(), FakeLetters()
    calls: list[tuple[str, str, bool]] = []

    def reconcile(bucket: str, prefix: str, dry_run: bool) -> CheckReport:
        calls.append((bucket, prefix, dry_run))
        report = CheckReport(repair=not dry_run, buckets=[bucket], listed=3, in_sync=2)
        report.add(Inconsistency(Finding.MISSING, f"s3://{bucket}/b.mp4", "v1", "in the bucket, not in the catalog"))
        return report

    async def stats() -> dict[str, Any]:
        return {}

    admin = admin_router(settings.s3.buckets, letters, parked or FakeParked(), jobs, reconcile, lifecycle=lifecycle)
    app = create_app(settings, FakeSearch(settings.limits), store, jobs, stats, admin)  # type: ignore[arg-type]
    return TestClient(app, raise_server_exceptions=False), letters, jobs, calls


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


ADMIN_ROUTES = [
    ("GET", "/v1/admin/dlq"),
    ("POST", "/v1/admin/dlq/replay"),
    ("GET", "/v1/admin/parked"),
    ("POST", "/v1/admin/parked/replay"),
    ("POST", "/v1/admin/reconcile"),
    ("GET", "/v1/admin/reindex"),
    ("POST", "/v1/admin/reindex"),
    ("POST", "/v1/admin/reindex/abort"),
    ("POST", "/v1/admin/reindex/cleanup"),
]


def test_admin_routes_need_the_admin_key() -> None:
    parked = FakeParked()
    http, letters, _, _ = admin_client(parked)
    for method, path in ADMIN_ROUTES:
        assert http.request(method, path).status_code == 401
        assert http.request(method, path, headers=bearer("wrong-key-0123456789")).status_code == 401
        assert http.request(method, path, headers=bearer(API_KEY), json={"all": True}).status_code == 403
    assert len(letters.letters) == 2 and letters.replayed == []
    assert len(parked.events) == 2 and parked.replayed == []


def test_dead_letters_are_listed_and_replayed() -> None:
    http, _, jobs, _ = admin_client()
    body = http.get("/v1/admin/dlq", headers=bearer(ADMIN_KEY)).json()
    assert [d["id"] for d in body["dead_letters"]] == ["t1", "t2"]
    assert set(body["dead_letters"][0]) == {"id", "uri", "kind", "reason", "attempts", "failed_at"}
    assert body["dead_letters"][0]["uri"] == "s3://videos/a.mp4"
    assert len(http.get("/v1/admin/dlq?limit=1", headers=bearer(ADMIN_KEY)).json()["dead_letters"]) == 1
    assert http.get("/v1/admin/dlq?limit=1001", headers=bearer(ADMIN_KEY)).status_code == 422
    resp = http.post("/v1/admin/dlq/replay", headers=bearer(ADMIN_KEY), json={"ids": ["t2", "nope"]})
    assert resp.json() == {"replayed": ["t2"], "not_found": ["nope"], "remaining": 1}
    assert jobs.jobs == [JOB]
    bad = http.post("/v1/admin/dlq/replay", headers=bearer(ADMIN_KEY), json={"ids": ["t1"], "all": True})
    assert bad.status_code == 422 and "error" in bad.json()


def test_parked_events_are_listed_and_replayed() -> None:
    parked = FakeParked()
    http, _, _, _ = admin_client(parked)
    body = http.get("/v1/admin/parked", headers=bearer(ADMIN_KEY)).json()
    assert [e["id"] for e in body["parked"]] == ["p1", "p2"]
    assert body["parked"][1] == {
        "id": "p2",
        "uris": ["s3://videos/a.mp4"],
        "reason": "gave up after 5 attempts: task queue unavailable",
        "attempts": 5,
        "parked_at": None,
        "size_bytes": 2,
    }
    assert [e["id"] for e in http.get("/v1/admin/parked?limit=1", headers=bearer(ADMIN_KEY)).json()["parked"]] == ["p1"]
    assert http.get("/v1/admin/parked?limit=0", headers=bearer(ADMIN_KEY)).status_code == 422
    resp = http.post("/v1/admin/parked/replay", headers=bearer(ADMIN_KEY), json={"ids": ["p2", "nope"]})
    assert resp.json() == {"replayed": ["p2"], "not_found": ["nope"], "remaining": 1}
    assert [e.id for e in parked.replayed] == ["p2"]
    assert http.post("/v1/admin/parked/replay", headers=bearer(ADMIN_KEY), json={"all": True}).json() == {
        "replayed": ["p1"],
        "not_found": [],
        "remaining": 0,
    }
    bad = http.post("/v1/admin/parked/replay", headers=bearer(ADMIN_KEY), json={})
    assert bad.status_code == 422 and "error" in bad.json()


def test_reconcile_runs_per_configured_bucket_and_rejects_others() -> None:
    http, _, _, calls = admin_client()
    resp = http.post("/v1/admin/reconcile", headers=bearer(ADMIN_KEY), json={"dry_run": True, "prefix": "cams/"})
    [report] = resp.json()["reports"]
    assert calls == [("videos", "cams/", True)]
    assert (report["counts"]["missing"], report["in_sync"], report["submitted"]) == (1, 2, 0)
    assert (report["bucket"], report["dry_run"], report["inconsistencies"]) == ("videos", True, 1)
    assert report["found"] == [
        {
            "finding": "missing",
            "uri": "s3://videos/b.mp4",
            "video_id": "v1",
            "detail": "in the bucket, not in the catalog",
        }
    ]
    other = http.post("/v1/admin/reconcile", headers=bearer(ADMIN_KEY), json={"bucket": "other"})
    assert other.status_code == 400 and calls == [("videos", "cams/", True)]


def test_admin_routes_are_off_without_an_admin_key() -> None:
    # No keys at all (an open API, e.g. compose without keys) or user keys only: admin stays shut.
    for keys in ([], [SecretStr(API_KEY)]):
        settings = Settings(api_keys=keys)
        letters, parked = FakeLetters(), FakeParked()

        async def stats() -> dict[str, Any]:
            return {}

        admin = admin_router(settings.s3.buckets, letters, parked, FakeJobs(), lambda *a: None)  # type: ignore[arg-type]
        app = create_app(settings, FakeSearch(settings.limits), FakeStore(), FakeJobs(), stats, admin)  # type: ignore[arg-type]
        http = TestClient(app, raise_server_exceptions=False)
        headers = bearer(API_KEY) if keys else {}
        for path in ("/v1/admin/dlq/replay", "/v1/admin/parked/replay"):
            resp = http.post(path, headers=headers, json={"all": True})
            assert resp.status_code == 403 and "VIDX_ADMIN_KEY" in resp.json()["error"]["message"]
        assert letters.replayed == [] and parked.replayed == []
        assert http.get("/healthz").status_code == 200


# -- the model lifecycle --------------------------------------------------------------------------------

DIMS = {"model-a": 8, "model-b": 16, "model-c": 4}


def dim_of(model: str) -> int:
    if model not in DIMS:
        raise ModelUnavailable(f"model {model!r} can't be read (VIDX_MODEL__ID)")
    return DIMS[model]


@pytest.fixture
def lifecycle(tmp_path: Path) -> tuple[TestClient, IndexStore]:
    """The admin routes over a real lifecycle whose index answers with model-a."""
    store = IndexStore(S3Settings(), uri=str(tmp_path / "index"))
    assert store.models.write(ModelState(active=ModelTable.new("model-a", 8)), 0) is not None
    models = ModelLifecycle(store, Settings(), dim_of=dim_of)
    http, _, _, _ = admin_client(lifecycle=models)
    return http, store


def test_reindex_status_start_again_and_refused(lifecycle: tuple[TestClient, IndexStore]) -> None:
    http, store = lifecycle
    admin = bearer(ADMIN_KEY)
    idle = http.get("/v1/admin/reindex", headers=admin)
    assert idle.status_code == 200
    assert idle.json()["state"] == "idle" and idle.json()["active"]["model"] == "model-a"
    assert idle.json()["target"] is None and idle.json()["configured"] == Settings().model.id
    started = http.post("/v1/admin/reindex", headers=admin, json={"model": "  model-b "})
    assert started.status_code == 202
    body = started.json()
    target = store.models.read().target
    assert target is not None and body["target"] == {"model": "model-b", "dim": 16, "table": target.table}
    assert body["state"] == "backfilling" and body["progress"]["done"] == 0
    assert http.get("/v1/admin/reindex", headers=admin).json()["target"] == body["target"]
    before = store.models.read()
    again = http.post("/v1/admin/reindex", headers=admin, json={"model": "model-b"})
    assert again.status_code == 202 and again.json()["target"] == body["target"]
    assert store.models.read() == before
    refused = http.post("/v1/admin/reindex", headers=admin, json={"model": "model-c"})
    assert refused.status_code == 409
    assert refused.json() == {
        "error": {"code": "conflict", "message": "a backfill to 'model-b' is running: `vidx reindex --abort` it first"}
    }
    assert store.models.read() == before


@pytest.mark.parametrize("model", ["", "   ", "m" * 513])
def test_reindex_refuses_an_empty_or_overlong_model_id(lifecycle: tuple[TestClient, IndexStore], model: str) -> None:
    http, store = lifecycle
    resp = http.post("/v1/admin/reindex", headers=bearer(ADMIN_KEY), json={"model": model})
    assert resp.status_code == 422 and resp.json()["error"]["code"] == "invalid_request"
    assert http.post("/v1/admin/reindex", headers=bearer(ADMIN_KEY), json={}).status_code == 422
    assert store.models.read().target is None


def test_reindex_to_a_model_that_cant_be_read_is_a_400(lifecycle: tuple[TestClient, IndexStore]) -> None:
    http, store = lifecycle
    resp = http.post("/v1/admin/reindex", headers=bearer(ADMIN_KEY), json={"model": "no/such-model"})
    assert resp.status_code == 400 and "can't be read" in resp.json()["error"]["message"]
    assert store.models.read().target is None


def test_reindex_abort_drops_the_target_and_then_is_refused(lifecycle: tuple[TestClient, IndexStore]) -> None:
    http, store = lifecycle
    admin = bearer(ADMIN_KEY)
    assert http.post("/v1/admin/reindex", headers=admin, json={"model": "model-b"}).status_code == 202
    target = store.models.read().target
    assert target is not None
    store.frames_table(target.table).table(dim=target.dim)  # a backfill job created it
    aborted = http.post("/v1/admin/reindex/abort", headers=admin)
    assert aborted.status_code == 200
    assert aborted.json()["state"] == "idle" and aborted.json()["target"] is None
    assert aborted.json()["active"]["model"] == "model-a"
    assert store.db.open(target.table) is None
    again = http.post("/v1/admin/reindex/abort", headers=admin)
    assert again.status_code == 409 and again.json()["error"]["message"] == "no backfill is running"


def test_reindex_cleanup_drops_retired_tables(lifecycle: tuple[TestClient, IndexStore]) -> None:
    http, store = lifecycle
    admin = bearer(ADMIN_KEY)
    assert http.post("/v1/admin/reindex", headers=admin, json={"model": "model-b"}).status_code == 202
    state = store.models.read()
    assert state.active is not None and state.target is not None
    old = state.active
    store.frames_table(old.table).table(dim=old.dim)
    switched = state.evolve(
        active=state.target, target=None, backfill=None, retired=(old,), switched_at=datetime.now(UTC)
    )
    assert store.models.write(switched, state.rev) is not None
    assert http.get("/v1/admin/reindex", headers=admin).json()["retired"] == [
        {"model": "model-a", "dim": 8, "table": old.table}
    ]
    cleaned = http.post("/v1/admin/reindex/cleanup", headers=admin)
    assert cleaned.status_code == 200
    assert cleaned.json()["dropped"] == [old.table]
    assert cleaned.json()["status"]["retired"] == [] and cleaned.json()["status"]["active"]["model"] == "model-b"
    assert store.db.open(old.table) is None


def test_reindex_routes_answer_503_without_a_lifecycle() -> None:
    http, _, _, _ = admin_client()
    for method, path in ADMIN_ROUTES:
        if "/reindex" not in path:
            continue
        resp = http.request(method, path, headers=bearer(ADMIN_KEY), json={"model": "model-b"})
        assert resp.status_code == 503, path
        assert resp.json()["error"] == {"code": "unavailable", "message": "model lifecycle not available"}
        assert resp.headers["Retry-After"]

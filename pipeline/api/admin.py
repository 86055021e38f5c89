"""Admin routes under ``/v1/admin`` (the auth middleware lets only the admin key through): the
dead-letter queue, parked events, reconcile and the model lifecycle, the same operations as
``vidx dlq``, ``vidx parked``, ``vidx reconcile`` and ``vidx reindex``."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, StringConstraints, model_validator

from events.deadletters import DeadLetter
from events.held import Held, ReplayReport
from events.jobs import JobSink
from events.parked import ParkedEvent
from pipeline.reindex.lifecycle import status_json
from pipeline.upkeep.check import CheckReport
from storage.errors import InvalidInput

if TYPE_CHECKING:
    from pipeline.reindex.lifecycle import ModelLifecycle

#: Changes listed per bucket in a reconcile answer (the counts cover all).
MAX_CHANGES_SHOWN = 100
#: Most dead letters or parked events one listing returns (module level: FastAPI resolves the
#: ``Query`` annotations in the module's namespace).
MAX_LIST = 1000
#: Longest model id a reindex body may name (hub ids and checkpoint paths are far shorter).
MAX_MODEL_ID_CHARS = 512
#: The answer of the reindex routes when the app was built without a model lifecycle.
NO_LIFECYCLE = "model lifecycle not available"


class DeadLetters(Protocol):
    def list(self, limit: int | None = None) -> list[DeadLetter]: ...

    def replay(
        self,
        sink: JobSink,
        ids: Collection[str] | None = None,
    ) -> ReplayReport[DeadLetter]: ...


class ParkedEvents(Protocol):
    def list(self, limit: int | None = None) -> list[ParkedEvent]: ...

    def replay(self, ids: Collection[str] | None = None) -> ReplayReport[ParkedEvent]: ...


class ReplayRequest(BaseModel):
    ids: list[str] = []
    all: bool = False

    @model_validator(mode="after")
    def _one_of(self) -> ReplayRequest:
        if bool(self.ids) == self.all:
            raise ValueError("give ids or all=true (not both)")
        return self


class ReconcileRequest(BaseModel):
    #: One configured bucket; all of them when empty.
    bucket: str | None = None
    prefix: str = ""
    dry_run: bool = False


class ReindexRequest(BaseModel):
    #: The model to backfill to: a hub id or a checkpoint directory the app can read.
    model: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=MAX_MODEL_ID_CHARS)]


def _report(report: CheckReport) -> dict[str, Any]:
    data = report.as_json()
    data["found"] = data["found"][:MAX_CHANGES_SHOWN]
    return {"bucket": report.buckets[0] if report.buckets else None, "dry_run": not report.repair, **data}


def held_routes(
    router: APIRouter,
    path: str,
    key: str,
    list_held: Callable[[int], Sequence[Held]],
    replay_held: Callable[[Collection[str] | None], ReplayReport[Any]],
) -> None:
    """``GET path`` (``{key: [summary, ...]}``) and ``POST path/replay`` over one held queue."""

    @router.get(path, name=f"list_{key}")
    async def list_items(limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 100) -> dict[str, Any]:
        items = await asyncio.to_thread(list_held, limit)
        return {key: [item.summary() for item in items]}

    @router.post(f"{path}/replay", name=f"replay_{key}")
    async def replay_items(body: ReplayRequest) -> dict[str, Any]:
        report = await asyncio.to_thread(replay_held, None if body.all else body.ids)
        replayed = [item.id for item in report.replayed]
        return {
            "replayed": replayed,
            "not_found": sorted(set(body.ids) - set(replayed)),
            "remaining": report.remaining,
        }


def admin_router(
    buckets: list[str],
    dead_letters: DeadLetters,
    parked: ParkedEvents,
    jobs: JobSink,
    reconcile: Callable[[str, str, bool], CheckReport],
    lifecycle: ModelLifecycle | None = None,
) -> APIRouter:
    """The admin routes over plain services (testable without Ray or a broker). Without
    ``lifecycle`` the reindex routes answer 503."""
    router = APIRouter(prefix="/v1/admin")

    def models() -> ModelLifecycle:
        if lifecycle is None:
            raise HTTPException(503, NO_LIFECYCLE)
        return lifecycle

    held_routes(router, "/dlq", "dead_letters", dead_letters.list, functools.partial(dead_letters.replay, jobs))
    held_routes(router, "/parked", "parked", parked.list, parked.replay)

    @router.post("/reconcile")
    async def reconcile_buckets(body: ReconcileRequest) -> dict[str, Any]:
        if body.bucket is not None and body.bucket not in buckets:
            raise InvalidInput(f"bucket {body.bucket!r} is not one of the configured buckets")
        chosen = [body.bucket] if body.bucket else buckets
        reports = [await asyncio.to_thread(reconcile, b, body.prefix, body.dry_run) for b in chosen]
        return {"reports": [_report(r) for r in reports]}

    # Refusals (ReindexRefused) are 409s, mapped with the API's other errors (``pipeline.api.app``).
    @router.get("/reindex")
    async def reindex_status() -> dict[str, Any]:
        return await asyncio.to_thread(models().status)

    @router.post("/reindex", status_code=202)
    async def reindex_start(body: ReindexRequest) -> dict[str, Any]:
        chosen = models()
        state = await asyncio.to_thread(chosen.start, body.model)
        return status_json(state, chosen.configured)

    @router.post("/reindex/abort")
    async def reindex_abort() -> dict[str, Any]:
        chosen = models()
        state = await asyncio.to_thread(chosen.abort)
        return status_json(state, chosen.configured)

    @router.post("/reindex/cleanup")
    async def reindex_cleanup() -> dict[str, Any]:
        chosen = models()
        dropped = await asyncio.to_thread(chosen.cleanup)
        return {"dropped": dropped, "status": await asyncio.to_thread(chosen.status)}

    return router

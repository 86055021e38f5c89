"""Admin routes under ``/v1/admin`` (the key check lets only the admin key through): the
dead-letter queue, parked events, reconcile, and the model lifecycle's routes
(``pipeline.api.routes.model``); the same operations as ``vidx dlq``, ``vidx parked``,
``vidx reconcile`` and ``vidx reindex``."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Protocol

from fastapi import APIRouter, Query
from pydantic import BaseModel, model_validator

from events.deadletters import DeadLetter
from events.held import Held, ReplayReport
from events.jobs import JobSink
from events.parked import ParkedEvent
from pipeline.api.guards import ADMIN_PREFIX
from pipeline.api.routes.model import model_router
from pipeline.upkeep.check import CheckReport
from storage.errors import InvalidInput

if TYPE_CHECKING:
    from pipeline.reindex.lifecycle import ModelLifecycle

#: Changes listed per bucket in a reconcile answer (the counts cover all).
MAX_CHANGES_SHOWN = 100
#: Most dead letters or parked events one listing returns (module level: FastAPI resolves the
#: ``Query`` annotations in the module's namespace).
MAX_LIST = 1000


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
    """The admin routes over plain services (testable without Ray or a broker), with the model
    lifecycle's (``model_router``): without ``lifecycle`` those answer 503."""
    router = APIRouter(prefix=ADMIN_PREFIX)
    held_routes(router, "/dlq", "dead_letters", dead_letters.list, functools.partial(dead_letters.replay, jobs))
    held_routes(router, "/parked", "parked", parked.list, parked.replay)

    @router.post("/reconcile")
    async def reconcile_buckets(body: ReconcileRequest) -> dict[str, Any]:
        if body.bucket is not None and body.bucket not in buckets:
            raise InvalidInput(f"bucket {body.bucket!r} is not one of the configured buckets")
        chosen = [body.bucket] if body.bucket else buckets
        reports = [await asyncio.to_thread(reconcile, b, body.prefix, body.dry_run) for b in chosen]
        return {"reports": [_report(r) for r in reports]}

    router.include_router(model_router(lifecycle))
    return router

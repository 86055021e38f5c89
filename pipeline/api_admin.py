"""Admin routes under ``/v1/admin`` (the auth middleware lets only the admin key through): the
dead-letter queue, parked events and reconcile, the same operations as ``vidx dlq``, ``vidx parked``
and ``vidx reconcile``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Query
from pydantic import BaseModel, model_validator

from events.jobs import JobSink
from events.parked import ParkedEvent, ParkedReplayReport
from pipeline.check import CheckReport
from pipeline.deadletters import DeadLetter, ReplayReport
from storage.errors import InvalidInput

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
    ) -> ReplayReport: ...


class ParkedEvents(Protocol):
    def list(self, limit: int | None = None) -> list[ParkedEvent]: ...

    def replay(self, ids: Collection[str] | None = None) -> ParkedReplayReport: ...


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


def admin_router(
    buckets: list[str],
    dead_letters: DeadLetters,
    parked: ParkedEvents,
    jobs: JobSink,
    reconcile: Callable[[str, str, bool], CheckReport],
) -> APIRouter:
    """The admin routes over plain services (testable without Ray or a broker)."""
    router = APIRouter(prefix="/v1/admin")

    @router.get("/dlq")
    async def list_dead_letters(limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 100) -> dict[str, Any]:
        letters = await asyncio.to_thread(dead_letters.list, limit)
        return {"dead_letters": [letter.summary() for letter in letters]}

    @router.post("/dlq/replay")
    async def replay_dead_letters(body: ReplayRequest) -> dict[str, Any]:
        ids = None if body.all else body.ids
        report = await asyncio.to_thread(dead_letters.replay, jobs, ids)
        replayed = [letter.id for letter in report.replayed]
        return {
            "replayed": replayed,
            "not_found": sorted(set(body.ids) - set(replayed)),
            "remaining": report.remaining,
        }

    @router.get("/parked")
    async def list_parked(limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 100) -> dict[str, Any]:
        events = await asyncio.to_thread(parked.list, limit)
        return {"parked": [event.summary() for event in events]}

    @router.post("/parked/replay")
    async def replay_parked(body: ReplayRequest) -> dict[str, Any]:
        ids = None if body.all else body.ids
        report = await asyncio.to_thread(parked.replay, ids)
        replayed = [event.id for event in report.replayed]
        return {
            "replayed": replayed,
            "not_found": sorted(set(body.ids) - set(replayed)),
            "remaining": report.remaining,
        }

    @router.post("/reconcile")
    async def reconcile_buckets(body: ReconcileRequest) -> dict[str, Any]:
        if body.bucket is not None and body.bucket not in buckets:
            raise InvalidInput(f"bucket {body.bucket!r} is not one of the configured buckets")
        chosen = [body.bucket] if body.bucket else buckets
        reports = [await asyncio.to_thread(reconcile, b, body.prefix, body.dry_run) for b in chosen]
        return {"reports": [_report(r) for r in reports]}

    return router

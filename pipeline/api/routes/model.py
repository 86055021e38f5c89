"""The model lifecycle's routes, ``/reindex`` under the admin prefix (``admin_router`` mounts them,
so only the admin key opens them): its status, a backfill to another model, aborting it and
dropping the tables it left; the same operations as ``vidx reindex``."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, StringConstraints

from pipeline.reindex.lifecycle import status_json

if TYPE_CHECKING:
    from pipeline.reindex.lifecycle import ModelLifecycle

#: Longest model id a reindex body may name (hub ids and checkpoint paths are far shorter).
MAX_MODEL_ID_CHARS = 512
#: The answer of the reindex routes when the app was built without a model lifecycle.
NO_LIFECYCLE = "model lifecycle not available"


class ReindexRequest(BaseModel):
    #: The model to backfill to: a hub id or a checkpoint directory the app can read.
    model: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=MAX_MODEL_ID_CHARS)]


def model_router(lifecycle: ModelLifecycle | None) -> APIRouter:
    """The reindex routes over ``lifecycle``; without one they answer 503. Refusals
    (``ReindexRefused``) are 409s, mapped with the API's other errors (``pipeline.api.errors``)."""
    router = APIRouter()

    def models() -> ModelLifecycle:
        if lifecycle is None:
            raise HTTPException(503, NO_LIFECYCLE)
        return lifecycle

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

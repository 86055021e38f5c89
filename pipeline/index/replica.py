"""What one IndexConsumer replica runs, built from the settings: an ``Indexer`` over the index, its
embedders and frame writers, behind an ``IndexTaskHandler`` (the Serve shell only forwards to it)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from pipeline.embedding.encoders import HandleEmbedders, PoolEmbedders
from pipeline.embedding.pool import ModelPool
from pipeline.index.consumer import IndexTaskHandler
from pipeline.index.extract import CpuSlots, Embedders, FrameEmbedder
from pipeline.index.holders import holder_alive, process_holder
from pipeline.index.indexer import Indexer
from pipeline.index.objects import S3ObjectSource
from pipeline.index.words import TextStage
from pipeline.index.writers import FrameWriters
from pipeline.jobs.catalog_writes import HandleCatalogWrites
from pipeline.jobs.taskqueue import CeleryJobSink, dead_letter_queue
from pipeline.media.decode import prestart_workers
from pipeline.metrics import Metrics
from pipeline.reindex.lifecycle import LiveModels
from pipeline.settings import Settings
from storage.errors import TransientError
from storage.tables import IndexStore

log = logging.getLogger(__name__)

#: The side of the blank image a fused replica embeds once at start (``warm_up``).
WARM_UP_SIDE = 32

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle


def consumer_handler(
    settings: Settings, encoder: DeploymentHandle, catalog_writer: DeploymentHandle | None, metrics: Metrics
) -> IndexTaskHandler:
    """The task handler of one consumer process. ``encoder``: the Encoder deployment's handle (the
    ``split`` layout; ``fused`` loads the models in this process); ``catalog_writer``: the CatalogWriter
    deployment's handle, or None to commit this process's catalog writes itself."""
    store = IndexStore(settings.s3)
    live = LiveModels(store.models, settings.reindex.live_refresh_s)
    embedders: Embedders
    if settings.serve.layout in ("fused", "auto"):  # build_app resolves ``auto``; unresolved: no GPU known
        embedders = PoolEmbedders(ModelPool(settings.model))
        warm_up(embedders.for_model(settings.model.id))
    else:
        embedders = HandleEmbedders(encoder, settings.model.embed_timeout_s)
    cpu_slots = CpuSlots(settings.serve.consumer_cpu_slots or settings.serve.consumer_concurrency)
    writers = FrameWriters(store, settings.writer, expected=lambda: cpu_slots.taken)
    objects = S3ObjectSource(settings.s3, settings.limits)
    # Both consumers read words when a text source is on: a text job replayed from the dead letters
    # lands on the index queue. The stage loads nothing until a text job comes.
    text_on = settings.text.on
    indexer = Indexer(
        settings,
        embedders.for_model(settings.model.id),
        store,
        objects,
        # The cluster's one catalog writer groups every replica's status writes into few commits.
        catalog_writes=HandleCatalogWrites(catalog_writer) if catalog_writer is not None else None,
        holder=process_holder(),
        holder_alive=holder_alive,
        metrics=metrics,
        models=live.live,
        models_now=live.live_now,
        embedders=embedders,
        writer_for=writers,
        text_table=live.text if text_on else lambda: None,
        words=TextStage(settings, objects, settings.serve.text_slots) if text_on else None,
        cpu_slots=cpu_slots,
    )
    dead_letters = dead_letter_queue(settings)
    return IndexTaskHandler(
        indexer,
        dead_letters,
        settings.serve.max_retries,
        metrics,
        writers.health,
        buckets=settings.s3.buckets,
        text_jobs=CeleryJobSink(settings, settings.serve.text_queue) if text_on else None,
    )


def start_decoders(settings: Settings, *, text: bool) -> None:
    """Start the process's decode workers as the replica starts, one per slot that decodes (the index
    consumer's ``consumer_cpu_slots``, the text consumer's ``text_slots``; at most the pool's idle
    workers), so its first jobs don't each start one (~0.38 CPU-s a start, an interpreter importing PyAV:
    in ``bench.cpu`` two started mid-batch, 0.019 CPU-s per video of 40). Call it outside
    ``niced_while_starting``: a worker's niceness is added to its starter's (``DECODE_NICENESS``), so one
    started from a niced thread would decode at that niceness too, for its whole life. One that won't
    start is left to the jobs, which start their own."""
    s = settings.serve
    count = s.text_slots if text else (s.consumer_cpu_slots or s.consumer_concurrency)
    try:
        started = prestart_workers(count)
    except TransientError as exc:
        log.warning("could not start the decode workers ahead of the jobs: %s", exc)
        return
    log.info("started %d decode workers", started)


def warm_up(embedder: FrameEmbedder) -> None:
    """Load the model and run it once while the replica starts, so its first job does not pay for it
    (5.5 s of a 10 s clip's first job in ``bench.e2e``). A model that won't load is left to the jobs,
    which fail with the reason as before."""
    try:
        embedder.embed_images([np.zeros((WARM_UP_SIDE, WARM_UP_SIDE, 3), dtype=np.uint8)])
    except Exception as exc:  # the jobs report it; the replica still serves what it can
        log.warning("could not warm up model %s: %s", embedder.model_id, exc)

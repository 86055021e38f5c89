"""The vidx application graph, wired in one place:

Api (FastAPI ingress) ──► Encoder (SigLIP, @serve.batch for images, texts and frame chunks)
EventRouter (bucket events, pika) ──► index queue (RabbitMQ, Celery adapter)
IndexConsumer (@task_consumer, scaled on queue depth) ──► Encoder (``split``) or its own model
(``fused``), CatalogWriter, LanceDB on S3; text queue (a text job per indexed video)
TextConsumer (@task_consumer on the text queue, only while a text source is on) ──► LanceDB on S3
Upkeep (model preflight, maintenance, backfill, scheduled check) ──► index queue, LanceDB on S3
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import BackpressureConfig

from pipeline.serve.api import Api
from pipeline.serve.autoscale import replica_options
from pipeline.serve.catalog import CatalogWriter
from pipeline.serve.consumer import consumer_deployment
from pipeline.serve.encoder import Encoder
from pipeline.serve.ingest import EventRouterDeployment
from pipeline.serve.logs import logging_config
from pipeline.serve.resources import cluster_has_gpu, gpu_shares
from pipeline.serve.upkeep import Upkeep
from pipeline.settings import Settings


def build_app(settings: Settings) -> Any:
    """The vidx application graph, ready for ``serve.run``."""
    gpu = cluster_has_gpu()
    # Every deployment gets the layout this cluster resolves ``auto`` to (the consumers load a model or not).
    s = settings.serve.model_copy(update={"layout": settings.serve.resolved_layout(gpu)})
    settings = settings.model_copy(update={"serve": s})
    logs = logging_config(s.log_encoding, s.access_log)
    encoder_gpus, consumer_gpus = gpu_shares(settings, gpu)
    # serve.deployment returns a Deployment; its decorators are untyped, hence the ignores.
    encoder = Encoder.options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": s.encoder_num_cpus, "num_gpus": encoder_gpus},
        logging_config=logs,
        **replica_options(settings, "Encoder"),
    ).bind(settings.model, settings.s3)
    catalog_writer = (
        CatalogWriter.options(ray_actor_options={"num_cpus": s.router_num_cpus}, logging_config=logs).bind(settings)  # type: ignore[attr-defined]
        if settings.writer.catalog_grouped
        else None
    )
    consumer = consumer_deployment(settings, consumer_gpus).bind(settings, encoder, catalog_writer)
    # Text jobs on their own deployment, so a video's frames never wait for its slowest text source.
    text_consumer = (
        consumer_deployment(settings, text=True).bind(settings, encoder, catalog_writer) if settings.text.on else None
    )
    router = EventRouterDeployment.options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": s.router_num_cpus}, logging_config=logs
    ).bind(settings)
    # Background threads that mostly wait, like the router's and the catalog writer's: the same share.
    upkeep = Upkeep.options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": s.router_num_cpus}, logging_config=logs
    ).bind(settings)
    # Past max_queued_requests the proxy answers 503 itself; the app sheds earlier (api_max_in_flight).
    api = Api.options(  # type: ignore[attr-defined]
        ray_actor_options={"num_cpus": s.api_num_cpus},
        max_ongoing_requests=s.api_max_ongoing_requests,
        max_queued_requests=s.api_max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=s.retry_after_s),
        logging_config=logs,
    )
    return api.bind(settings, encoder, router, upkeep, consumer, text_consumer)

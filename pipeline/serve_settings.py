"""The Ray Serve application and its task queue (``VIDX_SERVE__...``): part of ``pipeline.settings``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator


class ServeSettings(BaseModel):
    """The Ray Serve application and its task queue."""

    host: str = "127.0.0.1"
    port: int = 8000
    app_name: str = "vidx"
    route_prefix: str = "/"
    index_queue: str = "vidx.index"
    failed_queue: str = "vidx.index.failed"
    unprocessable_queue: str = "vidx.index.unprocessable"
    #: Text jobs (the words of a video whose frames are in), taken by the TextConsumer deployment, which
    #: exists only while a text source is on (``text``); their dead letters go to ``failed_queue``.
    text_queue: str = "vidx.text"
    #: TextConsumer replicas (fixed), the text jobs one runs at once (Celery threads) and of those how
    #: many read words at once (each slot keeps its own OCR engine and speech decoder).
    text_consumer_replicas: int = Field(default=1, ge=1)
    text_consumer_concurrency: int = Field(default=2, ge=1, le=64)
    text_slots: int = Field(default=1, ge=1, le=64)
    text_consumer_num_cpus: float = Field(default=0.25, ge=0)
    #: Celery result backend; empty means a file backend under ``state_dir``.
    backend_url: str = ""
    max_retries: int = Field(default=3, ge=0, le=20)
    #: A failed attempt is retried after this many seconds, doubled each time (1: 1, 2, 4 s): with
    #: ``max_retries`` it bounds how long an outage (a store, the CatalogWriter being replaced) a job
    #: rides out before it is dead-lettered (each attempt also waits up to its own deadlines).
    retry_backoff_s: int = Field(default=1, ge=1, le=60)
    #: Starts of one task whose consumer died mid-job (killed, out of memory) before the video is
    #: failed and dead-lettered: a video that kills its consumer every time ends here, not in a loop.
    max_crashes: int = Field(default=3, ge=1, le=20)
    #: A job's first start claims the video's row (``indexing``, with the started-marker) only once it has
    #: run this long: a shorter job settles with one catalog write (docs/design/state-machine.md, "The
    #: lazy claim"). A retry, a redelivery and a job going round again claim at once; 0: every job does.
    claim_after_s: float = Field(default=1.0, ge=0, le=600)
    #: A consumer replica being stopped (scaled down, redeployed) stops taking tasks and waits this
    #: long for its running ones to finish before it exits (each one killed would be redelivered and
    #: count as a crash of its video).
    drain_timeout_s: float = Field(default=120.0, ge=0)
    #: ``split``: the consumer decodes and the Encoder deployment embeds, each scaling on its own (the
    #: Encoder batches every consumer's frames on the GPU); ``fused``: each consumer replica loads the
    #: model and embeds its own frames (one worker does everything, no hop per frame chunk); the Encoder
    #: deployment then only answers search queries. ``auto``: ``split`` when the Ray cluster has a GPU,
    #: else ``fused`` (chosen with ``python -m bench.e2e``: docs/benchmarks.md has the figures).
    layout: Literal["auto", "split", "fused"] = "auto"
    #: Fixed replica counts, used when ``autoscale.enabled`` is off.
    consumer_replicas: int = Field(default=1, ge=1)
    #: Tasks one consumer replica runs at once (Celery threads; each holds one unacked task).
    #: Chosen with ``python -m bench.e2e`` (docs/benchmarks.md has the figures).
    consumer_concurrency: int = Field(default=16, ge=1, le=64)
    #: Of those, how many decode and embed at once (the rest fetch, or wait on catalog and frame
    #: commits meanwhile); 0: as many as ``consumer_concurrency``.
    consumer_cpu_slots: int = Field(default=2, ge=0, le=64)
    encoder_replicas: int = Field(default=1, ge=1)
    #: Fractions of a CPU each deployment asks Ray for (small machines can't give each a whole core).
    encoder_num_cpus: float = Field(default=0.5, ge=0)
    #: GPUs the Encoder reserves; unset: none without a GPU in the Ray cluster, else one (``split``)
    #: or ``serve.resources.FUSED_GPU_SHARE`` (``fused``: it only answers queries).
    encoder_num_gpus: float | None = Field(default=None, ge=0)
    consumer_num_cpus: float = Field(default=0.25, ge=0)
    #: Niceness added to a consumer replica's process while it starts (0: none; Ray starts every worker
    #: at 15, and 19 is the floor), back to Ray's once it is set up: a burst that starts consumer replicas
    #: (each a process importing torch, PyAV, LanceDB) would otherwise take the cores the Api answers
    #: from, and replicas niced for good would index behind every other process (docs/benchmarks.md).
    #: Going back needs ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` allowing it; without either, nothing is niced.
    consumer_start_nice: int = Field(default=10, ge=0, le=19)
    #: GPUs each consumer replica reserves; unset: none (``split``), or ``serve.resources.FUSED_GPU_SHARE``
    #: when the Ray cluster has a GPU (``fused``: the replicas share one GPU with the query Encoder).
    consumer_num_gpus: float | None = Field(default=None, ge=0)
    #: Requests one Api replica works on at once (Ray's ``max_ongoing_requests``; its default of 5
    #: would queue a burst at the proxy while the replica, all async, waits on I/O).
    api_max_ongoing_requests: int = Field(default=128, ge=2, le=10_000)
    #: Requests the app admits at once beyond /healthz and /metrics; past it they are answered 503
    #: with ``Retry-After``. Below ``api_max_ongoing_requests``: the difference stays free for the probes.
    api_max_in_flight: int = Field(default=112, ge=1)
    #: ``/metrics`` scrapes served at once (each fans out to every node); past it a scrape is answered
    #: 503 with ``Retry-After`` at once, so scrapes never take the slots /healthz answers in.
    metrics_max_in_flight: int = Field(default=4, ge=1)
    #: Requests waiting at the proxy for an Api replica (Ray's ``max_queued_requests``); past it the
    #: proxy itself answers 503 with ``Retry-After`` (-1: no bound).
    api_max_queued_requests: int = Field(default=256, ge=-1)
    #: ``Retry-After`` of every 503: transient failures (a store or the queue restarting, the
    #: encoder scaling) and shed load usually clear within a few seconds.
    retry_after_s: int = Field(default=5, ge=0, le=3600)
    #: How often the Api looks up the catalog's version; ``POST /v1/index`` marks ``queued`` from the
    #: row at the version last seen (``pipeline.jobs.queued_marks``), so a row changed less than this
    #: before the request is left as it is rather than marked (a version older than ten of these
    #: is not used: the request then reads the row before its submit).
    api_version_refresh_s: float = Field(default=0.5, gt=0, le=60)
    api_num_cpus: float = Field(default=0.1, ge=0)
    router_num_cpus: float = Field(default=0.1, ge=0)
    ray_num_cpus: int | None = None
    #: Port of the Ray dashboard on the local stack's head node (``vidx up``; loopback only).
    ray_dashboard_port: int = Field(default=8265, ge=1, le=65535)
    #: Encoding of every replica's log file: ``JSON`` makes each line one object (a job's line
    #: carries ``video_id``, ``task_id``, ``outcome``, ``duration_s``, ``stages_s``).
    log_encoding: Literal["JSON", "TEXT"] = "JSON"
    #: Serve's access log: a line per request and per handle call in every replica. Off by default:
    #: it was ~6 % of the Api replica's CPU per request (py-spy, docs/benchmarks.md); the request
    #: metrics (``/metrics``) count the same requests.
    access_log: bool = False
    #: ``/metrics`` also shows what every replica recorded, read from each Ray node's metrics
    #: endpoint (off when Prometheus scrapes the nodes itself); each node answers within the timeout.
    metrics_from_nodes: bool = True
    metrics_node_timeout_s: float = Field(default=3.0, gt=0, le=60)
    #: Longest wait for the EventRouter's counters, replica counts and queue depth (/metrics).
    stats_timeout_s: float = Field(default=5.0, gt=0)

    def resolved_layout(self, cluster_has_gpu: bool) -> Literal["split", "fused"]:
        """The layout ``layout`` means on a cluster with (or without) a GPU."""
        if self.layout == "auto":
            return "split" if cluster_has_gpu else "fused"
        return self.layout

    @model_validator(mode="after")
    def _probes_keep_room(self) -> ServeSettings:
        """Raises ValueError when admission would leave /healthz no slot."""
        if self.api_max_in_flight + self.metrics_max_in_flight >= self.api_max_ongoing_requests:
            raise ValueError(
                "serve.api_max_in_flight + serve.metrics_max_in_flight must be below serve.api_max_ongoing_requests"
            )
        return self

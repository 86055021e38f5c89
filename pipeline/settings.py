"""The one typed settings object: prefix ``VIDX_``, nested with ``__`` (``VIDX_S3__ENDPOINT_URL``).

Read once at an entry point (CLI, Serve app builder, tests) and passed down; components receive the
part they need in their constructor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from events.config import AmqpSettings, VideoFilterSettings
from pipeline.decode import DecodeLimits
from storage.config import S3Settings

#: SigLIP 2 base/16 at 224 px: same cost as SigLIP base (the B/16 architecture), better retrieval
#: and multilingual text; loads through AutoModel like every SigLIP-family checkpoint.
DEFAULT_MODEL_ID = "google/siglip2-base-patch16-224"


class ModelSettings(BaseModel):
    """Which SigLIP checkpoint to run, where, and how the encoder batches."""

    #: A hub id (``google/siglip-*``, ``google/siglip2-*``) or a local directory.
    id: str = DEFAULT_MODEL_ID
    device: Literal["auto", "cpu", "cuda"] = "auto"
    #: ``auto``: bfloat16 on CUDA, float32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_batch_size: int = Field(default=32, ge=1, le=1024)
    batch_wait_timeout_s: float = Field(default=0.02, ge=0, le=5)
    #: SigLIP text towers were trained on texts padded to 64 tokens.
    text_max_length: int = Field(default=64, ge=8, le=512)
    #: Longest wait for one query embedding (API) and for one frame embedding (indexing).
    query_timeout_s: float = Field(default=30.0, gt=0)
    embed_timeout_s: float = Field(default=300.0, gt=0)
    #: CPU threads for torch (0: torch's default).
    cpu_threads: int = Field(default=0, ge=0)


class SamplingSettings(BaseModel):
    """How frames are sampled from a video."""

    every_s: float = Field(default=1.0, gt=0, le=3600)
    #: Longest side of a decoded frame handed to the encoder (swscale does the scaling).
    decode_max_side: int = Field(default=384, ge=32, le=4096)
    thumbnail_max_side: int = Field(default=192, ge=32, le=1024)
    #: Frames sent to the encoder in one group of concurrent calls.
    embed_chunk: int = Field(default=32, ge=1, le=1024)


class LimitSettings(DecodeLimits):
    """Bounds on work and input, each a named setting (decode limits are inherited)."""

    max_bytes: int = Field(default=8 * 1024**3, gt=0)
    max_query_chars: int = Field(default=512, gt=0)
    max_k: int = Field(default=100, gt=0)
    max_image_bytes: int = Field(default=16 * 1024**2, gt=0)
    max_image_pixels: int = Field(default=50_000_000, gt=0)


class ServeSettings(BaseModel):
    """The Ray Serve application and its task queue."""

    host: str = "127.0.0.1"
    port: int = 8000
    app_name: str = "vidx"
    route_prefix: str = "/"
    index_queue: str = "vidx.index"
    failed_queue: str = "vidx.index.failed"
    unprocessable_queue: str = "vidx.index.unprocessable"
    #: Celery result backend; empty means a file backend under ``state_dir``.
    backend_url: str = ""
    max_retries: int = Field(default=3, ge=0, le=20)
    consumer_replicas: int = Field(default=1, ge=1)
    consumer_concurrency: int = Field(default=2, ge=1, le=64)
    encoder_replicas: int = Field(default=1, ge=1)
    #: Fractions of a CPU each deployment asks Ray for (small machines can't give each a whole core).
    encoder_num_cpus: float = Field(default=0.5, ge=0)
    #: GPUs the Encoder reserves; unset: one when the Ray cluster has a GPU, else none.
    encoder_num_gpus: float | None = Field(default=None, ge=0)
    consumer_num_cpus: float = Field(default=0.25, ge=0)
    api_num_cpus: float = Field(default=0.1, ge=0)
    router_num_cpus: float = Field(default=0.1, ge=0)
    ray_num_cpus: int | None = None
    #: Longest wait for the EventRouter's counters (/metrics).
    stats_timeout_s: float = Field(default=5.0, gt=0)


class Settings(BaseSettings):
    """Everything configurable in vidx. Defaults run the local stack (``vidx up``)."""

    model_config = SettingsConfigDict(env_prefix="VIDX_", env_nested_delimiter="__", extra="ignore")

    s3: S3Settings = Field(default_factory=S3Settings)
    amqp: AmqpSettings = Field(default_factory=AmqpSettings)
    videos: VideoFilterSettings = Field(default_factory=VideoFilterSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    serve: ServeSettings = Field(default_factory=ServeSettings)
    #: Where the local stack keeps its data, logs and pids.
    state_dir: Path = Path(".vidx")
    #: Optional bearer key for the API (``vidx up`` prints where it is).
    api_key: SecretStr | None = None

    @property
    def api_url(self) -> str:
        return f"http://{self.serve.host}:{self.serve.port}"

    @property
    def celery_backend_url(self) -> str:
        if self.serve.backend_url:
            return self.serve.backend_url
        return f"file://{(self.state_dir / 'task-results').resolve()}"

"""The one typed settings object: prefix ``VIDX_``, nested with ``__`` (``VIDX_S3__ENDPOINT_URL``).

Read once at an entry point (CLI, Serve app builder, tests) and passed down; components receive the
part they need in their constructor.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from events.config import AmqpSettings, VideoFilterSettings
from pipeline.autoscale_settings import AutoscaleSettings as AutoscaleSettings
from pipeline.media.settings import DecodeLimits, DecodeStrategy
from pipeline.serve_settings import ServeSettings as ServeSettings
from pipeline.text.settings import TextSettings as TextSettings
from storage.config import IndexSettings, S3Settings
from storage.sampling import Sampling

#: SigLIP 2 base/16 at 224 px: same cost as SigLIP base (the B/16 architecture), better retrieval
#: and multilingual text; loads through AutoModel like every SigLIP-family checkpoint.
DEFAULT_MODEL_ID = "google/siglip2-base-patch16-224"

#: Shortest API key accepted: a short key is a guessable one (``vidx up`` makes 43-character keys).
MIN_API_KEY_CHARS = 16
#: A bearer token as it travels in an ``Authorization`` header: printable ASCII, no spaces.
API_KEY_PATTERN = rf"[\x21-\x7e]{{{MIN_API_KEY_CHARS},}}"


class ModelSettings(BaseModel):
    """Which SigLIP checkpoint to run, where, and how the encoder batches."""

    #: A hub id (``google/siglip-*``, ``google/siglip2-*``) or a local directory.
    id: str = DEFAULT_MODEL_ID
    device: Literal["auto", "cpu", "cuda"] = "auto"
    #: ``auto``: bfloat16 on CUDA, float32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_batch_size: int = Field(default=32, ge=1, le=1024)
    #: Frame chunks (one consumer call each) the Encoder gathers into one group of forward passes:
    #: short videos' chunks fill a batch together; each caller waits for its whole group.
    max_batch_chunks: int = Field(default=4, ge=1, le=256)
    batch_wait_timeout_s: float = Field(default=0.02, ge=0, le=5)
    #: SigLIP text towers were trained on texts padded to 64 tokens.
    text_max_length: int = Field(default=64, ge=8, le=512)
    #: Longest wait for one query embedding (API) and for one frame embedding (indexing).
    query_timeout_s: float = Field(default=30.0, gt=0)
    embed_timeout_s: float = Field(default=300.0, gt=0)
    #: CPU threads for torch (0: torch's default).
    cpu_threads: int = Field(default=0, ge=0)


class WriterSettings(BaseModel):
    """How one consumer process groups the frame writes of its concurrent jobs into commits."""

    #: Videos in one commit at most, and rows (frames) in one commit at most (a video is never split).
    group_max_videos: int = Field(default=16, ge=1, le=1024)
    group_max_rows: int = Field(default=50_000, ge=1)
    #: Longest wait for more videos once one is ready; 0 groups only what arrives during a commit.
    group_wait_s: float = Field(default=0.05, ge=0, le=10)
    #: Longest wait of one job for the commit that holds its rows; then it is retried (transient).
    commit_timeout_s: float = Field(default=120.0, gt=0)
    #: Catalog writes (status transitions) of the whole cluster go through one CatalogWriter
    #: deployment, paced by load. While at most ``catalog_quiet_videos`` claimed videos are unfinished
    #: and at most ``catalog_quiet_writes`` writes arrived within the last ``catalog_min_interval_s``,
    #: commits go at once, ``catalog_quiet_interval_s`` apart at the least (a lone video waits for no
    #: pace). Otherwise a token bucket paces: a commit spends a token, one comes back per
    #: ``catalog_min_interval_s`` after a commit ended, at most ``catalog_burst_commits`` in hand; under
    #: load commits are one interval apart and each carries every write that waited. False: each
    #: consumer commits its own writes one by one.
    catalog_grouped: bool = True
    catalog_min_interval_s: float = Field(default=1.5, ge=0, le=30)
    catalog_burst_commits: int = Field(default=8, ge=1, le=1024)
    catalog_quiet_videos: int = Field(default=2, ge=0, le=1024)
    catalog_quiet_writes: int = Field(default=4, ge=0, le=1024)
    catalog_quiet_interval_s: float = Field(default=0.25, ge=0, le=30)
    #: A claim whose finish never came (its consumer died) stops counting as load after this long.
    catalog_claim_memory_s: float = Field(default=3600.0, gt=0)
    catalog_max_writes: int = Field(default=1024, ge=1)
    #: Longest wait of one transition for the outcome of its catalog write; then it counts as failed.
    catalog_write_timeout_s: float = Field(default=60.0, gt=0)
    #: A writer (catalog or frames) whose work waits this long without a group taken or a commit
    #: ending fails its health check, so Serve replaces its replica (a hung commit, a dead thread).
    stall_after_s: float = Field(default=180.0, gt=0)


class SamplingSettings(BaseModel):
    """How frames are sampled from a video."""

    every_s: float = Field(default=1.0, gt=0, le=3600)
    #: Longest side of a decoded frame handed to the encoder (swscale does the scaling). SigLIP squeezes
    #: a frame to 224x224: 384 keeps a 16:9 frame's short side (216) near that, and thumbnails sharp.
    decode_max_side: int = Field(default=384, ge=32, le=4096)
    #: ``auto`` decodes only the GOPs and frames that hold a sample (the same frames as a full decode);
    #: ``sequential`` decodes every frame; ``keyframes`` samples keyframes only (approximate, cheapest).
    decode_strategy: DecodeStrategy = DecodeStrategy.AUTO
    #: Decoder threads per video (0: one for the sparse strategies, where several consumers decode side by
    #: side and frame threads cost more CPU than they save wall time; FFmpeg's choice for `sequential`).
    decode_threads: int = Field(default=0, ge=0, le=64)
    thumbnail_max_side: int = Field(default=192, ge=32, le=1024)
    #: Frames sent to the encoder in one group of concurrent calls.
    embed_chunk: int = Field(default=32, ge=1, le=1024)

    @property
    def spec(self) -> Sampling:
        """The ``Sampling`` these settings pick frames with (its label goes into every fingerprint)."""
        return Sampling(self.every_s)


class LimitSettings(DecodeLimits):
    """Bounds on work and input, each a named setting (decode limits are inherited)."""

    #: Largest object downloaded for indexing (checked from HEAD, then while reading).
    max_bytes: int = Field(default=8 * 1024**3, gt=0)
    #: Downloads one consumer process runs at once (beyond it, jobs wait for a slot)...
    max_concurrent_downloads: int = Field(default=4, ge=1, le=256)
    #: ...for at most this long, then the job is retried later (a transient failure).
    download_slot_wait_s: float = Field(default=300.0, gt=0)
    max_query_chars: int = Field(default=512, gt=0)
    #: A text search looks for at most this many distinct words of a query, its quoted phrases' first (at
    #: most ``pipeline.query.terms.MAX_QUERY_PHRASES`` of them), then the rest in order; the others are not
    #: searched (a search's cost grows with its words: 171 in a fuzzy search took ~0.6 CPU-s).
    max_query_words: int = Field(default=32, ge=1, le=1024)
    #: A segment of a video's words (a subtitle cue, a frame's on-screen text, a stretch of speech) is cut
    #: at a word past this many characters: the words are the uploader's, and a search reads each it
    #: matches. Rows written before the cap are read up to it too.
    max_segment_chars: int = Field(default=2000, ge=16, le=1_000_000)
    #: Of a video's words, the earliest segments up to this many characters in all are kept (the rest left
    #: out, and the job says so in its log).
    max_video_text_chars: int = Field(default=1_000_000, ge=16)
    max_k: int = Field(default=100, gt=0)
    max_image_bytes: int = Field(default=16 * 1024**2, gt=0)
    max_image_pixels: int = Field(default=50_000_000, gt=0)
    #: A query image is scaled down to this longest side before it goes to the Encoder (frames are
    #: scaled like this too, ``sampling.decode_max_side``; the model squeezes both to its input size).
    query_image_max_side: int = Field(default=512, ge=32, le=8192)
    #: Query images decoded at once per Api replica (off the event loop, on threads); more wait.
    image_decodes_in_flight: int = Field(default=2, ge=1, le=64)
    #: Requests per second one caller (API key, or address without keys) may make on average to
    #: ``POST /v1/index`` and to the search endpoints, per Api replica; bursts up to ``*_burst``.
    #: Past it: 429 with ``Retry-After``. 0: no limit.
    index_rate_per_s: float = Field(default=50.0, ge=0)
    index_burst: int = Field(default=200, ge=1)
    search_rate_per_s: float = Field(default=20.0, ge=0)
    search_burst: int = Field(default=40, ge=1)


class CheckSettings(BaseModel):
    """The scheduled check: bucket, catalog and frames held against each other inside the app."""

    #: Seconds between rounds of the scheduled check (0: never; ``vidx check`` still works).
    interval_s: float = Field(default=300.0, ge=0)
    #: Objects listed per round: the check goes through the buckets a slice at a time, resuming
    #: where the last round stopped, so one round stays short however big the bucket.
    objects_per_round: int = Field(default=5000, ge=1)
    #: A video queued or indexing for longer than this, or an object changed more recently, is
    #: given time (a job may be on its way); past it, it is an inconsistency and is repaired.
    #: Longer than the longest job (``limits.max_decode_s`` plus fetch and embed).
    in_flight_grace_s: float = Field(default=3600.0, ge=0)
    #: An object changed in the bucket more recently than this is not yet missing or stale: its
    #: event may still be on the queue.
    new_object_grace_s: float = Field(default=600.0, ge=0)
    #: Lease the scheduled check takes (one worker at a time in the whole fleet).
    lease_ttl_s: float = Field(default=120.0, gt=0)
    #: Submit repairing jobs for what a scheduled round finds.
    repair: bool = True
    #: Rows stuck in flight resubmitted per round at most (the rest wait for the next round)...
    stuck_per_round: int = Field(default=1000, ge=1)
    #: ...and a resubmitted row that has not changed since is not resubmitted again before this (its
    #: job may wait in a backlog; resubmitting every round would multiply it). Kept by the leader.
    resubmit_after_s: float = Field(default=14_400.0, gt=0)


class ReindexSettings(BaseModel):
    """Model switches (``vidx reindex``, ``pipeline.upkeep.backfill``)."""

    #: A configured model (``model.id``) that differs from the index's active model starts a backfill
    #: to it at start-up; off, such a configuration is refused at start-up with what to do.
    auto: bool = False
    #: Seconds between rounds of the backfill coordinator (progress, submits, the switch).
    interval_s: float = Field(default=5.0, gt=0, le=600)
    #: Backfill jobs submitted and not yet done, at most: the backfill fills the queue this far and
    #: no further, so uploads still get through and a restart resubmits at most this many.
    max_outstanding: int = Field(default=64, ge=1, le=100_000)
    #: A backfill job not done after this is submitted again (its job may have been lost).
    resubmit_after_s: float = Field(default=900.0, gt=0)
    #: For this long after a switch the coordinator still gives a job to any indexed video without
    #: the active model's rows (one that settled in the instant of the switch).
    sweep_s: float = Field(default=600.0, ge=0)
    #: Longest the switch waits, once every video has the new model, for the ANN index of the new
    #: table when it is past ``index.ann_min_rows`` rows (index maintenance builds it within
    #: ``index.optimize_interval_s``); past it the switch goes ahead and searches scan until then.
    #: 0: never wait.
    index_wait_s: float = Field(default=1800.0, ge=0)
    #: How often index jobs and searches re-read which models are live and which one is active.
    live_refresh_s: float = Field(default=2.0, gt=0, le=60)
    #: Leeway for clocks of different hosts when telling whether a job knew of the backfill.
    clock_skew_s: float = Field(default=30.0, ge=0, le=3600)
    #: Lease the coordinator takes (one worker at a time in the whole fleet).
    lease_ttl_s: float = Field(default=60.0, gt=0)


class Settings(BaseSettings):
    """Everything configurable in vidx. Defaults run the local stack (``vidx up``)."""

    # Validation errors never quote the input: it holds credentials and keys.
    model_config = SettingsConfigDict(
        env_prefix="VIDX_", env_nested_delimiter="__", extra="ignore", hide_input_in_errors=True
    )

    s3: S3Settings = Field(default_factory=S3Settings)
    amqp: AmqpSettings = Field(default_factory=AmqpSettings)
    videos: VideoFilterSettings = Field(default_factory=VideoFilterSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    writer: WriterSettings = Field(default_factory=WriterSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    serve: ServeSettings = Field(default_factory=ServeSettings)
    autoscale: AutoscaleSettings = Field(default_factory=AutoscaleSettings)
    index: IndexSettings = Field(default_factory=IndexSettings)
    check: CheckSettings = Field(default_factory=CheckSettings)
    reindex: ReindexSettings = Field(default_factory=ReindexSettings)
    text: TextSettings = Field(default_factory=TextSettings)
    #: Where the local stack keeps its data, logs and pids.
    state_dir: Path = Path(".vidx")
    #: Bearer keys the API accepts; several at once let a key rotate (``VIDX_API_KEYS='["k1","k2"]'``).
    #: Once validated it also holds ``api_key`` and the key in ``api_key_file``. None at all: no auth.
    api_keys: list[SecretStr] = Field(default_factory=list)
    #: One more key, the common case (``VIDX_API_KEY``).
    api_key: SecretStr | None = None
    #: A file holding one API key (``vidx up`` writes ``<state_dir>/api-key``, mode 0600).
    api_key_file: Path | None = None
    #: The key for ``/v1/admin/...`` (dead letters, reindex); it opens every other endpoint too.
    #: Once validated it holds the key in ``admin_key_file`` when that is set.
    admin_key: SecretStr | None = None
    admin_key_file: Path | None = None
    #: Signs the short-lived thumbnail links the API hands out (``pipeline.query.links``); unset, a
    #: key derived from the API keys (rotating them retires old links).
    media_key: SecretStr | None = None

    @model_validator(mode="after")
    def _consumer_target(self) -> Settings:
        """An unset consumer target becomes what one replica holds (``serve.consumer_concurrency``)."""
        if self.autoscale.consumer_target_per_replica is None:
            self.autoscale.consumer_target_per_replica = self.serve.consumer_concurrency
        return self

    @model_validator(mode="after")
    def _gather_keys(self) -> Settings:
        """Fold ``api_key`` and the key files into ``api_keys``/``admin_key`` and check every key.

        Raises ValueError (never quoting a key) for an unreadable or empty file, both ``admin_key``
        and ``admin_key_file``, or a key that is short or not a plain header token.
        """
        keys = [*self.api_keys, *([self.api_key] if self.api_key else [])]
        if self.api_key_file is not None:
            keys.append(self._read_key_file(self.api_key_file, "api_key_file"))
        if self.admin_key_file is not None:
            if self.admin_key is not None:
                raise ValueError("set admin_key or admin_key_file, not both")
            self.admin_key = self._read_key_file(self.admin_key_file, "admin_key_file")
        for name, key in [*(("api_keys", k) for k in keys), ("admin_key", self.admin_key)]:
            if key is not None and not re.fullmatch(API_KEY_PATTERN, key.get_secret_value()):
                raise ValueError(f"{name}: a key is at least {MIN_API_KEY_CHARS} printable ASCII characters, no spaces")
        unique = {k.get_secret_value(): k for k in keys}
        self.api_keys = list(unique.values())
        return self

    @staticmethod
    def _read_key_file(path: Path, name: str) -> SecretStr:
        try:
            return SecretStr(path.expanduser().read_text(encoding="utf-8").strip())
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{name}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from exc

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys or self.admin_key)

    @property
    def api_url(self) -> str:
        """Where clients reach the app: its host, port and route prefix (no trailing slash)."""
        return f"http://{self.serve.host}:{self.serve.port}{self.serve.route_prefix.rstrip('/')}"

    @property
    def celery_backend_url(self) -> str:
        if self.serve.backend_url:
            return self.serve.backend_url
        return f"file://{(self.state_dir / 'task-results').resolve()}"

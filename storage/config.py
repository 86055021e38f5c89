"""Settings of the storage layer (object store and LanceDB)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

#: Longest life of a presigned playback link: links end up in browser histories and shared chats.
MAX_PRESIGN_TTL_S = 3600


class S3Settings(BaseModel):
    """Where the object store is and which buckets vidx works with."""

    # Validation errors never quote the input: it holds the credentials.
    model_config = ConfigDict(hide_input_in_errors=True)

    endpoint_url: str = "http://127.0.0.1:9000"
    access_key: SecretStr = SecretStr("minioadmin")
    secret_key: SecretStr = SecretStr("minioadmin")
    region: str = "us-east-1"
    #: Buckets whose videos vidx indexes; the first is the default upload bucket.
    buckets: list[str] = Field(default_factory=lambda: ["videos"], min_length=1)
    #: Bucket that holds the LanceDB tables.
    index_bucket: str = "vidx-index"
    #: Prefix of the LanceDB database inside the index bucket.
    index_prefix: str = "lancedb"
    #: Endpoint clients use to play videos, when it differs from ``endpoint_url`` (containers, proxies).
    public_endpoint_url: str | None = None
    #: Lifetime of presigned playback links: long enough to start playing, short enough that a leaked
    #: link soon stops working.
    presign_ttl_s: int = Field(default=600, ge=10, le=MAX_PRESIGN_TTL_S)
    #: The client's own bounds per attempt (AioConfig): opening a connection, and the longest silence
    #: while reading an answer (each socket read, so a slow but steady body never trips it).
    connect_timeout_s: float = Field(default=5.0, gt=0)
    read_timeout_s: float = Field(default=60.0, gt=0)
    #: Attempts per request inside the client (botocore's standard retry mode), within the deadlines below.
    max_attempts: int = Field(default=5, ge=1, le=20)
    #: Deadlines of whole calls, the client's retries included; past one the call is cancelled and
    #: fails transiently, naming the operation and the setting.
    #: One metadata request: HEAD of an object or a bucket, a bucket's versioning state or creation.
    head_timeout_s: float = Field(default=30.0, gt=0)
    #: One whole download, first byte to last (8 GiB, the default ``max_bytes``, at ~10 MB/s).
    download_timeout_s: float = Field(default=900.0, gt=0)
    #: One whole upload (``ObjectStore.put``).
    upload_timeout_s: float = Field(default=900.0, gt=0)
    #: One page of a listing (up to 1000 keys); the caller's work between pages doesn't count.
    list_page_timeout_s: float = Field(default=60.0, gt=0)
    #: Opening the client (botocore loads its service models: CPU, no request).
    client_open_timeout_s: float = Field(default=30.0, gt=0)
    #: Closing the client (its connection pool) when its owner goes away.
    close_timeout_s: float = Field(default=10.0, gt=0)
    #: ``BlockingObjectStore``: how long past a deadline a caller waits for the cancelled call to end
    #: before giving up on it (only a client loop blocked by something else takes that long).
    cancel_grace_s: float = Field(default=5.0, gt=0)

    @property
    def upload_bucket(self) -> str:
        return self.buckets[0]

    @property
    def index_uri(self) -> str:
        return f"s3://{self.index_bucket}/{self.index_prefix}"


class IndexSettings(BaseModel):
    """The ANN index on ``frames.vector``, how searches use it, and the maintenance loop that keeps it."""

    #: Rows in ``frames`` past which the ANN index is built; below it every search is an exact scan
    #: (at 100k 768-d rows a scan reads ~300 MB per query; an index costs minutes to train).
    ann_min_rows: int = Field(default=100_000, ge=256)
    #: IVF_SQ: int8 codes and a refine step kept recall@10 near 1.0 where IVF_PQ (and 1-bit IVF_RQ)
    #: missed neighbours in tight clusters of near-duplicate frames, and it trains in a fraction of PQ's time.
    index_type: Literal["IVF_SQ", "IVF_PQ", "IVF_RQ", "IVF_HNSW_SQ"] = "IVF_SQ"
    #: Rows per IVF partition when the index is (re)built: partitions = rows // this (at least 1).
    rows_per_partition: int = Field(default=4096, ge=256)
    #: IVF_PQ only: sub-vectors per vector (the dimension must divide by it); unset: LanceDB's default.
    num_sub_vectors: int | None = Field(default=None, ge=1)
    #: Partitions searched per query, and candidates re-ranked with exact vectors (``refine_factor·limit``).
    #: 10 of the ~244 partitions at 1M rows: recall@10 1.0 at 22–27 ms there; 5 gave 18 ms, same recall,
    #: on clustered synthetic frames, kept as margin for real embeddings (``python -m bench.stages.search`` sweeps it).
    nprobes: int = Field(default=10, ge=1)
    refine_factor: int | None = Field(default=5, ge=1)
    #: How stale the API's search handle may be. 0: a search sees every commit finished before it
    #: began (a video whose status says indexed is found), at the cost of one manifest check per search,
    #: shared by the searches waiting at that moment. Above 0: the handle re-checks the latest version at
    #: most this often (a video just indexed may be missing from results for that long).
    search_consistency_s: float = Field(default=0.0, ge=0)
    #: The maintenance loop: one round per interval (index creation, ``optimize`` of both tables).
    optimize_interval_s: float = Field(default=300.0, gt=0)
    #: Rebuild (retrain partitions) once the table has grown this many times over the rows the index was
    #: built on; in between, new rows are only folded into the existing partitions, which grow.
    rebuild_growth: float = Field(default=4.0, gt=1)
    #: A round folds new rows into the index only once this many rows are unindexed (or fragments pile up).
    optimize_min_unindexed_rows: int = Field(default=1, ge=0)
    #: Old table versions kept by ``optimize`` (readers of an old version keep working this long).
    keep_versions_s: float = Field(default=3600.0, ge=0)
    #: Between full rounds, small fragments are compacted this often: every commit adds one, and a read
    #: or a merge on the key opens every fragment (at 300 fragments a catalog read took ~15x longer
    #: than compacted). Fragments of ``frames`` stop being rewritten once they hold ``compact_target_rows``.
    compact_interval_s: float = Field(default=15.0, gt=0)
    compact_target_rows: int = Field(default=8192, ge=1024)
    #: A compaction tick compacts the catalog only once it has this many fragments (every status
    #: commit adds one): Lance's optimize commits two versions even with nothing to merge, so a tick
    #: on a quiet catalog would cost commits (and S3 requests) per tick rather than per video. A full
    #: round compacts it whenever anything was written since the last compaction.
    catalog_compact_fragments: int = Field(default=16, ge=2)
    #: The maintenance lease: one worker maintains; another takes over once the lease has lapsed.
    lease_ttl_s: float = Field(default=900.0, gt=0)

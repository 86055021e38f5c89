"""Settings of the storage layer (object store and LanceDB)."""

from __future__ import annotations

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
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    max_attempts: int = Field(default=5, ge=1, le=20)

    @property
    def upload_bucket(self) -> str:
        return self.buckets[0]

    @property
    def index_uri(self) -> str:
        return f"s3://{self.index_bucket}/{self.index_prefix}"

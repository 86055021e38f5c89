"""Identity: video ids from (bucket, key), S3 URIs, and index fingerprints."""

from __future__ import annotations

import hashlib
import posixpath
from urllib.parse import unquote

from pipeline.errors import InvalidInput


def video_id(bucket: str, key: str) -> str:
    """The stable id of the object ``s3://bucket/key``: every event for that object maps to it."""
    digest = hashlib.sha256(f"{bucket}\x00{key}".encode()).hexdigest()
    return f"v{digest[:24]}"


def frame_id(video_id_: str, sample_index: int) -> str:
    return f"{video_id_}-{sample_index:07d}"


def s3_uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


def parse_s3_uri(uri: str, allowed_buckets: list[str]) -> tuple[str, str]:
    """Split ``s3://bucket/key`` and check it names an object in one of ``allowed_buckets``.

    Raises:
        InvalidInput: not an ``s3://`` URI, no key, a bucket that isn't configured, or a key that
            tries to climb out of its prefix (``..``).
    """
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise InvalidInput("only s3:// URIs are accepted")
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket or not key:
        raise InvalidInput("an s3:// URI needs a bucket and a key: s3://bucket/key")
    if bucket not in allowed_buckets:
        raise InvalidInput(f"bucket {bucket!r} is not one of the configured buckets")
    parts = unquote(key).split("/")
    if ".." in parts or "." in parts or key.startswith("/") or posixpath.isabs(key):
        raise InvalidInput("the key may not contain '.' or '..' segments")
    if len(key.encode()) > 1024:
        raise InvalidInput("the key is longer than 1024 bytes")
    return bucket, key


def fingerprint(version: str, model_id: str, every_s: float) -> str:
    """What an index result depends on: content version, model and sampling settings."""
    return hashlib.sha256(f"{version}\x00{model_id}\x00every_s={every_s:g}".encode()).hexdigest()[:32]

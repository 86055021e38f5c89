"""Identity: video ids from (bucket, key), S3 URIs, and index fingerprints."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from urllib.parse import unquote

from storage.errors import InvalidInput
from storage.sampling import Sampling


def video_id(bucket: str, key: str) -> str:
    """The stable id of the object ``s3://bucket/key``: every event for that object maps to it."""
    digest = hashlib.sha256(f"{bucket}\x00{key}".encode()).hexdigest()
    return f"v{digest[:24]}"


def frame_id(video_id_: str, sample_index: int) -> str:
    return f"{video_id_}-{sample_index:07d}"


def s3_uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


#: S3's longest object key, in UTF-8 bytes.
MAX_KEY_BYTES = 1024
#: Percent-decoding rounds checked for hidden segments (``%252e%252e`` is ``..`` after two).
_DECODE_ROUNDS = 3
#: Percent-encoded ``/``, ``\\`` and NUL: separators smuggled past a path check.
_ENCODED_SEPARATOR = re.compile(r"%(2f|5c|00)", re.IGNORECASE)


def parse_s3_uri(uri: str, allowed_buckets: list[str]) -> tuple[str, str]:
    """Split ``s3://bucket/key`` and check it names an object in one of ``allowed_buckets``.

    The key must be one plain object name: no ``.``/``..`` or empty segments (also not after
    percent-decoding or Unicode compatibility folding), no percent-encoded separators, no
    backslashes or control characters, at most 1024 UTF-8 bytes.

    Raises:
        InvalidInput: not an ``s3://`` URI, no key, a bucket that isn't configured, or a key that
            isn't one plain object name.
    """
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise InvalidInput("only s3:// URIs are accepted")
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket or not key:
        raise InvalidInput("an s3:// URI needs a bucket and a key: s3://bucket/key")
    if bucket not in allowed_buckets:
        raise InvalidInput(f"bucket {bucket!r} is not one of the configured buckets")
    _check_key(key)
    return bucket, key


def _check_key(key: str) -> None:
    if _has_control(key):  # before encoding: a lone surrogate has no UTF-8 form
        raise InvalidInput("the key may not contain control characters")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidInput(f"the key is longer than {MAX_KEY_BYTES} bytes")
    for form in _readings(key):
        if _ENCODED_SEPARATOR.search(form):
            raise InvalidInput("the key may not contain percent-encoded '/', '\\' or NUL")
        if "\\" in form:
            raise InvalidInput("the key may not contain backslashes")
        if _has_control(form):
            raise InvalidInput("the key may not contain control characters")
        parts = form.split("/")
        if form.startswith("/") or "" in parts[:-1]:
            raise InvalidInput("the key may not start with '/' or contain '//'")
        if ".." in parts or "." in parts:
            raise InvalidInput("the key may not contain '.' or '..' segments")


def _has_control(text: str) -> bool:
    return any(unicodedata.category(c) in ("Cc", "Cs") for c in text)


def _readings(key: str) -> list[str]:
    """The ways a lenient server could read ``key``: as is, percent-decoded (repeatedly), NFKC-folded."""
    forms = [key]
    for _ in range(_DECODE_ROUNDS):
        decoded = unquote(forms[-1], errors="replace") if "%" in forms[-1] else forms[-1]
        if decoded == forms[-1]:
            break
        forms.append(decoded)
    return forms + [unicodedata.normalize("NFKC", f) for f in forms]


def fingerprint(version: str, model_id: str, sampling: Sampling) -> str:
    """What an index result depends on: content version, model and sampling (its label)."""
    return hashlib.sha256(f"{version}\x00{model_id}\x00{sampling.label}".encode()).hexdigest()[:32]


def text_fingerprint(version: str, pipeline: str) -> str:
    """What a video's text segments depend on: content version and text pipeline (its id carries the
    OCR's own sampling; the frames' sampling is not in it, so a change of that reads no words again)."""
    return hashlib.sha256(f"{version}\x00text\x00{pipeline}".encode()).hexdigest()[:32]


def segment_id(video_id_: str, index: int) -> str:
    """The ``index``-th text segment of a video (in ``TextExtractor``'s order: deterministic)."""
    return f"{video_id_}-t{index:06d}"

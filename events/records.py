"""MinIO bucket-event records -> typed events. The one place that knows MinIO's wire format.

A message body is one JSON document: ``{"EventName", "Key", "Records": [...]}``. Each record's
``s3.object.key`` is query-escaped (spaces arrive as ``+``), so keys are decoded with ``unquote_plus``.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_plus

from storage.errors import PermanentError
from storage.ids import s3_uri


class EventKind(enum.StrEnum):
    CREATED = "created"
    REMOVED = "removed"


class EventDecodeError(PermanentError):
    """Raised when a message body is not a MinIO bucket event; keeps the raw body and the cause."""

    def __init__(self, message: str, raw: bytes) -> None:
        super().__init__(message)
        self.raw = raw


@dataclass(frozen=True, slots=True)
class BucketEvent:
    """One object change, as MinIO reported it. A hint: the consumer checks the object's real state."""

    kind: EventKind
    event_name: str
    bucket: str
    key: str
    version_id: str | None = None
    etag: str | None = None
    size: int | None = None
    content_type: str | None = None
    sequencer: str | None = None
    event_time: str | None = None

    @property
    def uri(self) -> str:
        return s3_uri(self.bucket, self.key)


def _kind(event_name: str) -> EventKind | None:
    # MinIO names: s3:ObjectCreated:{Put,Post,Copy,CompleteMultipartUpload,PutRetention,...}
    # and s3:ObjectRemoved:{Delete,DeleteMarkerCreated,NoOP,...}; tolerate a missing "s3:" prefix.
    name = event_name.removeprefix("s3:")
    if name.startswith("ObjectCreated:"):
        return EventKind.CREATED
    if name.startswith("ObjectRemoved:"):
        return EventKind.REMOVED
    return None


def _optional_str(node: dict[str, Any], field: str, raw: bytes) -> str | None:
    """The string at ``node[field]``; absent, ``null`` and ``""`` are ``None``.

    Raises:
        EventDecodeError: the field is present with a type other than string.
    """
    value = node.get(field)
    if value is None:
        return None
    if not isinstance(value, str):
        raise EventDecodeError(f"{field} is {type(value).__name__}, not a string", raw)
    return value or None


def _record_event(record: dict[str, Any], raw: bytes) -> BucketEvent | None:
    name = record.get("eventName")
    if not isinstance(name, str):
        raise EventDecodeError("record has no eventName", raw)
    kind = _kind(name)
    if kind is None:
        return None
    try:
        s3 = record["s3"]
        bucket = s3["bucket"]["name"]
        obj = s3["object"]
        escaped_key = obj["key"]
    except (KeyError, TypeError) as exc:
        raise EventDecodeError(f"record lacks s3.bucket.name or s3.object.key: {exc!r}", raw) from exc
    # Wrong types are rejected here, the one decoding place, so nothing downstream (key unescaping,
    # the video filter, the IndexJob model) can fail on them and stall the consumer.
    if bucket is not None and not isinstance(bucket, str):
        raise EventDecodeError(f"s3.bucket.name is {type(bucket).__name__}, not a string", raw)
    if escaped_key is not None and not isinstance(escaped_key, str):
        raise EventDecodeError(f"s3.object.key is {type(escaped_key).__name__}, not a string", raw)
    key = unquote_plus(escaped_key) if escaped_key else ""
    if not bucket or not key:
        raise EventDecodeError("empty bucket or key", raw)
    size = obj.get("size")
    # bool is a subclass of int, but `"size": true` is no size.
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
        raise EventDecodeError(f"s3.object.size is {size!r}, not a non-negative integer", raw)
    etag = _optional_str(obj, "eTag", raw) or _optional_str(obj, "etag", raw)
    return BucketEvent(
        kind=kind,
        event_name=name,
        bucket=bucket,
        key=key,
        version_id=_optional_str(obj, "versionId", raw),
        etag=etag.strip('"') if etag else None,
        size=size,
        content_type=_optional_str(obj, "contentType", raw),
        sequencer=_optional_str(obj, "sequencer", raw),
        event_time=_optional_str(record, "eventTime", raw),
    )


def decode_message(body: bytes) -> list[BucketEvent]:
    """Decode one AMQP message body into the object events it carries.

    Records of event kinds vidx does not act on (e.g. ``s3:ObjectAccessed:Get``) are skipped.

    Raises:
        EventDecodeError: the body is not JSON or not a MinIO event document.
    """
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EventDecodeError(f"not JSON: {exc}", body) from exc
    if not isinstance(doc, dict):
        raise EventDecodeError("event document is not a JSON object", body)
    records = doc.get("Records")
    if not isinstance(records, list) or not records:
        raise EventDecodeError("event document has no Records", body)
    events: list[BucketEvent] = []
    for record in records:
        if not isinstance(record, dict):
            raise EventDecodeError("a record is not a JSON object", body)
        event = _record_event(record, body)
        if event is not None:
            events.append(event)
    return events

"""events/records.py: MinIO AMQP bodies -> BucketEvent."""

from __future__ import annotations

import dataclasses
import json
from typing import Any
from urllib.parse import quote_plus, unquote_plus

import pytest

from events.records import BucketEvent, EventDecodeError, EventKind, decode_message
from storage.errors import PermanentError

BUCKET = "videos"


def minio_record(
    event_name: str,
    escaped_key: str,
    *,
    bucket: str = BUCKET,
    size: int | None = 248_682,
    etag: str | None = "f1671feacb8bbf7b0397c6e9364e8c92",
    content_type: str | None = "video/mp4",
    version_id: str | None = None,
    sequencer: str = "17E5C3B1A6F1E2D4",
    event_time: str = "2026-02-12T20:18:48.123Z",
) -> dict[str, Any]:
    """One record as MinIO publishes it; ``escaped_key`` is already query-escaped as on the wire."""
    obj: dict[str, Any] = {"key": escaped_key, "sequencer": sequencer}
    if size is not None:
        obj["size"] = size
    if etag is not None:
        obj["eTag"] = etag
    if content_type is not None:
        obj["contentType"] = content_type
        obj["userMetadata"] = {"content-type": content_type}
    if version_id is not None:
        obj["versionId"] = version_id
    return {
        "eventVersion": "2.0",
        "eventSource": "minio:s3",
        "awsRegion": "",
        "eventTime": event_time,
        "eventName": event_name,
        "userIdentity": {"principalId": "minioadmin"},
        "requestParameters": {"principalId": "minioadmin", "region": "", "sourceIPAddress": "172.17.0.1"},
        "responseElements": {
            "x-amz-id-2": "dd9025bab4ad464b049177c95eb6ebf374d3b3fd1af9251148b658df7ac2e3e8",
            "x-amz-request-id": "1891B2C3D4E5F607",
            "x-minio-deployment-id": "5e0b7c2a-8d4f-4a53-9a1c-1f2e3d4c5b6a",
            "x-minio-origin-endpoint": "http://172.17.0.2:9000",
        },
        "s3": {
            "s3SchemaVersion": "1.0",
            "configurationId": "Config",
            "bucket": {
                "name": bucket,
                "ownerIdentity": {"principalId": "minioadmin"},
                "arn": f"arn:aws:s3:::{bucket}",
            },
            "object": obj,
        },
        "source": {"host": "172.17.0.1", "port": "", "userAgent": "MinIO (linux; amd64) minio-go/v7.0.95"},
    }


def minio_body(*records: dict[str, Any], key: str | None = None) -> bytes:
    """A whole AMQP message body: top-level ``EventName`` and ``Key`` (``bucket/key``, unescaped)."""
    first = records[0] if records else {}
    if key is None:
        s3 = first.get("s3", {})
        key = f"{s3.get('bucket', {}).get('name', '')}/{unquote_plus(s3.get('object', {}).get('key', ''))}"
    doc = {"EventName": first.get("eventName", ""), "Key": key, "Records": list(records)}
    return json.dumps(doc).encode()


def decode_one(body: bytes) -> BucketEvent:
    events = decode_message(body)
    assert len(events) == 1
    return events[0]


def test_put_decodes_every_field() -> None:
    body = minio_body(minio_record("s3:ObjectCreated:Put", "clips%2Fbeach.mp4", version_id="v-7"))

    event = decode_one(body)

    assert event == BucketEvent(
        kind=EventKind.CREATED,
        event_name="s3:ObjectCreated:Put",
        bucket=BUCKET,
        key="clips/beach.mp4",
        version_id="v-7",
        etag="f1671feacb8bbf7b0397c6e9364e8c92",
        size=248_682,
        content_type="video/mp4",
        sequencer="17E5C3B1A6F1E2D4",
        event_time="2026-02-12T20:18:48.123Z",
    )
    assert event.uri == "s3://videos/clips/beach.mp4"


def test_event_is_frozen() -> None:
    event = decode_one(minio_body(minio_record("s3:ObjectCreated:Put", "a.mp4")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.key = "b.mp4"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("escaped", "key"),
    [
        ("my+holiday+clip.mp4", "my holiday clip.mp4"),
        ("a%2Bb.mp4", "a+b.mp4"),
        ("c%2B%2B+talk+1%2B1.mp4", "c++ talk 1+1.mp4"),
        ("100%25+done.mp4", "100% done.mp4"),
        ("%2525.mp4", "%25.mp4"),
        ("caf%C3%A9.mp4", "café.mp4"),
        ("%E6%97%A5%E6%9C%AC%2F%E5%8B%95%E7%94%BB.mp4", "日本/動画.mp4"),
        ("%F0%9F%8E%AC+take+2.webm", "🎬 take 2.webm"),
        ("2026%2F02%2F12%2Fcam-01%2Fpart+1%2Fclip.mkv", "2026/02/12/cam-01/part 1/clip.mkv"),
        ("2026/02/12/cam-01/part+1/clip.mkv", "2026/02/12/cam-01/part 1/clip.mkv"),
        ("a%26b%3Dc%3F%23.mp4", "a&b=c?#.mp4"),
    ],
)
def test_keys_are_unescaped(escaped: str, key: str) -> None:
    event = decode_one(minio_body(minio_record("s3:ObjectCreated:Put", escaped)))

    assert event.key == key
    assert event.uri == f"s3://{BUCKET}/{key}"


@pytest.mark.parametrize(
    "key",
    ["plain.mp4", "deep/" * 20 + "x.mp4", "sp ace/plus+/pct%/é/日本.mp4", "~tilde_-.mp4", "a  b++c%%d.mp4"],
)
def test_key_round_trips_through_query_escaping(key: str) -> None:
    # MinIO escapes keys with Go's url.QueryEscape, which quote_plus with safe="" mirrors.
    event = decode_one(minio_body(minio_record("s3:ObjectCreated:Put", quote_plus(key, safe=""))))

    assert event.key == key


@pytest.mark.parametrize("event_name", ["s3:ObjectCreated:Put", "s3:ObjectCreated:Post", "s3:ObjectCreated:Copy"])
def test_created_events(event_name: str) -> None:
    event = decode_one(minio_body(minio_record(event_name, "a.mp4")))

    assert event.kind is EventKind.CREATED
    assert event.event_name == event_name


def test_complete_multipart_upload_keeps_multipart_etag() -> None:
    record = minio_record(
        "s3:ObjectCreated:CompleteMultipartUpload",
        "big/movie.mp4",
        size=3 * 16 * 1024**2,
        etag="d41d8cd98f00b204e9800998ecf8427e-3",
    )

    event = decode_one(minio_body(record))

    assert event.kind is EventKind.CREATED
    assert event.etag == "d41d8cd98f00b204e9800998ecf8427e-3"
    assert event.size == 3 * 16 * 1024**2


def test_quoted_etag_is_unquoted() -> None:
    event = decode_one(minio_body(minio_record("s3:ObjectCreated:Put", "a.mp4", etag='"abc123"')))

    assert event.etag == "abc123"


def test_event_name_without_s3_prefix_is_tolerated() -> None:
    event = decode_one(minio_body(minio_record("ObjectRemoved:Delete", "a.mp4")))

    assert event.kind is EventKind.REMOVED


@pytest.mark.parametrize("event_name", ["s3:ObjectRemoved:Delete", "s3:ObjectRemoved:DeleteMarkerCreated"])
def test_removed_events_have_no_object_facts(event_name: str) -> None:
    # A delete marker exists only in a versioned bucket, and the event names the marker's version.
    version_id = "0f4c9d7e-3b1a-4c2d-9e8f-7a6b5c4d3e2f" if event_name.endswith("DeleteMarkerCreated") else None
    record = minio_record(event_name, "old+clip.mp4", size=None, etag=None, content_type=None, version_id=version_id)

    event = decode_one(minio_body(record))

    assert event.kind is EventKind.REMOVED
    assert event.key == "old clip.mp4"
    assert (event.size, event.etag, event.content_type) == (None, None, None)
    assert event.version_id == version_id
    assert event.sequencer == "17E5C3B1A6F1E2D4"


def test_empty_version_id_is_none() -> None:
    event = decode_one(minio_body(minio_record("s3:ObjectCreated:Put", "a.mp4", version_id="")))

    assert event.version_id is None


@pytest.mark.parametrize(
    "event_name",
    [
        "s3:ObjectAccessed:Get",
        "s3:ObjectAccessed:Head",
        "s3:ObjectAccessed:GetRetention",
        "s3:Replication:OperationFailedReplication",
        "s3:ObjectRestore:Completed",
        "s3:Scanner:ManyVersions",
        "s3:BucketCreated",
        "something:else",
    ],
)
def test_events_vidx_does_not_act_on_are_skipped(event_name: str) -> None:
    assert decode_message(minio_body(minio_record(event_name, "a.mp4"))) == []


def test_several_records_keep_their_order_and_skip_the_others() -> None:
    body = minio_body(
        minio_record("s3:ObjectCreated:Put", "one.mp4"),
        minio_record("s3:ObjectAccessed:Get", "one.mp4"),
        minio_record("s3:ObjectRemoved:Delete", "two.mp4", size=None, etag=None, content_type=None),
        minio_record("s3:ObjectCreated:Copy", "three.mp4", bucket="other"),
    )

    events = decode_message(body)

    assert [(e.kind, e.bucket, e.key) for e in events] == [
        (EventKind.CREATED, "videos", "one.mp4"),
        (EventKind.REMOVED, "videos", "two.mp4"),
        (EventKind.CREATED, "other", "three.mp4"),
    ]


def _without(record: dict[str, Any], *path: str) -> dict[str, Any]:
    node = record
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]
    return record


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "not JSON"),
        (b"not json at all", "not JSON"),
        (b"\xff\xfe\x00garbage", "not JSON"),
        (b'{"Records": [', "not JSON"),
        (b"[]", "not a JSON object"),
        (b'[{"Records": []}]', "not a JSON object"),
        (b'"s3:ObjectCreated:Put"', "not a JSON object"),
        (b"null", "not a JSON object"),
        (b'{"EventName": "s3:ObjectCreated:Put", "Key": "videos/a.mp4"}', "no Records"),
        (b'{"Records": []}', "no Records"),
        (b'{"Records": {"eventName": "s3:ObjectCreated:Put"}}', "no Records"),
        (b'{"Records": ["s3:ObjectCreated:Put"]}', "not a JSON object"),
        (json.dumps({"Records": [{"s3": {}}]}).encode(), "no eventName"),
        (minio_body(_without(minio_record("s3:ObjectCreated:Put", "a.mp4"), "s3")), "lacks"),
        (minio_body(_without(minio_record("s3:ObjectCreated:Put", "a.mp4"), "s3", "bucket")), "lacks"),
        (minio_body(_without(minio_record("s3:ObjectCreated:Put", "a.mp4"), "s3", "object", "key")), "lacks"),
        (minio_body(minio_record("s3:ObjectCreated:Put", "")), "empty bucket or key"),
        (minio_body(minio_record("s3:ObjectCreated:Put", "a.mp4", bucket="")), "empty bucket or key"),
    ],
)
def test_bodies_that_are_not_minio_events_raise_with_the_raw_body(body: bytes, message: str) -> None:
    with pytest.raises(EventDecodeError, match=message) as info:
        decode_message(body)

    assert info.value.raw == body
    assert isinstance(info.value, PermanentError)


def test_not_json_keeps_the_cause() -> None:
    with pytest.raises(EventDecodeError) as info:
        decode_message(b"{oops")

    assert isinstance(info.value.__cause__, json.JSONDecodeError)


def _with(record: dict[str, Any], value: Any, *path: str) -> dict[str, Any]:
    node = record
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return record


def _put(value: Any, *path: str) -> bytes:
    return json.dumps({"Records": [_with(minio_record("s3:ObjectCreated:Put", "a.mp4"), value, *path)]}).encode()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_put(5, "s3", "object", "key"), "s3.object.key is int"),
        (_put(["a.mp4"], "s3", "object", "key"), "s3.object.key is list"),
        (_put(None, "s3", "object", "key"), "empty bucket or key"),
        (_put(7, "s3", "bucket", "name"), "s3.bucket.name is int"),
        (_put(None, "s3", "bucket", "name"), "empty bucket or key"),
        (_put("a.mp4", "s3", "object"), "lacks"),
        (_put(5, "s3", "object", "versionId"), "versionId is int"),
        (_put(5, "s3", "object", "eTag"), "eTag is int"),
        (_put({"md5": "x"}, "s3", "object", "eTag"), "eTag is dict"),
        (_put(5, "s3", "object", "contentType"), "contentType is int"),
        (_put(7, "s3", "object", "sequencer"), "sequencer is int"),
        (_put(1.5, "eventTime"), "eventTime is float"),
        (_put("12", "s3", "object", "size"), "size is '12'"),
        (_put(12.0, "s3", "object", "size"), "size is 12.0"),
        (_put(True, "s3", "object", "size"), "size is True"),
        (_put(-1, "s3", "object", "size"), "size is -1"),
    ],
)
def test_fields_of_the_wrong_type_raise_with_the_raw_body(body: bytes, message: str) -> None:
    with pytest.raises(EventDecodeError, match=message) as info:
        decode_message(body)

    assert info.value.raw == body


def test_null_and_empty_optional_fields_are_none() -> None:
    record = minio_record("s3:ObjectRemoved:Delete", "a.mp4", size=None, etag=None, content_type=None)
    obj = record["s3"]["object"]
    obj.update(size=None, eTag="", versionId=None, contentType=None, sequencer="")
    record["eventTime"] = None

    event = decode_one(minio_body(record))

    assert (event.size, event.etag, event.version_id, event.content_type, event.sequencer, event.event_time) == (
        None,
        None,
        None,
        None,
        None,
        None,
    )

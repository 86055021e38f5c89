"""Wiring between the bucket and the broker: MinIO's AMQP target settings, the bucket subscription,
and the durable queue that must exist and be bound before the first upload.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from minio import Minio
from minio.error import S3Error
from minio.notificationconfig import NotificationConfig, QueueConfig

from events.config import AmqpSettings

log = logging.getLogger(__name__)

#: The notification rules vidx owns on each watched bucket (the durable target's, then ``-2``, ... for
#: further targets: ``dual``'s fast one); other rules are left alone.
CONFIG_ID = "vidx-ingest"
SUBSCRIBED_EVENTS = ["s3:ObjectCreated:*", "s3:ObjectRemoved:*"]
#: Longest wait for MinIO to know the AMQP target (each node of a distributed MinIO brings its own online).
TARGET_WAIT_S = 60.0
TARGET_POLL_S = 1.0


def minio_notify_env(amqp: AmqpSettings, broker_url: str, queue_dir: Path | str) -> dict[str, str]:
    """Environment for a MinIO server that publishes bucket events durably to RabbitMQ: the durable
    target (its on-disk store in ``queue_dir``) and, with ``event_delivery`` ``dual``, the fast target
    beside it (same exchange, no store).

    ``broker_url`` is the AMQP URL *as MinIO sees it* (it may differ from ``amqp.url`` when MinIO
    runs in a container). Every boolean is the literal ``on``: MinIO reads ``true`` as off.
    """
    env = _target_env(amqp.minio_target_id, amqp, broker_url)
    env[f"MINIO_NOTIFY_AMQP_QUEUE_DIR_{amqp.minio_target_id}"] = str(queue_dir)
    env[f"MINIO_NOTIFY_AMQP_QUEUE_LIMIT_{amqp.minio_target_id}"] = str(amqp.minio_queue_limit)
    if amqp.event_delivery == "dual":
        env |= _target_env(amqp.minio_fast_target_id, amqp, broker_url)
    return env


def _target_env(target: str, amqp: AmqpSettings, broker_url: str) -> dict[str, str]:
    return {
        f"MINIO_NOTIFY_AMQP_ENABLE_{target}": "on",
        f"MINIO_NOTIFY_AMQP_URL_{target}": broker_url,
        f"MINIO_NOTIFY_AMQP_EXCHANGE_{target}": amqp.exchange,
        f"MINIO_NOTIFY_AMQP_EXCHANGE_TYPE_{target}": "direct",
        f"MINIO_NOTIFY_AMQP_ROUTING_KEY_{target}": amqp.routing_key,
        f"MINIO_NOTIFY_AMQP_DURABLE_{target}": "on",
        f"MINIO_NOTIFY_AMQP_DELIVERY_MODE_{target}": "2",
        f"MINIO_NOTIFY_AMQP_PUBLISHING_CONFIRMS_{target}": "on",
    }


def declare_event_topology(channel: Any, amqp: AmqpSettings) -> None:
    """Declare (idempotently) the durable exchange MinIO publishes to, the durable event queue bound
    to it, and the parked queue for records that can't be decoded (both of ``amqp.queue_type``)."""
    channel.exchange_declare(exchange=amqp.exchange, exchange_type="direct", durable=True)
    channel.queue_declare(queue=amqp.events_queue, durable=True, arguments=amqp.queue_arguments)
    channel.queue_bind(queue=amqp.events_queue, exchange=amqp.exchange, routing_key=amqp.routing_key)
    channel.queue_declare(queue=amqp.parked_queue, durable=True, arguments=amqp.queue_arguments)


def _target_not_online(exc: S3Error) -> bool:
    """MinIO's answer while the AMQP target is not (yet) online on the node the request reached."""
    return exc.code == "InvalidArgument" and "ARN" in (exc.message or "")


def _config_id(i: int) -> str:
    return CONFIG_ID if i == 0 else f"{CONFIG_ID}-{i + 1}"


def _ours(config_id: str | None) -> bool:
    return config_id == CONFIG_ID or (config_id or "").startswith(f"{CONFIG_ID}-")


def subscribe_bucket(
    client: Minio,
    bucket: str,
    queue_arns: str | Sequence[str],
    target_wait_s: float = TARGET_WAIT_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Make ``bucket`` send created/removed events to each of ``queue_arns`` (one rule each), keeping
    every other rule.

    Returns whether the configuration changed. Idempotent. A distributed MinIO just started may refuse
    the rules while a target is not yet online on the node the request reaches: asked again once a
    second, for at most ``target_wait_s``. A MinIO that still knows none but the first (durable) target
    then (one set up before ``dual`` delivery) is subscribed to that one alone, with a warning: events
    wait for its store's tick, nothing is lost.

    Raises:
        S3Error: the rule refused for another reason, or the durable target still unknown after the wait.
    """
    arns = [queue_arns] if isinstance(queue_arns, str) else list(queue_arns)
    deadline = clock() + target_wait_s
    while True:
        try:
            return _subscribe_once(client, bucket, arns)
        except S3Error as exc:
            if not _target_not_online(exc):
                raise
            if clock() + TARGET_POLL_S > deadline:
                if len(arns) == 1:
                    raise
                log.warning(
                    "bucket %s: MinIO does not know %s; subscribing %s alone (events wait for its store's "
                    "3 s tick). Add the target (docs/operations.md) or set VIDX_AMQP__EVENT_DELIVERY=queue_dir",
                    bucket,
                    " / ".join(arns[1:]),
                    arns[0],
                )
                arns = arns[:1]
                continue
            log.warning("bucket %s: MinIO does not know %s yet, asking again", bucket, " / ".join(arns))
            sleep(TARGET_POLL_S)


def _subscribe_once(client: Minio, bucket: str, arns: list[str]) -> bool:
    current = client.get_bucket_notification(bucket)
    others = [q for q in current.queue_config_list if not _ours(q.config_id)]
    have = {(q.config_id, q.queue, tuple(sorted(q.events))) for q in current.queue_config_list if _ours(q.config_id)}
    want = {(_config_id(i), arn, tuple(sorted(SUBSCRIBED_EVENTS))) for i, arn in enumerate(arns)}
    if have == want:
        return False
    events = list(SUBSCRIBED_EVENTS)
    rules = [QueueConfig(queue=arn, events=events, config_id=_config_id(i)) for i, arn in enumerate(arns)]
    config = NotificationConfig(
        cloud_func_config_list=current.cloud_func_config_list,
        queue_config_list=[*others, *rules],
        topic_config_list=current.topic_config_list,
    )
    client.set_bucket_notification(bucket, config)
    log.info("subscribed bucket %s to %s", bucket, " and ".join(arns))
    return True


def prepare_buckets(client: Minio, buckets: list[str], index_bucket: str, queue_arns: str | Sequence[str]) -> None:
    """Create the watched buckets and the index bucket if missing, and subscribe each watched bucket.
    Declare the event queue (``declare_event_topology``) first, so no event is unroutable."""
    for bucket in [*buckets, index_bucket]:
        if not client.bucket_exists(bucket):
            client.make_bucket(bucket)
    for bucket in buckets:
        subscribe_bucket(client, bucket, queue_arns)

"""EventRouter: consume bucket events from RabbitMQ (pika, manual ack) and turn them into jobs.

A message is acknowledged only after every job it carries is confirmed on the task queue. Objects
that aren't videos are ignored and counted; a body that can't be decoded, or that routing fails on
unexpectedly, is parked with its raw bytes on a durable queue and acknowledged, so one bad record
never stalls or crashes the router.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions

from events.config import AmqpSettings, VideoFilterSettings
from events.jobs import IndexJob, JobOp, JobSink, JobSource
from events.records import BucketEvent, EventDecodeError, EventKind, decode_message
from events.subscribe import declare_event_topology
from storage.errors import TransientError

log = logging.getLogger(__name__)

#: Longest pause between reconnect attempts.
MAX_RECONNECT_DELAY_S = 30.0


def is_video(event: BucketEvent, videos: VideoFilterSettings) -> bool:
    suffix = posixpath.splitext(event.key)[1].lower()
    if suffix in {e.lower() for e in videos.extensions}:
        return True
    content_type = (event.content_type or "").lower()
    return any(content_type.startswith(p) for p in videos.content_type_prefixes)


def job_for(event: BucketEvent) -> IndexJob:
    return IndexJob(
        op=JobOp.INDEX if event.kind is EventKind.CREATED else JobOp.DELETE,
        bucket=event.bucket,
        key=event.key,
        source=JobSource.EVENT,
        hint_version=event.version_id or event.etag,
        sequencer=event.sequencer,
    )


def _describe(exc: BaseException) -> str:
    """Why the connection went, for the log: the broker's reply when it closed us, else the type.

    Never ``str(exc)`` of arbitrary pika errors: connection errors may carry the connection parameters.
    """
    if isinstance(exc, pika.exceptions.ChannelClosedByBroker | pika.exceptions.ConnectionClosedByBroker):
        return f"{type(exc).__name__} {exc.reply_code}: {exc.reply_text}"
    return type(exc).__name__


@dataclass(frozen=True, slots=True)
class Routed:
    submitted: int = 0
    ignored: int = 0


class EventRouter:
    """Turns bucket-event messages into index/delete jobs. ``handle`` is the pure part; ``run`` the
    pika consumer loop around it."""

    def __init__(
        self,
        amqp: AmqpSettings,
        videos: VideoFilterSettings,
        sink: JobSink,
        buckets: list[str],
    ) -> None:
        self._amqp = amqp
        self._videos = videos
        self._sink = sink
        self._buckets = set(buckets)
        self.stats: Counter[str] = Counter()
        self._connected = threading.Event()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def handle(self, body: bytes) -> Routed:
        """Route one message body.

        Raises:
            EventDecodeError: the body is not a MinIO event (the caller parks it).
            TransientError: the task queue didn't take a job (the caller requeues the message).
        """
        submitted = ignored = 0
        for event in decode_message(body):
            if event.bucket not in self._buckets:
                ignored += 1
                self.stats["ignored_foreign_bucket"] += 1
                continue
            if event.kind is EventKind.CREATED and not is_video(event, self._videos):
                ignored += 1
                self.stats["ignored_not_video"] += 1
                log.debug("ignored %s: not a video by extension or content type", event.uri)
                continue
            job = job_for(event)
            self._sink.submit(job)
            submitted += 1
            self.stats[f"jobs_{job.op.value}"] += 1
        self.stats["messages"] += 1
        return Routed(submitted=submitted, ignored=ignored)

    def _on_message(self, channel: Any, method: Any, body: bytes) -> None:
        try:
            self.handle(body)
        except EventDecodeError as exc:
            log.warning("parked an undecodable event (%s); raw body kept on %s", exc, self._amqp.parked_queue)
            self._park(channel, method, exc.raw, str(exc))
            return
        except TransientError as exc:
            self.stats["requeued"] += 1
            log.warning("task queue refused a job (%s); message requeued", exc)
            channel.basic_nack(method.delivery_tag, requeue=True)
            time.sleep(self._amqp.reconnect_delay_s)
            return
        except Exception as exc:
            # A bug must never stall the queue: park the body like an undecodable one. Jobs this
            # message submitted before the failure stay submitted; they are idempotent hints.
            reason = f"unexpected {type(exc).__name__}: {exc}"[:500]
            log.exception("parked an event the router failed on; raw body kept on %s", self._amqp.parked_queue)
            self._park(channel, method, body, reason)
            return
        channel.basic_ack(method.delivery_tag)

    def _park(self, channel: Any, method: Any, body: bytes, reason: str) -> None:
        """Publish ``body`` to the parked queue, with why in ``x-vidx-reason``, then ack the message."""
        self.stats["parked"] += 1
        channel.basic_publish(
            exchange="",
            routing_key=self._amqp.parked_queue,
            body=body,
            properties=pika.BasicProperties(delivery_mode=2, headers={"x-vidx-reason": reason[:500]}),
        )
        channel.basic_ack(method.delivery_tag)

    def run(self, stop: threading.Event) -> None:
        """Consume until ``stop`` is set, reconnecting with capped backoff when the broker goes away."""
        delay_s = self._amqp.reconnect_delay_s
        params = pika.URLParameters(self._amqp.url.get_secret_value())
        params.heartbeat = self._amqp.heartbeat_s
        params.blocked_connection_timeout = self._amqp.blocked_connection_timeout_s
        while not stop.is_set():
            connection = None
            try:
                connection = pika.BlockingConnection(params)
                channel = connection.channel()
                channel.confirm_delivery()
                declare_event_topology(channel, self._amqp)
                channel.basic_qos(prefetch_count=self._amqp.prefetch)
                self._connected.set()
                delay_s = self._amqp.reconnect_delay_s
                log.info("event router consuming %s", self._amqp.events_queue)
                for method, _props, body in channel.consume(self._amqp.events_queue, inactivity_timeout=0.5):
                    if stop.is_set():
                        break
                    if method is None:
                        continue
                    self._on_message(channel, method, body)
                channel.cancel()
            except (pika.exceptions.AMQPError, OSError) as exc:
                self.stats["reconnects"] += 1
                log.warning("event broker connection lost (%s); reconnecting in %.1fs", _describe(exc), delay_s)
            finally:
                self._connected.clear()
                if connection is not None and connection.is_open:
                    with contextlib.suppress(pika.exceptions.AMQPError, OSError):
                        connection.close()
            if not stop.is_set():
                stop.wait(delay_s)
                delay_s = min(delay_s * 2, MAX_RECONNECT_DELAY_S)

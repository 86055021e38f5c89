"""EventRouter: consume bucket events from RabbitMQ (pika, manual ack) and turn them into jobs.

A message is acknowledged only after every job it carries is confirmed on the task queue. Submits run
on a worker thread while the pika thread keeps servicing the connection (heartbeats included) and does
every ack and publish itself. A refused submit is tried again after a backoff, at most
``amqp.max_attempts`` times, then the message is parked; so are bodies that can't be decoded or that
routing fails on unexpectedly. Messages are known by their body's digest across reconnects, so a
redelivery of one whose submit is running, or whose ack was lost, is not submitted again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import hashlib
import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.exceptions

from events.config import AmqpSettings, VideoFilterSettings
from events.jobs import IndexJob, JobSink, job_for
from events.parked import MAX_REASON_CHARS, park
from events.records import BucketEvent, EventDecodeError, EventKind, decode_message
from events.settled import Seen, SettledMemory
from events.subscribe import declare_event_topology
from storage.errors import TransientError

log = logging.getLogger(__name__)

#: Longest pause between reconnect attempts.
MAX_RECONNECT_DELAY_S = 30.0
#: How the router's connection shows in the broker's UI.
CONNECTION_NAME = "vidx-event-router"


def is_video(event: BucketEvent, videos: VideoFilterSettings) -> bool:
    return videos.matches(event.key, event.content_type)


def describe(exc: BaseException) -> str:
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


@dataclass(frozen=True, slots=True)
class Planned:
    """The jobs one message carries; ``ignored`` counts the records that need none."""

    jobs: tuple[IndexJob, ...]
    ignored: int


class _State(enum.Enum):
    RUNNING = "running"  # a worker is submitting its jobs
    WAITING = "waiting"  # refused; tried again at retry_at
    DONE = "done"  # the worker is done; the outcome waits for a delivery to settle


@dataclass(eq=False)
class _Message:
    """One message body, across its deliveries (a reconnect redelivers it) and its tries. Fields the
    worker writes (``planned``, ``submitted``) are read on the pika thread only once it is done."""

    digest: str
    body: bytes
    state: _State = _State.RUNNING
    planned: Planned | None = None
    #: Jobs confirmed so far: a retry resumes after them.
    submitted: int = 0
    #: Times a worker took it up (the first try and each retry).
    tries: int = 0
    #: When the last try was refused (the worker's clock), and when the next one is due.
    refused_at: float = 0.0
    retry_at: float = 0.0
    #: Why it is to be parked; None: its jobs are all submitted.
    park_reason: str | None = None
    #: Delivery tags of the current channel waiting for this outcome.
    tags: list[int] = field(default_factory=list)


class EventRouter:
    """Turns bucket-event messages into index/delete jobs. ``handle`` is the pure part; ``run`` the
    pika consumer loop around it, with ``on_delivery`` and ``settle`` its steps on the pika thread."""

    def __init__(
        self,
        amqp: AmqpSettings,
        videos: VideoFilterSettings,
        sink: JobSink,
        buckets: list[str],
        executor: concurrent.futures.Executor | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_count: Callable[[str, int], None] | None = None,
    ) -> None:
        """``executor`` runs the submits (default: one worker thread per ``run``); ``on_count(kind, n)``
        sees every count as it is made (the app's metrics)."""
        self._amqp = amqp
        self._videos = videos
        self._sink = sink
        self._buckets = set(buckets)
        self._executor = executor
        self._clock = clock
        self._on_count = on_count
        self._stats: Counter[str] = Counter()
        self._stats_lock = threading.Lock()
        self._connected = threading.Event()
        # Pika thread only, but for the worker's hand-offs through ``_finished``. Messages not yet
        # acked, by body digest, and the digests of the last ones acked, with when their jobs were all
        # submitted (None: parked).
        self._active: OrderedDict[str, _Message] = OrderedDict()
        self._settled = SettledMemory(amqp.redelivery_memory, amqp.copy_window_s, clock)
        self._finished: queue.SimpleQueue[tuple[_Message, TransientError | None]] = queue.SimpleQueue()
        self._connection: pika.BlockingConnection | None = None
        self._channel: Any = None

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def stats(self) -> Counter[str]:
        """A copy of the counters (they change on two threads)."""
        with self._stats_lock:
            return self._stats.copy()

    def _count(self, kind: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[kind] += n
        if self._on_count is not None:
            self._on_count(kind, n)

    # -- routing (any thread) ------------------------------------------------------------------------

    def plan(self, body: bytes) -> Planned:
        """The jobs a message body carries: foreign buckets and created non-videos are counted, not kept.

        Raises:
            EventDecodeError: the body is not a MinIO event (the caller parks it).
        """
        jobs: list[IndexJob] = []
        ignored = 0
        for event in decode_message(body):
            if event.bucket not in self._buckets:
                ignored += 1
                self._count("ignored_foreign_bucket")
                continue
            if event.kind is EventKind.CREATED and not is_video(event, self._videos):
                ignored += 1
                self._count("ignored_not_video")
                log.debug("ignored %s: not a video by extension or content type", event.uri)
                continue
            jobs.append(job_for(event))
        return Planned(tuple(jobs), ignored)

    def _submit(self, job: IndexJob) -> None:
        self._sink.submit(job)
        self._count(f"jobs_{job.op.value}")

    def handle(self, body: bytes) -> Routed:
        """Route one message body.

        Raises:
            EventDecodeError: the body is not a MinIO event (the caller parks it).
            TransientError: the task queue didn't take a job (the caller tries the message again).
        """
        planned = self.plan(body)
        for job in planned.jobs:
            self._submit(job)
        return Routed(submitted=len(planned.jobs), ignored=planned.ignored)

    # -- the worker ----------------------------------------------------------------------------------

    def _work(self, message: _Message) -> None:
        """Submit what is left of ``message``'s jobs, then hand it back to the pika thread."""
        refused: TransientError | None = None
        try:
            if message.planned is None:
                message.planned = self.plan(message.body)
            while message.submitted < len(message.planned.jobs):
                self._submit(message.planned.jobs[message.submitted])
                message.submitted += 1
        except EventDecodeError as exc:
            message.park_reason = str(exc)
        except TransientError as exc:
            message.refused_at = self._clock()
            refused = exc
        except Exception as exc:
            # A bug must never stall the queue: park the body like an undecodable one. Jobs this
            # message submitted before the failure stay submitted; they are idempotent hints.
            log.exception("routing failed on a message; parking it")
            message.park_reason = f"unexpected {type(exc).__name__}: {exc}"
        self._finished.put((message, refused))
        connection = self._connection
        if connection is not None:
            # Wake the pika thread; if the connection went meanwhile, the next one settles it.
            with contextlib.suppress(pika.exceptions.AMQPError):
                connection.add_callback_threadsafe(self._settle_current)

    def _start(self, message: _Message) -> None:
        assert self._executor is not None, "the router's executor runs only inside run()"
        message.state = _State.RUNNING
        message.tries += 1
        self._executor.submit(self._work, message)

    # -- the pika thread -----------------------------------------------------------------------------

    def on_delivery(self, channel: Any, method: Any, _properties: Any, body: bytes) -> None:
        """Take a delivery: start its jobs, or attach it to the same body already known (a redelivery
        after a reconnect). ``settle`` acks it, but a redelivery of a message already settled, which
        is acked here without a second submit."""
        digest = hashlib.sha256(body).hexdigest()
        message = self._active.get(digest)
        if message is not None:
            # In progress under an earlier delivery: this one waits for the same outcome. Not a
            # redelivery: the other copy of one event (MinIO's dual delivery) came meanwhile.
            self._count("redelivered_in_progress" if method.redelivered else "copies")
            message.tags.append(method.delivery_tag)
            return
        seen = self._settled.seen(digest)
        if seen is not Seen.NEW and method.redelivered:
            # Settled, but the ack went down with the old connection: its jobs are all submitted.
            self._count("redelivered_settled")
            channel.basic_ack(method.delivery_tag)
            return
        if seen is Seen.COPY:
            # The other copy of one event (MinIO's dual delivery): its jobs were submitted moments ago.
            self._count("copies")
            channel.basic_ack(method.delivery_tag)
            return
        if seen is Seen.SETTLED:
            self._settled.forget(digest)  # the same body published anew (a replay): route it again
        message = _Message(digest, body)
        message.tags.append(method.delivery_tag)
        self._active[digest] = message
        self._start(message)
        self._forget()

    def settle(self, channel: Any, start_retries: bool = True) -> None:
        """Ack (or park, then ack) what the workers finished, and start the retries that are due.
        Pika thread only.

        Raises:
            pika.exceptions.AMQPError: the channel is gone (what was not acked is redelivered).
        """
        while True:
            try:
                message, refused = self._finished.get_nowait()
            except queue.Empty:
                break
            if self._active.get(message.digest) is not message:
                continue  # finished after its run() ended: the broker redelivers it to a fresh start
            if refused is None:
                message.state = _State.DONE
            else:
                self._refused(message, refused)
        now = self._clock()
        for message in list(self._active.values()):
            if message.state is _State.DONE and message.tags:
                self._finish(channel, message)
            elif start_retries and message.state is _State.WAITING and message.tags and message.retry_at <= now:
                self._start(message)

    def _settle_current(self) -> None:
        if self._channel is not None:
            self.settle(self._channel)

    def _refused(self, message: _Message, exc: TransientError) -> None:
        if message.tries >= self._amqp.max_attempts:
            message.park_reason = f"gave up after {message.tries} attempts: {exc}"
            message.state = _State.DONE
            return
        delay_s = min(self._amqp.retry_delay_s * 2 ** (message.tries - 1), self._amqp.max_retry_delay_s)
        message.retry_at = message.refused_at + delay_s
        message.state = _State.WAITING
        self._count("retried")
        log.warning("task queue refused a job (%s); trying the message again in %.1fs", exc, delay_s)

    def _finish(self, channel: Any, message: _Message) -> None:
        """Park ``message`` if it is to be parked (confirmed before any ack), then ack its deliveries."""
        if message.park_reason is not None:
            park(channel, self._amqp.parked_queue, message.body, message.park_reason, message.tries)
            self._count("parked")
            log.warning("parked a message on %s: %s", self._amqp.parked_queue, message.park_reason[:MAX_REASON_CHARS])
        else:
            self._count("messages")
        for tag in message.tags:
            channel.basic_ack(tag)
        message.tags.clear()
        del self._active[message.digest]
        self._settled.settled(message.digest, routed=message.park_reason is None)
        self._forget()

    def detach(self) -> None:
        """The connection is gone: its delivery tags mean nothing now. Messages keep their progress
        (and a running submit goes on) until the broker redelivers them."""
        self._channel = None
        for message in self._active.values():
            message.tags.clear()

    def _forget(self) -> None:
        """Messages waiting for a redelivery that may never come (another consumer took it) go once
        they are as many as ``redelivery_memory``."""
        limit = self._amqp.redelivery_memory
        if len(self._active) > limit:
            for digest, message in list(self._active.items())[: len(self._active) - limit]:
                if message.state is not _State.RUNNING and not message.tags:
                    del self._active[digest]

    def _in_progress(self) -> bool:
        return any(m.state is _State.RUNNING or (m.state is _State.DONE and m.tags) for m in self._active.values())

    def _consume(self, connection: pika.BlockingConnection, stop: threading.Event) -> None:
        channel = connection.channel()
        channel.confirm_delivery()
        declare_event_topology(channel, self._amqp)
        channel.basic_qos(prefetch_count=self._amqp.prefetch)
        consumer_tag = channel.basic_consume(self._amqp.events_queue, on_message_callback=self.on_delivery)
        self._connection, self._channel = connection, channel
        self._connected.set()
        log.info("event router consuming %s", self._amqp.events_queue)
        while not stop.is_set():
            now = self._clock()
            due = [m.retry_at - now for m in self._active.values() if m.state is _State.WAITING and m.tags]
            connection.process_data_events(time_limit=max(0.0, min([self._amqp.poll_s, *due])))
            self.settle(channel)
        # Stopping: take no more, and let the submits in progress finish and be acked (bounded).
        channel.basic_cancel(consumer_tag)
        deadline = self._clock() + self._amqp.drain_timeout_s
        while self._in_progress() and self._clock() < deadline:
            connection.process_data_events(time_limit=self._amqp.poll_s)
            self.settle(channel, start_retries=False)

    def run(self, stop: threading.Event) -> None:
        """Consume until ``stop`` is set, reconnecting with capped backoff when the broker goes away."""
        delay_s = self._amqp.reconnect_delay_s
        params = pika.URLParameters(self._amqp.url.get_secret_value())
        params.heartbeat = self._amqp.heartbeat_s
        params.blocked_connection_timeout = self._amqp.blocked_connection_timeout_s
        params.client_properties = {"connection_name": CONNECTION_NAME}
        owned = self._executor is None
        if owned:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-submit")
        try:
            while not stop.is_set():
                connection = None
                try:
                    connection = pika.BlockingConnection(params)
                    self._consume(connection, stop)
                except (pika.exceptions.AMQPError, OSError) as exc:
                    if self._connected.is_set():
                        delay_s = self._amqp.reconnect_delay_s
                    self._count("reconnects")
                    log.warning("event broker connection lost (%s); reconnecting in %.1fs", describe(exc), delay_s)
                finally:
                    self._connected.clear()
                    self._connection = None
                    self.detach()
                    if connection is not None and connection.is_open:
                        with contextlib.suppress(pika.exceptions.AMQPError, OSError):
                            connection.close()
                if not stop.is_set():
                    stop.wait(delay_s)
                    delay_s = min(delay_s * 2, MAX_RECONNECT_DELAY_S)
        finally:
            # Whatever is not acked goes back to the queue with the connection; a later run starts afresh.
            self._active.clear()
            if owned and self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None

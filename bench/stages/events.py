"""``python -m bench.stages.events [--uploads N]``: bucket-event delivery per MinIO delivery mode — latency,
and what becomes of an event uploaded while RabbitMQ is down.

Each mode gets a fresh RabbitMQ + MinIO pair (``infra.harness.services.start_services``). N small objects
are uploaded one at a time, a random pause between them (so uploads land at every phase of MinIO's
replay tick); the figure is the time from the PUT's answer to the event's delivery to a consumer of
the bucket-event queue — the hop the EventRouter sees, measured without the app so that no router or
pipeline work is in it. Then the outage: RabbitMQ's app is stopped (the container and its address
stay), objects are uploaded, the broker is started again, and the run waits for their events.
docs/design/events.md reads the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from bench.common import percentile, save_section

#: name -> (MINIO_API_SYNC_EVENTS on, queue_dir set, a second target without queue_dir)
MODES: dict[str, tuple[bool, bool, bool]] = {
    "queue_dir": (False, True, False),
    "sync": (True, False, False),
    "sync_queue_dir": (True, True, False),
    "async": (False, False, False),
    "dual": (False, True, True),
}
DEFAULT_UPLOADS, FULL_UPLOADS = 30, 100
#: Longest wait for one event once its PUT answered (MinIO's replay tick is 3 s).
DELIVERY_TIMEOUT_S = 15.0
#: Pause between uploads: uniform in [0, this). Uploads don't wait for their events, so they land
#: at every phase of the replay tick.
MAX_PAUSE_S = 0.7
OUTAGE_UPLOADS = 3
#: Seconds the broker stays down after the outage's uploads, and the longest wait for their events after.
OUTAGE_DOWN_S = 3.0
OUTAGE_WAIT_S = 20.0
BROKER_BACK_TIMEOUT_S = 120.0
PAYLOAD = b"x" * 1024


@dataclass
class EventTap:
    """Consumes the bucket-event queue on a thread (reconnecting through outages) and records when
    each object's first event arrived (monotonic seconds), keyed by ``bucket/key``."""

    amqp_url: str
    queue_name: str
    arrived: dict[str, float] = field(default_factory=dict)
    #: Body digests of every delivery, by key (a key with two is a duplicate).
    bodies: dict[str, list[str]] = field(default_factory=dict)
    _news: queue.SimpleQueue[str] = field(default_factory=queue.SimpleQueue)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> EventTap:
        self._thread = threading.Thread(target=self._run, name="event-tap", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        import pika
        import pika.exceptions

        while not self._stop.is_set():
            try:
                connection = pika.BlockingConnection(pika.URLParameters(self.amqp_url))
            except pika.exceptions.AMQPError:
                time.sleep(0.1)
                continue
            try:
                channel = connection.channel()
                for _method, _props, body in channel.consume(self.queue_name, auto_ack=True, inactivity_timeout=0.1):
                    if self._stop.is_set():
                        break
                    if body is None:
                        continue
                    now = time.monotonic()
                    key = str(json.loads(body).get("Key", ""))
                    self.bodies.setdefault(key, []).append(hashlib.sha256(body).hexdigest()[:16])
                    if key not in self.arrived:
                        self.arrived[key] = now
                        self._news.put(key)
                connection.close()
            except pika.exceptions.AMQPError:
                time.sleep(0.1)  # the broker went away: connect again

    def wait_for(self, key: str, timeout_s: float) -> float | None:
        """Arrival time of ``key``'s event, or None if it did not come within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while key not in self.arrived:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            with contextlib.suppress(queue.Empty):
                self._news.get(timeout=min(left, 0.5))
        return self.arrived[key]


def _put(client: Any, bucket: str, key: str) -> tuple[float, float, str | None]:
    """(start, end, error) of one PUT; error is None when MinIO answered 200."""
    started = time.monotonic()
    try:
        client.put_object(bucket, key, io.BytesIO(PAYLOAD), len(PAYLOAD), content_type="application/octet-stream")
    except Exception as exc:  # minio raises S3Error, urllib3 errors...: all mean "the upload failed"
        return started, time.monotonic(), type(exc).__name__
    return started, time.monotonic(), None


def _broker_back(services: Any) -> None:
    import pika
    import pika.exceptions

    deadline = time.monotonic() + BROKER_BACK_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            pika.BlockingConnection(pika.URLParameters(services.amqp_url)).close()
            return
        except pika.exceptions.AMQPError:
            time.sleep(0.2)
    raise RuntimeError(f"RabbitMQ did not come back within {BROKER_BACK_TIMEOUT_S:.0f}s")


def measure_mode(name: str, sync_events: bool, queue_dir: bool, dual: bool, uploads: int, seed: int) -> dict[str, Any]:
    from events.config import EventDelivery
    from infra.harness.services import start_services, unique_prefix

    rng = random.Random(seed)
    out: dict[str, Any] = {}
    delivery: EventDelivery = "dual" if dual else "queue_dir"
    with start_services(sync_events=sync_events, queue_dir=queue_dir, event_delivery=delivery) as services:
        prefix = unique_prefix()
        services.prepare_buckets(prefix)
        bucket = f"{prefix}-videos"
        client = services.minio_client()
        tap = EventTap(services.amqp_url, f"{prefix}.bucket-events").start()
        try:
            # Warm-up: MinIO's first publish opens its connection.
            _put(client, bucket, "warm/w.bin")
            if tap.wait_for(f"{bucket}/warm/w.bin", DELIVERY_TIMEOUT_S) is None:
                raise RuntimeError(f"{name}: the warm-up event never arrived")
            puts: dict[str, tuple[float, float]] = {}
            for i in range(uploads):
                time.sleep(rng.uniform(0, MAX_PAUSE_S))
                key = f"{bucket}/lat/{i:04d}.bin"
                started, ended, error = _put(client, bucket, key.partition("/")[2])
                if error is not None:
                    raise RuntimeError(f"{name}: PUT {key} failed with the broker up: {error}")
                puts[key] = (started, ended)
            after_put, after_start, put_ms = [], [], []
            missing = 0
            for key, (started, ended) in puts.items():
                put_ms.append(1000 * (ended - started))
                arrived = tap.wait_for(key, max(0.1, ended + DELIVERY_TIMEOUT_S - time.monotonic()))
                if arrived is None:
                    missing += 1
                    continue
                after_put.append(1000 * (arrived - ended))
                after_start.append(1000 * (arrived - started))
            time.sleep(4.0 if dual else 0.0)  # the store's copies, one replay tick later
            copies = [len(tap.bodies.get(k, [])) for k in puts]
            identical = sum(1 for k in puts if len(set(tap.bodies.get(k, []))) == 1)
            out |= {
                f"{name}_delivery_ms_p50": round(percentile(after_put, 50), 1),
                f"{name}_delivery_ms_p95": round(percentile(after_put, 95), 1),
                f"{name}_delivery_ms_max": round(max(after_put), 1) if after_put else float("nan"),
                f"{name}_delivery_from_put_start_ms_p50": round(percentile(after_start, 50), 1),
                f"{name}_put_ms_p50": round(percentile(put_ms, 50), 1),
                f"{name}_put_ms_p95": round(percentile(put_ms, 95), 1),
                f"{name}_uploads": uploads,
                f"{name}_missing": missing,
                f"{name}_deliveries_per_upload": round(sum(copies) / len(copies), 2),
                f"{name}_uploads_with_identical_copies": identical,
            }
            out |= _outage(name, services, client, bucket, tap)
        finally:
            tap.stop()
    return out


def _outage(name: str, services: Any, client: Any, bucket: str, tap: EventTap) -> dict[str, Any]:
    """Stop RabbitMQ's app, upload, start it again: which PUTs succeed and which events arrive."""
    result = services.rabbit.exec(["rabbitmqctl", "stop_app"])
    if result.exit_code != 0:
        raise RuntimeError(f"rabbitmqctl stop_app failed: {result.output[-500:]!r}")
    time.sleep(1.0)  # MinIO notices the closed connection
    keys, put_ms, errors = [], [], []
    for i in range(OUTAGE_UPLOADS):
        key = f"outage/{i}.bin"
        started, ended, error = _put(client, bucket, key)
        put_ms.append(1000 * (ended - started))
        if error is None:
            keys.append(key)
        else:
            errors.append(error)
    time.sleep(OUTAGE_DOWN_S)
    result = services.rabbit.exec(["rabbitmqctl", "start_app"])
    if result.exit_code != 0:
        raise RuntimeError(f"rabbitmqctl start_app failed: {result.output[-500:]!r}")
    _broker_back(services)
    back = time.monotonic()
    arrived = [tap.wait_for(f"{bucket}/{k}", max(0.1, back + OUTAGE_WAIT_S - time.monotonic())) for k in keys]
    got = [a for a in arrived if a is not None]
    return {
        f"{name}_outage_puts_ok": f"{len(keys)}/{OUTAGE_UPLOADS}",
        f"{name}_outage_put_errors": ",".join(sorted(set(errors))) or "none",
        f"{name}_outage_put_ms_max": round(max(put_ms), 1),
        f"{name}_outage_events_delivered": f"{len(got)}/{len(keys)}",
        f"{name}_outage_delivered_after_broker_back_s": round(max(got) - back, 2) if got else "none",
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stages.events", description=__doc__)
    parser.add_argument("--full", action="store_true", help=f"{FULL_UPLOADS} uploads per mode")
    parser.add_argument("--uploads", type=int, help=f"uploads per mode (default {DEFAULT_UPLOADS})")
    parser.add_argument("--modes", nargs="*", choices=list(MODES), help="only these modes")
    args = parser.parse_args()
    uploads = args.uploads or (FULL_UPLOADS if args.full else DEFAULT_UPLOADS)
    started = time.monotonic()
    metrics: dict[str, Any] = {}
    for i, name in enumerate(args.modes or MODES):
        sync_events, queue_dir, dual = MODES[name]
        print(f"mode {name}: sync_events={sync_events} queue_dir={queue_dir} dual={dual}", flush=True)
        metrics |= measure_mode(name, sync_events, queue_dir, dual, uploads, seed=i)
        print({k: v for k, v in metrics.items() if k.startswith(name + "_")}, flush=True)
    metrics["wall_s"] = round(time.monotonic() - started, 1)
    notes = [
        f"{uploads} uploads of 1 KiB per mode, one after another with a uniform 0-{MAX_PAUSE_S:g} s pause "
        "between (not waiting for the events, so they fall on every phase of the replay tick); "
        "delivery = PUT answered -> message delivered to a consumer of the bucket-event queue (a pika "
        "consumer in the bench process, as the EventRouter consumes it); each mode on a fresh RabbitMQ "
        "and MinIO container pair, publisher confirms and persistent messages on as in production.",
        "modes: queue_dir = MinIO saves each event in its queue_dir and a replay loop publishes the store "
        "every 3 s (the default before dual was wired); sync = MINIO_API_SYNC_EVENTS=on without queue_dir (the PUT "
        "answers after the publish); sync_queue_dir = both (the event is saved before the PUT answers, "
        "published on the tick); async = neither (published from memory right after the PUT); dual = "
        "queue_dir plus a second target (amqp.minio_fast_target_id) to the same exchange without one, the "
        "bucket subscribed to both (the default): each event is published at once and again from the store "
        "on the tick (deliveries_per_upload; the router drops the later copy: amqp.copy_window_s).",
        f"outage: rabbitmqctl stop_app, {OUTAGE_UPLOADS} uploads, {OUTAGE_DOWN_S:g} s, start_app; events "
        f"waited for up to {OUTAGE_WAIT_S:g} s after the broker takes connections again.",
    ]
    save_section("events", metrics, notes)
    for k, v in metrics.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()

"""pipeline/serve/autoscale.py: the IndexConsumer's queue-depth policy, with an injected clock and a fake
queue-depth source (no Ray cluster, no broker); the management API reader against a loopback server."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, ClassVar

import pytest
from pydantic import SecretStr

from events.config import AmqpSettings
from pipeline.serve.autoscale import (
    DECISION_FORMAT,
    BacklogPoller,
    ManagementQueueDepth,
    QueueDepthPolicy,
    QueueDepthUnavailable,
    ScaleBounds,
    ScaleDecider,
    consumer_policy,
    management_queue_depth,
    replica_options,
)
from pipeline.settings import AutoscaleSettings, ServeSettings, Settings


def bounds(up_s: float = 0.0, down_s: float = 10.0, lo: int = 1, hi: int = 4, target: int = 2) -> ScaleBounds:
    return ScaleBounds(lo, hi, target, up_s, down_s)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_backlog_asks_ceil_backlog_over_target_within_the_bounds() -> None:
    decider = ScaleDecider(bounds(target=2))
    assert [decider.wanted(n, 1, 4) for n in (0, 1, 2, 3, 4, 7, 8, 100)] == [1, 1, 1, 2, 2, 4, 4, 4]
    assert decider.wanted(-5, 1, 4) == 1


def test_a_backlog_scales_up_at_once_without_an_upscale_delay() -> None:
    decider = ScaleDecider(bounds(up_s=0))
    assert decider.decide(current=1, backlog=7, now=0.0) == 4


def test_an_upscale_waits_for_its_delay_and_a_dip_restarts_it() -> None:
    decider = ScaleDecider(bounds(up_s=2))
    assert decider.decide(1, 8, now=0.0) == 1
    assert decider.decide(1, 8, now=1.9) == 1
    assert decider.decide(1, 8, now=2.0) == 4
    decider = ScaleDecider(bounds(up_s=2))
    decider.decide(1, 8, now=0.0)
    assert decider.decide(1, 2, now=1.0) == 1  # the backlog fits again: the wait is over
    assert decider.decide(1, 8, now=2.5) == 1  # and starts anew
    assert decider.decide(1, 8, now=4.5) == 4


def test_a_downscale_waits_for_its_delay_and_keeps_the_most_wanted_meanwhile() -> None:
    decider = ScaleDecider(bounds(down_s=10))
    assert decider.decide(4, 0, now=0.0) == 4
    assert decider.decide(4, 5, now=5.0) == 4  # 3 wanted at 5 s
    assert decider.decide(4, 0, now=9.9) == 4
    assert decider.decide(4, 0, now=10.0) == 3  # not 1: a dip inside a burst releases little
    assert decider.decide(3, 0, now=10.1) == 3  # a new wait begins
    assert decider.decide(3, 0, now=20.1) == 1


def test_a_burst_during_the_downscale_wait_cancels_it() -> None:
    decider = ScaleDecider(bounds(down_s=10))
    decider.decide(4, 0, now=0.0)
    assert decider.decide(4, 8, now=5.0) == 4
    assert decider.decide(4, 0, now=10.0) == 4  # the wait restarted at 10 s
    assert decider.decide(4, 0, now=20.0) == 1


def test_a_downscale_waits_while_replicas_asked_for_are_still_starting() -> None:
    """Issue 19's long nemesis run: a burst drained before its replicas had started, and the downscale
    stopped them half-built. Now the downscale wait begins only once they run."""
    decider = ScaleDecider(ScaleBounds(1, 4, 2, 0, 10, starting_hold_s=60))
    assert decider.decide(1, 8, now=0.0, running=1) == 4
    assert decider.decide(4, 0, now=1.0, running=1) == 4  # drained; 3 replicas still starting
    assert decider.decide(4, 0, now=30.0, running=3) == 4  # past the downscale delay: still held
    assert decider.decide(4, 0, now=31.0, running=4) == 4  # all up: the wait begins here
    assert decider.decide(4, 0, now=40.9, running=4) == 4
    assert decider.decide(4, 0, now=41.0, running=4) == 1


def test_replicas_that_never_start_hold_the_downscale_for_at_most_the_hold() -> None:
    decider = ScaleDecider(ScaleBounds(1, 4, 2, 0, 10, starting_hold_s=60))
    assert decider.decide(4, 0, now=0.0, running=1) == 4
    assert decider.decide(4, 0, now=59.9, running=1) == 4
    assert decider.decide(4, 0, now=60.0, running=1) == 4  # the hold is over: the wait begins
    assert decider.decide(4, 0, now=70.0, running=1) == 1


def test_the_policy_reads_running_replicas_from_rays_context() -> None:
    clock, depth = Clock(), [9]
    b = ScaleBounds(1, 4, 2, 0, 10, starting_hold_s=60)
    policy = QueueDepthPolicy(lambda: depth[0], b, 1.0, clock=clock, metrics=Metrics(), start=run_now)
    policy(Ctx(1))
    assert policy(Ctx(1))[0] == 4
    depth[0] = 0
    for _ in range(30):  # 30 s drained, the new replicas not up yet
        clock.now += 1.0
        assert policy(Ctx(4, running=1))[0] == 4
    clock.now += 1.0
    assert policy(Ctx(4))[0] == 4  # up: the downscale wait begins
    clock.now += 10.0
    assert policy(Ctx(4))[0] == 1


def test_bounds_clamp_the_answer_and_narrower_capacity_bounds_apply() -> None:
    decider = ScaleDecider(bounds(lo=2, hi=3))
    assert decider.decide(2, 1000, now=0.0) == 3
    assert decider.decide(3, 0, now=1.0) == 3 and decider.decide(3, 0, now=11.0) == 2
    assert ScaleDecider(bounds()).decide(1, 1000, now=0.0, hi=2) == 2
    # A count outside the bounds (the settings changed) is brought back at once.
    assert ScaleDecider(bounds(hi=4)).decide(6, 1000, now=0.0) == 4


def test_scale_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        ScaleBounds(3, 2, 1, 0, 0)
    with pytest.raises(ValueError):
        ScaleBounds(1, 2, 0, 0, 0)


def run_now(target: Callable[[], None]) -> None:
    target()


def test_the_poller_reads_at_most_once_per_interval() -> None:
    clock, reads = Clock(), []

    def read() -> int:
        reads.append(clock.now)
        return len(reads)

    poller = BacklogPoller(read, interval_s=1.0, clock=clock, start=run_now)
    assert poller.backlog() is None  # the answer of a poll is seen on the next call
    assert poller.backlog() == 1
    clock.now += 0.5
    assert poller.backlog() == 1 and len(reads) == 1
    clock.now += 0.5
    poller.backlog()
    assert poller.backlog() == 2 and reads == [1000.0, 1001.0]


def test_one_poll_at_a_time_however_often_it_is_asked() -> None:
    clock, pending = Clock(), list[Callable[[], None]]()
    poller = BacklogPoller(lambda: 5, interval_s=1.0, clock=clock, start=pending.append)
    for _ in range(10):
        poller.backlog()
        clock.now += 2.0
    assert len(pending) == 1  # a slow poll is never stacked
    pending.pop()()
    assert poller.backlog() == 5 and len(pending) == 1


def test_broker_errors_keep_the_last_known_backlog(caplog: pytest.LogCaptureFixture) -> None:
    clock, answers = Clock(), [7]

    def read() -> int:
        if not answers:
            raise QueueDepthUnavailable("management API answered 503")
        return answers.pop()

    poller = BacklogPoller(read, interval_s=1.0, clock=clock, start=run_now)
    poller.backlog()
    assert poller.backlog() == 7
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        for _ in range(3):
            clock.now += 1.0
            assert poller.backlog() == 7
    assert sum("queue depth unavailable" in r.getMessage() for r in caplog.records) <= 1  # once per outage


class Ctx:
    """The parts of Ray's ``AutoscalingContext`` the policy reads."""

    def __init__(self, target: int, lo: int = 1, hi: int = 4, running: int | None = None) -> None:
        self.deployment_name = "IndexConsumer"
        self.target_num_replicas = target
        self.current_num_replicas = target if running is None else running  # Ray: running replicas
        self.capacity_adjusted_min_replicas = lo
        self.capacity_adjusted_max_replicas = hi


class Metrics:
    def __init__(self) -> None:
        self.observed: list[tuple[str, int, int | None]] = []
        self.decisions: list[tuple[str, str]] = []

    def observe(self, deployment: str, desired: int, backlog: int | None) -> None:
        self.observed.append((deployment, desired, backlog))

    def decided(self, deployment: str, direction: str) -> None:
        self.decisions.append((deployment, direction))


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def serve_log() -> Iterator[Lines]:
    """Lines of the ``ray.serve`` logger (it may not propagate to the root)."""
    logger, handler = logging.getLogger("ray.serve"), Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_the_policy_logs_and_counts_every_decision_and_only_decisions(serve_log: Lines) -> None:
    clock, depth, metrics = Clock(), [9], Metrics()
    policy = QueueDepthPolicy(
        lambda: depth[0], bounds(down_s=10), 1.0, clock=clock, wall_clock=lambda: 1234.5, metrics=metrics, start=run_now
    )
    assert policy(Ctx(1)) == (1, {"vidx_backlog": None})  # nothing known yet: hold
    desired, state = policy(Ctx(1))
    assert (desired, state) == (4, {"vidx_backlog": 9})
    assert policy(Ctx(4))[0] == 4  # Ray took the decision: no new line
    depth[0] = 0
    clock.now += 1.0
    policy(Ctx(4))  # polls the empty queue; the answer counts from the next tick
    clock.now += 1.0
    assert policy(Ctx(4))[0] == 4  # the downscale wait starts
    clock.now += 10.0
    assert policy(Ctx(4))[0] == 1
    decisions = [line for line in serve_log.lines if line.startswith("vidx autoscale: deployment=")]
    assert decisions == [
        DECISION_FORMAT % ("IndexConsumer", 1, 4, 9, 1234.5),
        DECISION_FORMAT % ("IndexConsumer", 4, 1, 0, 1234.5),
    ]
    assert decisions[0] == "vidx autoscale: deployment=IndexConsumer current=1 desired=4 backlog=9 at=1234.500"
    assert metrics.decisions == [("IndexConsumer", "up"), ("IndexConsumer", "down")]
    assert metrics.observed[-1] == ("IndexConsumer", 1, 0)


class Management(BaseHTTPRequestHandler):
    answers: ClassVar[dict[str, tuple[int, Any]]] = {}
    seen_auth: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        type(self).seen_auth.append(self.headers.get("Authorization"))
        status, body = type(self).answers.get(self.path, (404, {"error": "Object Not Found"}))
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture
def management() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), Management)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Management.answers, Management.seen_auth = {}, []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_reader_counts_ready_and_unacked_with_credentials_in_a_header(management: str) -> None:
    Management.answers["/api/queues/%2F/vidx.index"] = (200, {"messages": 12, "messages_ready": 8})
    reader = management_queue_depth("amqp://vidx:s3cret%21@127.0.0.1:5672/%2F", management, "vidx.index", 2.0)
    assert reader() == 12
    assert Management.seen_auth == ["Basic dmlkeDpzM2NyZXQh"]  # vidx:s3cret!
    assert "s3cret" not in repr(reader)


def test_reader_failures_name_no_credentials(management: str) -> None:
    Management.answers["/api/queues/%2F/q"] = (401, {"error": "not_authorised"})
    Management.answers["/api/queues/%2F/new"] = (200, {"name": "new"})  # no stats yet
    for queue, message in (("q", "answered 401"), ("new", "no message count"), ("gone", "answered 404")):
        with pytest.raises(QueueDepthUnavailable, match=message) as caught:
            management_queue_depth("amqp://u:pw-secret@h/%2F", management, queue, 2.0)()
        assert "pw-secret" not in str(caught.value)
    with pytest.raises(QueueDepthUnavailable, match="unreachable"):
        ManagementQueueDepth("http://127.0.0.1:9", "/", "q", "u", "p", timeout_s=1.0)()


def test_the_reader_takes_the_vhost_from_the_amqp_url_and_credentials_from_the_management_url() -> None:
    reader = management_queue_depth("amqp://a:b@h:5672/prod", "http://ops:pw@mq:15672", "vidx.index", 1.0)
    assert repr(reader) == "ManagementQueueDepth('http://mq:15672/api/queues/prod/vidx.index')"
    with pytest.raises(ValueError, match="http"):
        management_queue_depth("amqp://a:b@h/", "file:///etc/passwd", "q", 1.0)


def test_the_consumer_policy_ships_pickled_with_no_credentials_in_its_kwargs() -> None:
    settings = Settings(amqp=AmqpSettings(url=SecretStr("amqp://vidx:topsecret@mq:5672/%2F")))
    policy = consumer_policy(settings)
    assert policy.policy_kwargs == {} and "topsecret" not in repr(policy)
    callable_policy = policy.get_policy()  # what the controller gets: an instance, called every tick
    assert isinstance(callable_policy, QueueDepthPolicy) and "topsecret" not in repr(callable_policy._read_backlog)


def test_replica_options_follow_the_settings() -> None:
    on = Settings(autoscale=AutoscaleSettings(consumer_max_replicas=6, encoder_target_ongoing_requests=16))
    consumer = replica_options(on, "IndexConsumer")["autoscaling_config"]
    assert (consumer.min_replicas, consumer.max_replicas) == (1, 6)
    # Ray applies its delays to a custom policy's answer: the policy's own are the only ones.
    assert consumer.upscale_delay_s == 0 and consumer.downscale_delay_s == 0
    encoder = replica_options(on, "Encoder")["autoscaling_config"]
    assert (encoder.max_replicas, encoder.target_ongoing_requests) == (2, 16)
    assert encoder.downscale_delay_s == on.autoscale.downscale_delay_s
    off = Settings(autoscale=AutoscaleSettings(enabled=False), serve=ServeSettings(consumer_replicas=3))
    assert replica_options(off, "IndexConsumer") == {"num_replicas": 3}
    assert replica_options(off, "Encoder") == {"num_replicas": 1}

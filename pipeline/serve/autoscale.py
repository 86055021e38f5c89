"""Queue-depth autoscaling of the IndexConsumer: a Ray Serve custom policy over the index queue's
depth (ready + unacked) as RabbitMQ's management API reports it. The policy runs inside the Serve
controller and is pickled by value, so at module level this imports only the standard library.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import quote, unquote, urlsplit, urlunsplit

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingPolicy

    from pipeline.settings import Settings

#: Ray Serve configures this logger in the controller: decisions land in the controller's log.
log = logging.getLogger("ray.serve")

#: One line per decision; benchmarks parse it from the controller log (keep it stable).
DECISION_FORMAT = "vidx autoscale: deployment=%s current=%d desired=%d backlog=%d at=%.3f"
#: The import path Ray records for the policy (it is shipped pickled, never imported by this path).
POLICY_PATH = "pipeline.serve.autoscale:QueueDepthPolicy"
#: Most of the management API's answer read (one queue's JSON is a few KiB).
MAX_ANSWER_BYTES = 1024 * 1024
#: Tolerance of delay comparisons (clock arithmetic may land just below an exact delay).
_EPS_S = 1e-6


class QueueDepthUnavailable(Exception):
    """The management API did not answer with the queue's depth (the message never holds credentials)."""


class ScaleBounds:
    """What the decider holds a deployment to: replica bounds, backlog per replica, and delays."""

    def __init__(
        self,
        min_replicas: int,
        max_replicas: int,
        target_per_replica: int,
        upscale_delay_s: float,
        downscale_delay_s: float,
        starting_hold_s: float = 0.0,
    ) -> None:
        if not 0 <= min_replicas <= max_replicas or target_per_replica < 1:
            raise ValueError("need 0 <= min_replicas <= max_replicas and target_per_replica >= 1")
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self.target_per_replica = target_per_replica
        self.upscale_delay_s = upscale_delay_s
        self.downscale_delay_s = downscale_delay_s
        #: Longest a scale-down waits for replicas still starting (see ``ScaleDecider``).
        self.starting_hold_s = starting_hold_s


class ScaleDecider:
    """The replica count a backlog asks for, with hysteresis: more replicas once they have been
    wanted for ``upscale_delay_s``; fewer once fewer have been wanted for ``downscale_delay_s``,
    and then only down to the most wanted during that wait (a dip inside a burst releases nothing).

    While replicas asked for are still starting (fewer running than the current target), the
    downscale wait does not begin, for at most ``starting_hold_s``: a replica that takes longer to
    start than a burst takes to drain would otherwise be stopped before it served (churn: started,
    stopped half-built, started again at the next burst)."""

    def __init__(self, bounds: ScaleBounds) -> None:
        self.bounds = bounds
        self._up_since: float | None = None
        self._down_since: float | None = None
        self._down_peak = 0
        self._starting_since: float | None = None

    def wanted(self, backlog: int, lo: int, hi: int) -> int:
        """``ceil(backlog / target)`` held within ``[lo, hi]``."""
        return max(lo, min(hi, math.ceil(max(0, backlog) / self.bounds.target_per_replica)))

    def decide(
        self,
        current: int,
        backlog: int,
        now: float,
        lo: int | None = None,
        hi: int | None = None,
        running: int | None = None,
    ) -> int:
        """The count to ask for now, given the current target and the backlog; ``lo``/``hi``
        narrow the bounds further (Ray's capacity-adjusted bounds); ``running``: replicas up (None:
        unknown, no hold)."""
        b = self.bounds
        if running is None or running >= current:
            self._starting_since = None
        elif self._starting_since is None:
            self._starting_since = now
        hi = min(b.max_replicas, hi if hi is not None else b.max_replicas)
        lo = min(hi, max(b.min_replicas, lo if lo is not None else b.min_replicas))
        if not lo <= current <= hi:  # bounds changed under a running deployment: follow them at once
            self._reset()
            return max(lo, min(hi, current))
        wanted = self.wanted(backlog, lo, hi)
        if wanted > current:
            self._down_since = None
            self._up_since = now if self._up_since is None else self._up_since
            if now - self._up_since + _EPS_S >= b.upscale_delay_s:
                self._reset()
                return wanted
        elif wanted < current:
            self._up_since = None
            if self._starting_since is not None and now - self._starting_since < b.starting_hold_s:
                self._down_since = None  # the wait begins once they run (or the hold ends)
                return current
            if self._down_since is None:
                self._down_since, self._down_peak = now, wanted
            self._down_peak = max(self._down_peak, wanted)
            if now - self._down_since + _EPS_S >= b.downscale_delay_s:
                peak = self._down_peak
                self._reset()
                return peak
        else:
            self._reset()
        return current

    def _reset(self) -> None:
        self._up_since = self._down_since = None
        self._down_peak = 0


class BacklogPoller:
    """The last known backlog, refreshed at most every ``interval_s`` by one poll at a time, off the
    caller's thread (the controller's loop must not wait on HTTP). A failed poll keeps the last value."""

    def __init__(
        self,
        read: Callable[[], int],
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        start: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._read = read
        self._interval_s = interval_s
        self._clock = clock
        self._start = start or _start_thread
        self._lock = threading.Lock()
        self._last: int | None = None
        self._polled_at: float | None = None
        self._in_flight = False
        self._failing = False

    def backlog(self) -> int | None:
        """The last known backlog (None before the first answer); starts a poll when one is due."""
        now = self._clock()
        with self._lock:
            due = not self._in_flight and (self._polled_at is None or now - self._polled_at >= self._interval_s)
            if due:
                self._in_flight, self._polled_at = True, now
            last = self._last
        if due:
            self._start(self._poll)
        return last

    def _poll(self) -> None:
        try:
            value = self._read()
        except Exception as exc:  # any failure of the broker or the network keeps the last value
            if not self._failing:
                log.warning("vidx autoscale: queue depth unavailable, keeping %s: %s", self._last, _describe(exc))
            with self._lock:
                self._failing, self._in_flight = True, False
            return
        if self._failing:
            log.info("vidx autoscale: queue depth available again: %d", value)
        with self._lock:
            self._last, self._failing, self._in_flight = value, False, False


def _start_thread(target: Callable[[], None]) -> None:
    threading.Thread(target=target, name="vidx-autoscale-poll", daemon=True).start()


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, QueueDepthUnavailable) else type(exc).__name__


class ManagementQueueDepth:
    """Reads one queue's ``messages`` (ready + unacked) from RabbitMQ's management API. The
    credentials travel in a header, never in a URL, a log line or an exception message."""

    def __init__(self, api_url: str, vhost: str, queue: str, username: str, password: str, timeout_s: float) -> None:
        self._url = f"{api_url.rstrip('/')}/api/queues/{quote(vhost, safe='')}/{quote(queue, safe='')}"
        token = base64.b64encode(f"{username}:{password}".encode()).decode()
        self._auth = f"Basic {token}"
        self._timeout_s = timeout_s

    def __repr__(self) -> str:
        return f"ManagementQueueDepth({self._url!r})"

    def __call__(self) -> int:
        """Raises:
        QueueDepthUnavailable: no answer in time, a non-2xx status, or no ``messages`` field yet.
        """
        request = urllib.request.Request(self._url, headers={"Authorization": self._auth})
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                body = json.loads(response.read(MAX_ANSWER_BYTES))
        except urllib.error.HTTPError as exc:
            exc.close()  # it holds the connection
            raise QueueDepthUnavailable(f"management API answered {exc.code}") from None
        except (OSError, ValueError) as exc:  # URLError, timeouts, refused connections, bad JSON
            raise QueueDepthUnavailable(f"management API unreachable: {type(exc).__name__}") from None
        messages = body.get("messages") if isinstance(body, dict) else None
        if not isinstance(messages, int):  # a queue just declared has no stats yet
            raise QueueDepthUnavailable("management API gave no message count")
        return messages


def management_queue_depth(amqp_url: str, management_url: str, queue: str, timeout_s: float) -> ManagementQueueDepth:
    """The reader for ``queue``: the vhost and, unless ``management_url`` carries its own, the
    credentials come from the AMQP URL (the management API takes the same users)."""
    amqp, mgmt = urlsplit(amqp_url), urlsplit(management_url)
    if mgmt.scheme not in ("http", "https"):
        raise ValueError("amqp.management_url must be an http(s) URL")
    user, password = (mgmt.username, mgmt.password) if mgmt.username else (amqp.username, amqp.password)
    netloc = mgmt.hostname or ""
    if mgmt.port:
        netloc = f"{netloc}:{mgmt.port}"
    api_url = urlunsplit((mgmt.scheme, netloc, mgmt.path, "", ""))
    vhost = unquote(amqp.path[1:]) if len(amqp.path) > 1 else "/"
    return ManagementQueueDepth(
        api_url, vhost, queue, unquote(user or "guest"), unquote(password or "guest"), timeout_s
    )


class PolicyMetrics(Protocol):
    def observe(self, deployment: str, desired: int, backlog: int | None) -> None: ...

    def decided(self, deployment: str, direction: str) -> None: ...


class NoMetrics:
    """Where Ray is not running (unit tests): nothing is exported."""

    def observe(self, deployment: str, desired: int, backlog: int | None) -> None:
        return None

    def decided(self, deployment: str, direction: str) -> None:
        return None


class RayPolicyMetrics:
    """The policy's gauges and counter on Ray's metrics agent (scraped with the cluster's metrics)."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge

        tags = ("deployment",)
        self._desired = Gauge("vidx_autoscale_desired_replicas", "Replicas the policy asks for", tag_keys=tags)
        self._backlog = Gauge("vidx_autoscale_backlog", "Tasks on the queue (ready + unacked)", tag_keys=tags)
        self._decisions = Counter(
            "vidx_autoscale_decisions", "Changes of the desired count", tag_keys=("deployment", "direction")
        )

    def observe(self, deployment: str, desired: int, backlog: int | None) -> None:
        self._desired.set(desired, tags={"deployment": deployment})
        if backlog is not None:
            self._backlog.set(backlog, tags={"deployment": deployment})

    def decided(self, deployment: str, direction: str) -> None:
        self._decisions.inc(tags={"deployment": deployment, "direction": direction})


def default_metrics() -> PolicyMetrics:
    """Ray's metrics where Ray is initialised, else none (never fails the policy)."""
    try:
        import ray

        if ray.is_initialized():
            return RayPolicyMetrics()
    except Exception:  # a metrics agent that can't be reached must not stop scaling
        log.warning("vidx autoscale: metrics unavailable", exc_info=True)
    return NoMetrics()


class QueueDepthPolicy:
    """Ray Serve's deployment policy for the IndexConsumer: ``__call__(ctx)`` returns the desired
    replica count. Ray still applies its own delays and bounds to the result, so its
    ``AutoscalingConfig`` delays are set to 0 and the delays here are the only ones."""

    def __init__(
        self,
        read_backlog: Callable[[], int],
        bounds: ScaleBounds,
        poll_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        metrics: PolicyMetrics | None = None,
        start: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._read_backlog = read_backlog
        self._bounds = bounds
        self._poll_interval_s = poll_interval_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._metrics = metrics
        self._start = start
        self._runtime: tuple[BacklogPoller, ScaleDecider, PolicyMetrics] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Shipped pickled to the controller: the poller's lock and metrics are made there.
        return {**self.__dict__, "_runtime": None, "_metrics": None}

    def _parts(self) -> tuple[BacklogPoller, ScaleDecider, PolicyMetrics]:
        if self._runtime is None:
            poller = BacklogPoller(self._read_backlog, self._poll_interval_s, self._clock, self._start)
            self._runtime = (poller, ScaleDecider(self._bounds), self._metrics or default_metrics())
        return self._runtime

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        poller, decider, metrics = self._parts()
        backlog = poller.backlog()
        current = int(ctx.target_num_replicas)
        lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        if backlog is None:  # nothing known yet: hold the count (within the bounds)
            desired = max(min(lo, hi), min(hi, current))
        else:
            running = int(ctx.current_num_replicas)
            desired = decider.decide(current, backlog, self._clock(), lo, hi, running)
        name = str(ctx.deployment_name)
        metrics.observe(name, desired, backlog)
        if desired != current:
            shown = -1 if backlog is None else backlog
            log.info(DECISION_FORMAT, name, current, desired, shown, self._wall_clock())
            metrics.decided(name, "up" if desired > current else "down")
        return desired, {"vidx_backlog": backlog}


def consumer_policy(settings: Settings, *, text: bool = False) -> AutoscalingPolicy:
    """The IndexConsumer's policy (``text``: the TextConsumer's, on the text queue), pickled here with its
    reader: the credentials stay out of ``policy_kwargs``, which Ray logs and shows in the app's config."""
    from ray import cloudpickle
    from ray.serve.config import AutoscalingPolicy

    a, s = settings.autoscale, settings.serve
    if text:
        queue, low, high, target = s.text_queue, a.text_min_replicas, a.text_max_replicas, s.text_consumer_concurrency
    else:
        target = a.consumer_target_per_replica or s.consumer_concurrency
        queue, low, high = s.index_queue, a.consumer_min_replicas, a.consumer_max_replicas
    bounds = ScaleBounds(low, high, target, a.upscale_delay_s, a.downscale_delay_s, a.starting_hold_s)
    reader = management_queue_depth(
        settings.amqp.url.get_secret_value(), settings.amqp.management_url, queue, a.poll_timeout_s
    )
    policy = QueueDepthPolicy(reader, bounds, a.poll_interval_s)
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)  # the controller need not import vidx
    try:
        pickled = cloudpickle.dumps(policy)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    return AutoscalingPolicy.from_serialized_policy_def({"policy_function": POLICY_PATH}, pickled)


def replica_options(settings: Settings, deployment: str) -> dict[str, Any]:
    """``num_replicas`` or ``autoscaling_config`` for ``IndexConsumer``/``TextConsumer``/``Encoder``. Ray applies its
    delays to a custom policy's answer too, so the consumer's are 0 (the policy has its own)."""
    from ray.serve.config import AutoscalingConfig

    a, s = settings.autoscale, settings.serve
    if deployment in ("IndexConsumer", "TextConsumer"):
        text = deployment == "TextConsumer"
        if not a.enabled:
            return {"num_replicas": s.text_consumer_replicas if text else s.consumer_replicas}
        low, high = (
            (a.text_min_replicas, a.text_max_replicas) if text else (a.consumer_min_replicas, a.consumer_max_replicas)
        )
        policy = consumer_policy(settings, text=text)
        config = AutoscalingConfig(
            min_replicas=low, max_replicas=high, upscale_delay_s=0, downscale_delay_s=0, policy=policy
        )
        return {"autoscaling_config": config}
    if not a.enabled:
        return {"num_replicas": s.encoder_replicas}
    config = AutoscalingConfig(
        min_replicas=a.encoder_min_replicas,
        max_replicas=a.encoder_max_replicas,
        target_ongoing_requests=a.encoder_target_ongoing_requests,
        upscale_delay_s=a.upscale_delay_s,
        downscale_delay_s=a.downscale_delay_s,
    )
    return {"autoscaling_config": config}

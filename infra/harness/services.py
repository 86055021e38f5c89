"""Real MinIO and RabbitMQ for the integration and e2e tiers, started through testcontainers from
the images in infra/images (built by ``make images``). MinIO publishes bucket events to the RabbitMQ
container over the container network, exactly as in production (durable exchange, persistent
delivery, publisher confirms, queue_dir)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote

import httpx
import pika
import pika.exceptions
from minio import Minio
from testcontainers.core.container import DockerContainer

from events.config import AmqpSettings, EventDelivery
from events.subscribe import declare_event_topology, minio_notify_env, prepare_buckets

if TYPE_CHECKING:
    from storage.config import S3Settings

MINIO_IMAGE = "vidx/minio:test"
RABBITMQ_IMAGE = "vidx/rabbitmq:test"
ACCESS_KEY = "vidx-test-access"
SECRET_KEY = "vidx-test-secret-0123456789"
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Services:
    s3_endpoint: str
    amqp_url: str
    management_url: str
    rabbit: DockerContainer
    minio: DockerContainer
    #: ``quorum`` on a RabbitMQ cluster (infra/harness/ha.py): every queue vidx declares is a quorum queue.
    queue_type: Literal["classic", "quorum"] = "classic"
    #: How this MinIO publishes bucket events (``AmqpSettings.event_delivery``): which targets it has.
    event_delivery: EventDelivery = AmqpSettings().event_delivery

    def minio_client(self) -> Minio:
        return Minio(self.s3_endpoint.removeprefix("http://"), ACCESS_KEY, SECRET_KEY, secure=False)

    def s3_settings(self, index_bucket: str, buckets: list[str] | None = None) -> S3Settings:
        """The S3 settings of this MinIO with the test credentials, over these buckets."""
        from pydantic import SecretStr

        from storage.config import S3Settings

        s3 = S3Settings(
            endpoint_url=self.s3_endpoint,
            access_key=SecretStr(ACCESS_KEY),
            secret_key=SecretStr(SECRET_KEY),
            index_bucket=index_bucket,
        )
        return s3 if buckets is None else s3.model_copy(update={"buckets": buckets})

    def env(self, prefix: str) -> dict[str, str]:
        """VIDX_* settings pointing at these services, with buckets and queues unique to ``prefix``."""
        return {
            "VIDX_S3__ENDPOINT_URL": self.s3_endpoint,
            "VIDX_S3__ACCESS_KEY": ACCESS_KEY,
            "VIDX_S3__SECRET_KEY": SECRET_KEY,
            "VIDX_S3__BUCKETS": f'["{prefix}-videos"]',
            "VIDX_S3__INDEX_BUCKET": f"{prefix}-index",
            "VIDX_AMQP__URL": self.amqp_url,
            "VIDX_AMQP__MANAGEMENT_URL": self.management_url,
            "VIDX_AMQP__EVENTS_QUEUE": f"{prefix}.bucket-events",
            "VIDX_AMQP__PARKED_QUEUE": f"{prefix}.bucket-events.parked",
            "VIDX_SERVE__INDEX_QUEUE": f"{prefix}.index",
            "VIDX_SERVE__FAILED_QUEUE": f"{prefix}.index.failed",
            "VIDX_SERVE__UNPROCESSABLE_QUEUE": f"{prefix}.index.unprocessable",
            "VIDX_SERVE__TEXT_QUEUE": f"{prefix}.text",
            "VIDX_AMQP__QUEUE_TYPE": self.queue_type,
            "VIDX_AMQP__EVENT_DELIVERY": self.event_delivery,
        }

    def prepare_buckets(self, prefix: str) -> None:
        """Declare this prefix's event queue (bound to MinIO's exchange), create the upload and index
        buckets and subscribe the upload bucket: the queue exists before the first upload."""
        amqp = AmqpSettings(
            events_queue=f"{prefix}.bucket-events",
            parked_queue=f"{prefix}.bucket-events.parked",
            queue_type=self.queue_type,
        )
        connection = pika.BlockingConnection(pika.URLParameters(self.amqp_url))
        declare_event_topology(connection.channel(), amqp)
        connection.close()
        arns = AmqpSettings(event_delivery=self.event_delivery).queue_arns
        prepare_buckets(self.minio_client(), [f"{prefix}-videos"], f"{prefix}-index", arns)


def eventually(check: Callable[[], bool], what: str, timeout_s: float, poll_s: float = 0.2) -> None:
    """Poll ``check`` until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def wait_up(what: str, check: object, container: DockerContainer) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except Exception as exc:  # still starting: connection refused, reset, 503...
            last = exc
        time.sleep(0.5)
    _out, err = container.get_logs()
    raise RuntimeError(f"{what} did not start within {START_TIMEOUT_S}s ({last!r}); logs:\n{err[-2000:]!r}")


def minio_container(env: dict[str, str]) -> DockerContainer:
    """One MinIO node (a single drive), with the test credentials and ``env`` (its event target)."""
    return (
        DockerContainer(MINIO_IMAGE)
        .with_exposed_ports(9000)
        .with_env("MINIO_ROOT_USER", ACCESS_KEY)
        .with_env("MINIO_ROOT_PASSWORD", SECRET_KEY)
        # Benchmarks count S3 requests from its metrics (``s3_requests``): no token on loopback.
        .with_env("MINIO_PROMETHEUS_AUTH_TYPE", "public")
        .with_envs(**env)
    )


def s3_requests(s3_endpoint: str) -> dict[str, float]:
    """S3 requests MinIO has served since it started, by API (``GetObject``, ``PutObject``, ...), from
    its metrics v3 (``minio_api_requests_total``, live; the v2 node metrics are cached ~10 s)."""
    text = httpx.get(f"{s3_endpoint}/minio/metrics/v3/api/requests", timeout=10).raise_for_status().text
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("minio_api_requests_total{") and 'type="s3"' in line:
            labels, _, value = line.rpartition(" ")
            api = labels.partition('name="')[2].partition('"')[0]
            counts[api] = counts.get(api, 0.0) + float(value)
    return counts


def wait_minio(minio: DockerContainer) -> str:
    """Wait until the started single MinIO node is live; returns its S3 endpoint."""
    s3_endpoint = f"http://{minio.get_container_host_ip()}:{minio.get_exposed_port(9000)}"
    wait_up("MinIO", lambda: httpx.get(f"{s3_endpoint}/minio/health/live", timeout=2).status_code == 200, minio)
    return s3_endpoint


def container_ip(container: DockerContainer) -> str:
    """The container's address on its network (podman's list API lacks what bridge_ip() reads)."""
    wrapped = container.get_wrapped_container()
    wrapped.reload()
    settings = wrapped.attrs["NetworkSettings"]
    for network in (settings.get("Networks") or {}).values():
        if network.get("IPAddress"):
            return str(network["IPAddress"])
    return str(settings["IPAddress"])


def _amqp_ready(url: str) -> bool:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    declare_event_topology(channel, AmqpSettings())
    connection.close()
    return True


@contextmanager
def start_services(
    *,
    sync_events: bool = False,
    queue_dir: bool = True,
    event_delivery: EventDelivery | None = None,
) -> Iterator[Services]:
    """RabbitMQ, then MinIO publishing to it, its targets as ``event_delivery`` (default: the
    settings' default) says. ``sync_events``: MinIO publishes each event before it answers the request
    (``MINIO_API_SYNC_EVENTS=on``); ``queue_dir=False``: no on-disk event store (the durable target's
    events go straight out, as the fast target's do). bench/stages/events.py compares these delivery modes;
    docs/architecture.md says which is the default."""
    delivery = event_delivery or AmqpSettings().event_delivery
    rabbit = DockerContainer(RABBITMQ_IMAGE).with_exposed_ports(5672, 15672)
    rabbit.start()
    try:
        host = rabbit.get_container_host_ip()
        amqp_url = f"amqp://guest:guest@{host}:{rabbit.get_exposed_port(5672)}/%2F"
        management_url = f"http://{host}:{rabbit.get_exposed_port(15672)}"
        # The queue is declared and bound before MinIO can publish anything.
        wait_up("RabbitMQ", lambda: _amqp_ready(amqp_url), rabbit)
        rabbit_ip = container_ip(rabbit)
        env = minio_notify_env(AmqpSettings(event_delivery=delivery), f"amqp://guest:guest@{rabbit_ip}:5672", "/queue")
        if not queue_dir:
            env = {k: v for k, v in env.items() if "_QUEUE_DIR_" not in k and "_QUEUE_LIMIT_" not in k}
        if sync_events:
            env["MINIO_API_SYNC_EVENTS"] = "on"
        minio = minio_container(env)
        minio.start()
        try:
            s3_endpoint = wait_minio(minio)
            yield Services(s3_endpoint, amqp_url, management_url, rabbit, minio, event_delivery=delivery)
        finally:
            minio.stop()
    finally:
        rabbit.stop()


# -- fault injection (tests/faults) ----------------------------------------------------------------
#: Longest wait for a restarted broker or object store to answer again.
RESTART_TIMEOUT_S = 120.0


def restart_rabbitmq(services: Services, down_s: float = 2.0) -> float:
    """Restart the broker inside its container (``rabbitmqctl stop_app``, wait ``down_s``, ``start_app``)
    and wait until it takes connections again. Returns the seconds clients could not connect.

    In place rather than a container restart: podman gives a restarted container a new address, and
    MinIO's notification target names the broker by address, so a container restart would cut MinIO off
    for good. stop_app closes every client connection and stops every queue; start_app recovers the
    durable queues and persistent messages from disk, which is what a broker restart means to clients.
    """
    started = time.monotonic()
    result = services.rabbit.exec(["rabbitmqctl", "stop_app"])
    if result.exit_code != 0:
        raise RuntimeError(f"rabbitmqctl stop_app failed: {result.output[-500:]!r}")
    time.sleep(down_s)
    result = services.rabbit.exec(["rabbitmqctl", "start_app"])
    if result.exit_code != 0:
        raise RuntimeError(f"rabbitmqctl start_app failed: {result.output[-500:]!r}")
    wait_up("RabbitMQ after restart", lambda: _amqp_ready(services.amqp_url), services.rabbit)
    return time.monotonic() - started


#: Finds the broker's Erlang VM inside the container, SIGKILLs it and prints its pid. The broker's VM is
#: the oldest ``beam.smp``: a CLI tool (``rabbitmqctl``, ``rabbitmq-diagnostics``) runs in a VM of its own
#: while it works. Where none is running, prints the container's processes and exits 1.
KILL_BEAM = (
    'pid=$(pgrep -o -x beam.smp) || { echo "no beam.smp running:"; ps -eo pid,ppid,stat,etime,args; exit 1; }; '
    'kill -9 "$pid" && echo "$pid"'
)


def _beam_pid(services: Services) -> str:
    result = services.rabbit.exec(["pgrep", "-o", "-x", "beam.smp"])
    return result.output.decode().strip() if result.exit_code == 0 else ""


def kill_rabbitmq(services: Services) -> float:
    """SIGKILL the broker: ``kill -9`` of its Erlang VM (``beam.smp``) inside the container, with no
    shutdown of any kind (nothing flushed, no connection closed by the broker). The image's supervisor
    (infra/images/rabbitmq/supervise.sh) starts the broker again in the same container, so it comes
    back at the same address and recovers its durable queues and persistent messages from disk.
    Waits until it takes connections again and returns the seconds clients could not connect.

    Raises:
        RuntimeError: no single broker process to kill, or it did not come back in time.
    """
    started = time.monotonic()
    result = services.rabbit.exec(["sh", "-c", KILL_BEAM])
    if result.exit_code != 0:
        raise RuntimeError(f"could not SIGKILL beam.smp: {result.output[-500:]!r}")
    killed = result.output.decode().strip()

    def back() -> bool:
        pid = _beam_pid(services)
        return bool(pid) and pid != killed and _amqp_ready(services.amqp_url)

    wait_up("RabbitMQ after SIGKILL", back, services.rabbit)
    return time.monotonic() - started


def restart_minio(services: Services, stop_timeout_s: int = 10) -> float:
    """Restart the MinIO container (SIGTERM, then SIGKILL after ``stop_timeout_s``) and wait until it is
    live. Host port mappings survive a podman restart; only MinIO's own container address changes, and
    nothing reaches MinIO by that address. Its queue_dir lives in the container's filesystem and so
    survives too. Returns the seconds it was away."""
    started = time.monotonic()
    services.minio.get_wrapped_container().restart(timeout=stop_timeout_s)
    wait_up(
        "MinIO after restart",
        lambda: httpx.get(f"{services.s3_endpoint}/minio/health/live", timeout=2).status_code == 200,
        services.minio,
    )
    return time.monotonic() - started


def queue_counts(services: Services, queue: str) -> tuple[int, int]:
    """(ready, unacknowledged) messages on ``queue`` from the management API; (0, 0) if it is unknown
    or the broker does not answer."""
    try:
        resp = httpx.get(f"{services.management_url}/api/queues/%2F/{queue}", auth=("guest", "guest"), timeout=5)
    except httpx.HTTPError:
        return 0, 0
    if resp.status_code != 200:
        return 0, 0
    body = resp.json()
    return int(body.get("messages_ready") or 0), int(body.get("messages_unacknowledged") or 0)


# -- the management API ------------------------------------------------------------------------------
def _management(services: Services, method: str, path: str, timeout_s: float = 5.0) -> httpx.Response:
    return httpx.request(method, f"{services.management_url}{path}", auth=("guest", "guest"), timeout=timeout_s)


def queue_info(services: Services, queue: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The management API's view of ``queue`` (``messages_unacknowledged``, ``message_stats``...); {}
    if it is unknown or the broker does not answer within ``timeout_s``. Figures refresh every second
    (rabbitmq.conf)."""
    try:
        resp = _management(services, "GET", f"/api/queues/%2F/{quote(queue, safe='')}", timeout_s)
    except httpx.HTTPError:
        return {}
    body: dict[str, Any] = resp.json() if resp.status_code == 200 else {}
    return body


def redeliveries(info: dict[str, Any]) -> int:
    """Deliveries of ``queue_info``'s queue that the broker flagged as redelivered, so far."""
    return int((info.get("message_stats") or {}).get("redeliver") or 0)


def consumer_connections(services: Services, queue: str) -> list[str]:
    """Names of the connections with a consumer on ``queue`` (the consumers of that queue)."""
    try:
        resp = _management(services, "GET", "/api/consumers/%2F")
    except httpx.HTTPError:
        return []
    if resp.status_code != 200:
        return []
    names = {
        str(c["channel_details"]["connection_name"])
        for c in resp.json()
        if (c.get("queue") or {}).get("name") == queue and c.get("channel_details")
    }
    return sorted(names)


def close_connection(services: Services, name: str) -> bool:
    """Have the broker close connection ``name`` (as an operator would); False if it was already gone."""
    resp = _management(services, "DELETE", f"/api/connections/{quote(name, safe='')}")
    return resp.status_code in (200, 204)

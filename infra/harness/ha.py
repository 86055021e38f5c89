"""The high-availability topology for tests and benchmarks, started through testcontainers: a RabbitMQ
cluster (3 nodes of the locally built image, one Erlang cookie, joined at start, quorum queues) behind
HAProxy, and MinIO publishing its bucket events through that proxy — all on a container network of
their own, where the nodes find each other by name (podman's DNS).

Why HAProxy in front: MinIO's AMQP target takes one URL, so events keep flowing when a node dies only if
that URL is not one node's. The proxy checks each node every second and cuts the sessions to a node it
marks down, so MinIO, the router and the Celery consumers reconnect — to a live node. In Kubernetes the
cluster's Service plays this part (docs/operations.md, "High availability").

Node faults: ``kill_node`` SIGKILLs a node's Erlang VM (the image's supervisor starts it again in the same
container: same name, same data, it rejoins); ``partition`` disconnects a node's container from the
network for a while (nothing reaches it, it reaches nothing) and connects it again under its name.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import pika
from testcontainers.core.container import DockerContainer
from testcontainers.core.network import Network

from events.config import AmqpSettings
from events.subscribe import declare_event_topology, minio_notify_env
from infra.harness.services import (
    ACCESS_KEY,
    KILL_BEAM,
    MINIO_IMAGE,
    RABBITMQ_IMAGE,
    SECRET_KEY,
    Services,
    minio_container,
    wait_minio,
    wait_up,
)

HAPROXY_IMAGE = "vidx/haproxy:test"
#: Longest wait for a node to join, rejoin or be seen running by the cluster again.
NODE_TIMEOUT_S = 120.0
#: Tries of a node kill whose command failed (one a second): the exec itself can fail on a loaded host.
KILL_ATTEMPTS = 3
#: How often HAProxy checks each node, and how many failed checks mark it down.
CHECK_INTERVAL_MS = 1000
CHECK_FALL = 2


def haproxy_config(rabbit: list[str], minio: list[str] | None = None) -> str:
    """TCP fronts for AMQP (5672) and the management API (15672) over the ``rabbit`` nodes, and for S3
    (9000, checked with MinIO's liveness probe) over the ``minio`` nodes (names on the network). Node
    addresses are resolved through the network's DNS at run time (a restarted node may come back at
    another address); a node failing ``CHECK_FALL`` checks is marked down and its sessions are cut."""
    check = f"check inter {CHECK_INTERVAL_MS} fall {CHECK_FALL} rise 2"
    lines = [
        "global",
        "  maxconn 4096",
        "defaults",
        "  mode tcp",
        "  timeout connect 2s",
        "  # AMQP connections are long-lived: the brokers' and clients' heartbeats find dead peers, not this.",
        "  timeout client 3h",
        "  timeout server 3h",
        f"  default-server {check} resolvers net init-addr last,libc,none on-marked-down shutdown-sessions",
        "resolvers net",
        "  parse-resolv-conf",
        "  hold valid 1s",
        "  hold obsolete 1s",
    ]
    fronts: list[tuple[str, int, list[str], str | None]] = [
        ("amqp", 5672, rabbit, None),
        ("management", 15672, rabbit, None),
    ]
    if minio:
        fronts.append(("s3", 9000, minio, "/minio/health/live"))
    for name, port, nodes, http_check in fronts:
        lines += [f"frontend {name}", f"  bind :{port}", f"  default_backend {name}", f"backend {name}"]
        lines += ["  balance roundrobin", *([f"  option httpchk GET {http_check}"] if http_check else [])]
        lines += [f"  server {n} {n}:{port}" for n in nodes]
    return "\n".join(lines) + "\n"


@dataclass
class RabbitCluster:
    network: Network
    nodes: dict[str, DockerContainer]
    proxy: DockerContainer
    #: URLs as seen from this machine (through the proxy's mapped ports).
    amqp_url: str
    management_url: str
    #: The AMQP URL as containers on the network see it (MinIO's target).
    inner_amqp_url: str
    partitioned: set[str] = field(default_factory=set)

    def _api(self, path: str, timeout_s: float = 5.0, retry_s: float = 0.0) -> Any:
        """GET ``path`` from the management API. ``retry_s``: for that long, a request that timed out,
        found no node or got a 5xx is tried again (a loaded node answers late; the proxy may route to a
        node it has not yet marked down); then the last failure is raised."""
        deadline = time.monotonic() + retry_s
        while True:
            try:
                resp = httpx.get(f"{self.management_url}{path}", auth=("guest", "guest"), timeout=timeout_s)
                if resp.status_code < 500 or time.monotonic() >= deadline:
                    resp.raise_for_status()
                    return resp.json()
            except httpx.TransportError:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(0.5)

    def running_nodes(self, timeout_s: float = 5.0) -> set[str] | None:
        """The nodes the cluster sees running (by container name); None if no answer within ``timeout_s``
        (while a node is cut off, the management API waits on it until Erlang's net tick gives it up)."""
        try:
            return {str(n["name"]).split("@", 1)[1] for n in self._api("/api/nodes", timeout_s) if n.get("running")}
        except (httpx.HTTPError, ValueError):
            return None

    def queue(self, name: str, retry_s: float = 0.0) -> dict[str, Any]:
        """The management API's view of queue ``name`` (``type``; for a quorum queue ``leader``,
        ``members``, ``online``)."""
        body: dict[str, Any] = self._api(f"/api/queues/%2F/{quote(name, safe='')}", retry_s=retry_s)
        return body

    def leader(self, queue: str, retry_s: float = 0.0) -> str:
        """The container name of the node leading quorum queue ``queue``."""
        return str(self.queue(queue, retry_s)["leader"]).split("@", 1)[1]

    def queue_types(self) -> dict[str, str]:
        """Queue name -> type, as ``rabbitmqctl list_queues name type`` prints them on a live node."""
        node = next(c for n, c in self.nodes.items() if n not in self.partitioned)
        result = node.exec(["rabbitmqctl", "list_queues", "-q", "--formatter", "json", "name", "type"])
        if result.exit_code != 0:
            raise RuntimeError(f"rabbitmqctl list_queues failed: {result.output[-300:]!r}")
        return {str(q["name"]): str(q["type"]) for q in json.loads(result.output)}

    def consumer_nodes(self, queue: str, retry_s: float = 0.0) -> list[str]:
        """The nodes (container names) the consumers of ``queue`` are connected to."""
        nodes = {
            str(c["channel_details"]["node"]).split("@", 1)[1]
            for c in self._api("/api/consumers/%2F", retry_s=retry_s)
            if (c.get("queue") or {}).get("name") == queue and (c.get("channel_details") or {}).get("node")
        }
        return sorted(nodes)

    def wait_running(self, want: set[str] | None = None, timeout_s: float = NODE_TIMEOUT_S) -> float:
        """Wait until the cluster sees ``want`` (default: every node) running; returns the seconds."""
        want = set(self.nodes) if want is None else want
        started = time.monotonic()
        while not want <= (self.running_nodes() or set()):
            if time.monotonic() - started > timeout_s:
                missing = sorted(want - (self.running_nodes() or set()))
                raise RuntimeError(f"nodes {missing} not running after {timeout_s:g}s")
            time.sleep(0.5)
        return time.monotonic() - started

    def kill_node(self, name: str) -> str:
        """SIGKILL node ``name``'s Erlang VM (no shutdown of any kind). The image's supervisor starts it
        again in the same container; it rejoins the cluster. Does not wait for it: ``wait_running``."""
        for attempt in range(KILL_ATTEMPTS):
            result = self.nodes[name].exec(["sh", "-c", KILL_BEAM])
            if result.exit_code == 0:
                return f"{name}: beam.smp {result.output.decode().strip()} SIGKILLed"
            if attempt < KILL_ATTEMPTS - 1:
                time.sleep(1.0)
        output = result.output.decode(errors="replace")[-1500:]
        raise RuntimeError(f"could not SIGKILL {name}'s beam.smp (exit {result.exit_code}): {output!r}")

    def partition(self, name: str, seconds: float) -> str:
        """Cut node ``name`` off the network for ``seconds`` (disconnect its container: no peer, no client,
        not the proxy reaches it), then connect it again under its name. Blocks for ``seconds``."""
        node = self.nodes[name]
        network = node.get_docker_client().client.networks.get(self.network.name)
        container = node.get_wrapped_container()
        network.disconnect(container, force=True)
        self.partitioned.add(name)
        try:
            time.sleep(seconds)
        finally:
            network.connect(container, aliases=[name])
            self.partitioned.discard(name)
        return f"{name}: partitioned {seconds:g}s"


def stop_all(containers: list[DockerContainer | None], network: Network | None = None) -> None:
    """Stop and remove each container, then the network, each on its own: one failure doesn't leave
    the others behind (nothing reaps them here). Raises the first failure once all were tried."""
    errors: list[Exception] = []
    for container in containers:
        if container is not None:
            try:
                container.stop()
            except Exception as exc:
                errors.append(exc)
    if network is not None:
        try:
            network.remove()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def _ready(url: str) -> bool:
    pika.BlockingConnection(pika.URLParameters(url)).close()
    return True


def _node(network: Network, name: str, cookie: str, restart_delay_s: float) -> DockerContainer:
    return (
        DockerContainer(RABBITMQ_IMAGE, hostname=name)
        .with_name(f"{network.name}-{name}")
        .with_network(network)
        .with_network_aliases(name)
        .with_env("VIDX_ERLANG_COOKIE", cookie)
        # How long a SIGKILLed broker stays down before the image's supervisor starts it again.
        .with_env("RABBITMQ_RESTART_DELAY_S", f"{restart_delay_s:g}")
        .with_exposed_ports(5672)
    )


@dataclass
class MinioCluster:
    """A distributed MinIO: one erasure set over ``nodes`` (EC:2 with 4), behind the proxy's S3 front."""

    nodes: dict[str, DockerContainer]
    #: The S3 endpoint as seen from this machine (through the proxy).
    endpoint: str

    def live(self, name: str) -> bool:
        node = self.nodes[name]
        try:
            url = f"http://{node.get_container_host_ip()}:{node.get_exposed_port(9000)}/minio/health/live"
            return httpx.get(url, timeout=2).status_code == 200
        except Exception:  # stopped: no mapped port, refused
            return False

    def cluster_writable(self) -> bool:
        """MinIO's cluster health probe through the proxy: 200 while the write quorum holds."""
        try:
            return httpx.get(f"{self.endpoint}/minio/health/cluster", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill_node(self, name: str) -> str:
        """SIGKILL node ``name`` (MinIO is its container's first process: the container stops)."""
        self.nodes[name].get_wrapped_container().kill(signal="SIGKILL")
        return f"{name}: minio SIGKILLed"

    def start_node(self, name: str, timeout_s: float = NODE_TIMEOUT_S) -> float:
        """Start node ``name`` again (same name, same drive) and wait until it is live; returns seconds."""
        started = time.monotonic()
        self.nodes[name].get_wrapped_container().start()
        while not self.live(name):
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"MinIO node {name} not live {timeout_s:g}s after its start")
            time.sleep(0.5)
        return time.monotonic() - started


@dataclass
class HaServices:
    services: Services
    rabbit: RabbitCluster
    #: None: one MinIO node, not behind the proxy (the CI test's topology).
    minio: MinioCluster | None


def _minio_node(network: Network, name: str, size: int, env: dict[str, str]) -> DockerContainer:
    return (
        DockerContainer(MINIO_IMAGE, hostname=name)
        .with_name(f"{network.name}-{name}")
        .with_network(network)
        .with_network_aliases(name)
        .with_command(["server", f"http://minio-{{0...{size - 1}}}:9000/data", "--address", ":9000"])
        .with_exposed_ports(9000)
        .with_env("MINIO_ROOT_USER", ACCESS_KEY)
        .with_env("MINIO_ROOT_PASSWORD", SECRET_KEY)
        # Each node's drive is a folder of its container's own filesystem (no separate disk here).
        .with_env("MINIO_CI_CD", "on")
        .with_envs(**env)
    )


@contextmanager
def start_rabbit_cluster(
    size: int = 3, minio_names: list[str] | None = None, restart_delay_s: float = 1.0
) -> Iterator[RabbitCluster]:
    """``size`` RabbitMQ nodes joined into one cluster, and HAProxy in front of them (and in front of
    the MinIO nodes ``minio_names``, which the caller starts on the same network). A SIGKILLed node is
    started again ``restart_delay_s`` later."""
    network = Network().create()
    names = [f"rmq-{i}" for i in range(size)]
    cookie = secrets.token_hex(20)
    nodes: dict[str, DockerContainer] = {}
    proxy: DockerContainer | None = None
    try:
        for name in names:
            nodes[name] = _node(network, name, cookie, restart_delay_s)
            nodes[name].start()
        for name, node in nodes.items():
            url = f"amqp://guest:guest@{node.get_container_host_ip()}:{node.get_exposed_port(5672)}/%2F"
            wait_up(f"RabbitMQ node {name}", lambda url=url: _ready(url), node)
        first = f"rabbit@{names[0]}"
        for name in names[1:]:
            for step in (["stop_app"], ["join_cluster", first], ["start_app"]):
                result = nodes[name].exec(["rabbitmqctl", *step])
                if result.exit_code != 0:
                    raise RuntimeError(f"{name}: rabbitmqctl {step[0]} failed: {result.output[-500:]!r}")
        proxy = (
            DockerContainer(HAPROXY_IMAGE)
            .with_name(f"{network.name}-haproxy")
            .with_network(network)
            .with_network_aliases("haproxy")
            .with_env("HAPROXY_CONFIG", haproxy_config(names, minio_names))
            .with_exposed_ports(5672, 15672, 9000)
        )
        proxy.start()
        host = proxy.get_container_host_ip()
        cluster = RabbitCluster(
            network,
            nodes,
            proxy,
            amqp_url=f"amqp://guest:guest@{host}:{proxy.get_exposed_port(5672)}/%2F",
            management_url=f"http://{host}:{proxy.get_exposed_port(15672)}",
            inner_amqp_url="amqp://guest:guest@haproxy:5672",
        )
        wait_up("the cluster through HAProxy", lambda: cluster.running_nodes() == set(names), proxy)
        yield cluster
    finally:
        stop_all([proxy, *nodes.values()], network)


@contextmanager
def start_ha_services(minio_nodes: int = 0, rabbit_restart_delay_s: float = 1.0) -> Iterator[HaServices]:
    """The RabbitMQ cluster and MinIO on its network, publishing bucket events through the proxy:
    ``minio_nodes`` ≥ 4 nodes distributed behind the proxy, or 0 for one node reached directly. The
    ``Services`` declare quorum queues and point the app at the proxy."""
    names = [f"minio-{i}" for i in range(minio_nodes)]
    with start_rabbit_cluster(minio_names=names, restart_delay_s=rabbit_restart_delay_s) as cluster:
        amqp = AmqpSettings(queue_type="quorum")
        connection = pika.BlockingConnection(pika.URLParameters(cluster.amqp_url))
        try:
            declare_event_topology(connection.channel(), amqp)  # the exchange exists before MinIO publishes
        finally:
            connection.close()
        env = minio_notify_env(amqp, cluster.inner_amqp_url, "/queue")
        if names:
            containers = {name: _minio_node(cluster.network, name, len(names), env) for name in names}
        else:
            containers = {"minio": minio_container(env).with_network(cluster.network)}
        try:
            for container in containers.values():
                container.start()
            first = next(iter(containers.values()))
            minio: MinioCluster | None = None
            if names:
                host = cluster.proxy.get_container_host_ip()
                minio = MinioCluster(containers, f"http://{host}:{cluster.proxy.get_exposed_port(9000)}")
                s3_endpoint = minio.endpoint
                wait_up("distributed MinIO through HAProxy", minio.cluster_writable, first)
            else:
                s3_endpoint = wait_minio(first)
            rabbit = next(iter(cluster.nodes.values()))
            services = Services(
                s3_endpoint, cluster.amqp_url, cluster.management_url, rabbit, first, queue_type="quorum"
            )
            yield HaServices(services, cluster, minio)
        finally:
            stop_all(list(containers.values()))

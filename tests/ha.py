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
from tests.services import ACCESS_KEY, MINIO_IMAGE, RABBITMQ_IMAGE, SECRET_KEY, Services, _wait

HAPROXY_IMAGE = "vidx/haproxy:test"
#: Longest wait for a node to join, rejoin or be seen running by the cluster again.
NODE_TIMEOUT_S = 120.0
#: How often HAProxy checks each node, and how many failed checks mark it down.
CHECK_INTERVAL_MS = 1000
CHECK_FALL = 2


def haproxy_config(nodes: list[str]) -> str:
    """TCP fronts for AMQP (5672) and the management API (15672) over ``nodes`` (names on the network).
    Node addresses are resolved through the network's DNS at run time (a restarted node may come back
    at another address); a node failing ``CHECK_FALL`` checks is marked down and its sessions are cut."""
    servers = "\n".join(f"  server {n} {n}:{{port}}" for n in nodes)
    check = f"check inter {CHECK_INTERVAL_MS} fall {CHECK_FALL} rise 2"
    return f"""global
  maxconn 4096
defaults
  mode tcp
  timeout connect 2s
  # AMQP connections are long-lived: the brokers' and clients' heartbeats find dead peers, not this.
  timeout client 3h
  timeout server 3h
  default-server {check} resolvers net init-addr last,libc,none on-marked-down shutdown-sessions
resolvers net
  parse-resolv-conf
  hold valid 1s
  hold obsolete 1s
frontend amqp
  bind :5672
  default_backend amqp
backend amqp
  balance roundrobin
{servers.format(port=5672)}
frontend management
  bind :15672
  default_backend management
backend management
  balance roundrobin
{servers.format(port=15672)}
"""


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

    def _api(self, path: str) -> Any:
        resp = httpx.get(f"{self.management_url}{path}", auth=("guest", "guest"), timeout=5)
        resp.raise_for_status()
        return resp.json()

    def running_nodes(self) -> set[str]:
        """The nodes the cluster sees running (by container name); empty if no node answers."""
        try:
            return {str(n["name"]).split("@", 1)[1] for n in self._api("/api/nodes") if n.get("running")}
        except (httpx.HTTPError, ValueError):
            return set()

    def queue(self, name: str) -> dict[str, Any]:
        """The management API's view of queue ``name`` (``type``; for a quorum queue ``leader``,
        ``members``, ``online``)."""
        body: dict[str, Any] = self._api(f"/api/queues/%2F/{quote(name, safe='')}")
        return body

    def leader(self, queue: str) -> str:
        """The container name of the node leading quorum queue ``queue``."""
        return str(self.queue(queue)["leader"]).split("@", 1)[1]

    def list_queues(self) -> str:
        """``rabbitmqctl list_queues name type`` as one node prints it."""
        node = next(c for n, c in self.nodes.items() if n not in self.partitioned)
        result = node.exec(["rabbitmqctl", "list_queues", "-q", "name", "type"])
        return str(result.output.decode())

    def wait_running(self, want: set[str] | None = None, timeout_s: float = NODE_TIMEOUT_S) -> float:
        """Wait until the cluster sees ``want`` (default: every node) running; returns the seconds."""
        want = set(self.nodes) if want is None else want
        started = time.monotonic()
        while not want <= self.running_nodes():
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"nodes {sorted(want - self.running_nodes())} not running after {timeout_s:g}s")
            time.sleep(0.5)
        return time.monotonic() - started

    def kill_node(self, name: str) -> str:
        """SIGKILL node ``name``'s Erlang VM (no shutdown of any kind). The image's supervisor starts it
        again in the same container; it rejoins the cluster. Does not wait for it: ``wait_running``."""
        result = self.nodes[name].exec(["sh", "-c", "pid=$(pgrep -x beam.smp) && kill -9 $pid && echo $pid"])
        if result.exit_code != 0:
            raise RuntimeError(f"could not SIGKILL {name}'s beam.smp: {result.output[-300:]!r}")
        return f"{name}: beam.smp {result.output.decode().strip()} SIGKILLed"

    def partition(self, name: str, seconds: float) -> str:
        """Cut node ``name`` off the network for ``seconds`` (disconnect its container: no peer, no client,
        not the proxy reaches it), then connect it again under its name. Blocks for ``seconds``."""
        network = self.network._network
        assert network is not None, "the network was created"
        container = self.nodes[name].get_wrapped_container()
        network.disconnect(container, force=True)
        self.partitioned.add(name)
        try:
            time.sleep(seconds)
        finally:
            network.connect(container, aliases=[name])
            self.partitioned.discard(name)
        return f"{name}: partitioned {seconds:g}s"


def _ready(url: str) -> bool:
    pika.BlockingConnection(pika.URLParameters(url)).close()
    return True


def _node(network: Network, name: str, cookie: str) -> DockerContainer:
    return (
        DockerContainer(RABBITMQ_IMAGE, hostname=name)
        .with_name(f"{network.name}-{name}")
        .with_network(network)
        .with_network_aliases(name)
        .with_env("VIDX_ERLANG_COOKIE", cookie)
        .with_exposed_ports(5672)
    )


@contextmanager
def start_rabbit_cluster(size: int = 3) -> Iterator[RabbitCluster]:
    """``size`` RabbitMQ nodes joined into one cluster, and HAProxy in front of them."""
    network = Network().create()
    names = [f"rmq-{i}" for i in range(size)]
    cookie = secrets.token_hex(20)
    nodes: dict[str, DockerContainer] = {}
    proxy: DockerContainer | None = None
    try:
        for name in names:
            nodes[name] = _node(network, name, cookie)
            nodes[name].start()
        for name, node in nodes.items():
            url = f"amqp://guest:guest@{node.get_container_host_ip()}:{node.get_exposed_port(5672)}/%2F"
            _wait(f"RabbitMQ node {name}", lambda url=url: _ready(url), node)
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
            .with_env("HAPROXY_CONFIG", haproxy_config(names))
            .with_exposed_ports(5672, 15672)
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
        _wait("the cluster through HAProxy", lambda: cluster.running_nodes() == set(names), proxy)
        yield cluster
    finally:
        for container in [proxy, *nodes.values()]:
            if container is not None:
                container.stop()
        network.remove()


@contextmanager
def start_ha_services() -> Iterator[tuple[Services, RabbitCluster]]:
    """The RabbitMQ cluster, and MinIO (one node) on its network publishing bucket events through the
    proxy. The ``Services`` declare quorum queues and point the app at the proxy."""
    with start_rabbit_cluster() as cluster:
        amqp = AmqpSettings(queue_type="quorum")
        connection = pika.BlockingConnection(pika.URLParameters(cluster.amqp_url))
        declare_event_topology(connection.channel(), amqp)  # the exchange exists before MinIO publishes
        connection.close()
        env = minio_notify_env(amqp, cluster.inner_amqp_url, "/queue")
        minio = (
            DockerContainer(MINIO_IMAGE)
            .with_network(cluster.network)
            .with_exposed_ports(9000)
            .with_env("MINIO_ROOT_USER", ACCESS_KEY)
            .with_env("MINIO_ROOT_PASSWORD", SECRET_KEY)
            .with_envs(**env)
        )
        minio.start()
        try:
            s3_endpoint = f"http://{minio.get_container_host_ip()}:{minio.get_exposed_port(9000)}"
            _wait(
                "MinIO",
                lambda: httpx.get(f"{s3_endpoint}/minio/health/live", timeout=2).status_code == 200,
                minio,
            )
            rabbit = next(iter(cluster.nodes.values()))
            yield (
                Services(s3_endpoint, cluster.amqp_url, cluster.management_url, rabbit, minio, queue_type="quorum"),
                cluster,
            )
        finally:
            minio.stop()

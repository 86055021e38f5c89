"""RabbitMQ of the local stack: its config under the state dir, start-up with the event topology, epmd."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from infra.dev.stack.layout import Echo, Layout, StackError
from infra.dev.stack.process import alive, host_port, port_open, running_pid, spawn, taken
from pipeline.settings import Settings

#: Not /usr/sbin/rabbitmq-server: run as root, that wrapper su's to the rabbitmq user and drops our env.
RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
RABBITMQ_NODENAME = "vidx@localhost"
#: Above the longest index job, so a late ack never makes RabbitMQ close the consumer's channel.
RABBITMQ_CONSUMER_TIMEOUT_MS = 3_600_000
RABBITMQ_START_TIMEOUT_S = 90.0
RABBITMQ_STOP_TIMEOUT_S = 60.0
EPMD_PORT = 4369


def _rabbitmq_env(settings: Settings, layout: Layout) -> dict[str, str]:
    _, amqp_port = host_port(settings.amqp.url.get_secret_value(), 5672)
    _, mgmt_port = host_port(settings.amqp.management_url, 15672)
    base = layout.root / "rabbitmq"
    conf = base / "rabbitmq.conf"
    conf.write_text(
        f"listeners.tcp.1 = 127.0.0.1:{amqp_port}\n"
        f"management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {mgmt_port}\n"
        f"consumer_timeout = {RABBITMQ_CONSUMER_TIMEOUT_MS}\n"
    )
    (base / "enabled_plugins").write_text("[rabbitmq_management].\n")
    (base / "rabbitmq-env.conf").touch()
    (base / "home").mkdir(exist_ok=True)
    return {
        **os.environ,
        "HOME": str(base / "home"),  # the Erlang cookie lives here
        "RABBITMQ_NODENAME": RABBITMQ_NODENAME,
        "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
        "RABBITMQ_NODE_PORT": str(amqp_port),
        "RABBITMQ_DIST_PORT": str(amqp_port + 20000),
        "RABBITMQ_CONF_ENV_FILE": str(base / "rabbitmq-env.conf"),  # not /etc/rabbitmq's
        "RABBITMQ_CONFIG_FILE": str(conf),
        "RABBITMQ_ADVANCED_CONFIG_FILE": str(base / "advanced.config"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
        "RABBITMQ_ENABLED_PLUGINS": "rabbitmq_management",
        "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
        "RABBITMQ_LOG_BASE": str(layout.logs / "rabbitmq"),
        "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        "ERL_EPMD_ADDRESS": "127.0.0.1",
    }


def start_rabbitmq(settings: Settings, layout: Layout, echo: Echo) -> None:
    """Start RabbitMQ (or reuse ours), wait for AMQP and declare the event topology. Raises StackError."""
    url = settings.amqp.url.get_secret_value()
    host, port = host_port(url, 5672)
    log = layout.log("rabbitmq")
    if (pid := running_pid(layout, "rabbitmq")) is None:
        if port_open(host, port):
            hint = ": a system RabbitMQ? stop it (systemctl stop rabbitmq-server) or change VIDX_AMQP__URL"
            raise taken(port, "AMQP", hint)
        if not RABBITMQ_SERVER.exists():
            raise StackError(f"{RABBITMQ_SERVER} not found: apt-get install rabbitmq-server")
        marker = layout.pids / "epmd.owned"
        if not port_open("127.0.0.1", EPMD_PORT):
            marker.touch()  # the Erlang VM will start epmd for us: down stops it
        pid = spawn(layout, "rabbitmq", [str(RABBITMQ_SERVER)], _rabbitmq_env(settings, layout))
        echo(f"rabbitmq: starting (pid {pid})")
    import pika
    import pika.exceptions

    from events.subscribe import declare_event_topology

    deadline = time.monotonic() + RABBITMQ_START_TIMEOUT_S
    while True:
        if not alive(pid):
            raise StackError(f"RabbitMQ exited during start-up; see {log} and {layout.logs / 'rabbitmq'}/")
        try:
            params = pika.URLParameters(url)
            params.connection_attempts, params.socket_timeout = 1, 5
            connection = pika.BlockingConnection(params)
            break
        # A broker still starting can also refuse at the socket (OSError) rather than in pika.
        except (pika.exceptions.AMQPError, OSError) as exc:
            if time.monotonic() >= deadline:
                raise StackError(
                    f"RabbitMQ did not accept AMQP connections on port {port} within "
                    f"{RABBITMQ_START_TIMEOUT_S:.0f}s ({type(exc).__name__}); see {log}"
                ) from exc
            time.sleep(1.0)
    try:
        declare_event_topology(connection.channel(), settings.amqp)
    finally:
        connection.close()
    echo(f"rabbitmq: running (pid {pid}, amqp port {port}, management {settings.amqp.management_url})")


def stop_epmd(layout: Layout) -> None:
    """Stop epmd if our RabbitMQ started it and no Erlang node uses it any more."""
    marker = layout.pids / "epmd.owned"
    epmd = shutil.which("epmd")
    if not marker.exists() or epmd is None:
        return
    names = subprocess.run([epmd, "-names"], capture_output=True, text=True, timeout=10).stdout
    if not any(line.startswith("name ") for line in names.splitlines()):
        subprocess.run([epmd, "-kill"], capture_output=True, timeout=10)
    marker.unlink(missing_ok=True)

"""The local stack without Docker: RabbitMQ, MinIO, a Ray head node and the vidx Serve app.

Everything lives under ``settings.state_dir``: ``minio/data``, ``minio/queue``, ``rabbitmq/``, ``ray/``,
``logs/`` and ``pids/``. Each service runs in its own session (process group) so that ``down`` can end
exactly what ``up`` started, never processes found by name (``ray stop`` would kill every Ray on the host).
Ray is started with ``ray start --head --block``: that process owns the node and tears it down on SIGTERM.
Serve is driven from a short-lived driver subprocess (``python -m pipeline.stack ACTION ADDRESS``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pipeline.errors import VidxError
from pipeline.settings import Settings

#: Not /usr/sbin/rabbitmq-server: run as root, that wrapper su's to the rabbitmq user and drops our env.
RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
RABBITMQ_NODENAME = "vidx@localhost"
#: Above the longest index job, so a late ack never makes RabbitMQ close the consumer's channel.
RABBITMQ_CONSUMER_TIMEOUT_MS = 3_600_000
RABBITMQ_START_TIMEOUT_S = 90.0
RABBITMQ_STOP_TIMEOUT_S = 60.0
EPMD_PORT = 4369
MINIO_INSTALLER = Path(__file__).resolve().parents[1] / "infra/local/install-minio.sh"
#: First run builds MinIO from source with ``go install``.
MINIO_BUILD_TIMEOUT_S = 1200.0
MINIO_START_TIMEOUT_S = 60.0
MINIO_STOP_TIMEOUT_S = 30.0
RAY_GCS_PORT = 6379
RAY_START_TIMEOUT_S = 120.0
RAY_STOP_TIMEOUT_S = 60.0
#: Ray's unix socket paths (under the temp dir) must stay below 107 characters.
RAY_TEMP_MAX_CHARS = 40
#: Model loading on a small CPU machine is slow; a hub download is slower.
APP_START_TIMEOUT_S = 600.0
HEALTH_TIMEOUT_S = 120.0
DRIVER_TIMEOUT_S = 90.0
GROUP_EXIT_TIMEOUT_S = 10.0
POLL_S = 0.5
RUNNING = "RUNNING"


class StackError(VidxError):
    """Raised when a local service can't be started, checked or stopped (one line, names the log)."""


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    running: bool
    detail: str
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


Echo = Callable[[str], None]


@dataclass(frozen=True)
class Layout:
    """Where the local stack keeps its state."""

    root: Path

    @classmethod
    def of(cls, settings: Settings) -> Layout:
        return cls(settings.state_dir.resolve())

    def create(self) -> None:
        for path in (self.minio_data, self.minio_queue, self.root / "rabbitmq", self.logs, self.pids):
            path.mkdir(parents=True, exist_ok=True)

    @property
    def minio_data(self) -> Path:
        return self.root / "minio" / "data"

    @property
    def minio_queue(self) -> Path:
        return self.root / "minio" / "queue"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    @property
    def ray_temp(self) -> Path:
        path = self.root / "ray"
        return path if len(str(path)) <= RAY_TEMP_MAX_CHARS else Path(f"/tmp/vidx-ray-{os.getuid()}")


# -- processes ------------------------------------------------------------------------------------------

#: What each pid file's process has in its command line (guards against a recycled pid).
_MARKERS = {"rabbitmq": "rabbitmq-server", "minio": "minio server", "ray": "ray start"}


def _alive(pid: int) -> bool:
    with contextlib.suppress(ChildProcessError):
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our own child that exited: reap it
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def _pid(layout: Layout, name: str) -> int | None:
    """The pid of our running ``name`` service, or None (a stale pid file is removed)."""
    path = layout.pids / f"{name}.pid"
    try:
        pid = int(path.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError):
        path.unlink(missing_ok=True)
        return None
    if _MARKERS[name] in cmdline and _alive(pid):
        return pid
    path.unlink(missing_ok=True)
    return None


def _spawn(layout: Layout, name: str, argv: list[str], env: dict[str, str]) -> int:
    """Start ``argv`` in a new session, output appended to logs/NAME.log; records and returns its pid."""
    log = layout.log(name)
    with log.open("ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n".encode())
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, str(log), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    try:
        pid = os.posix_spawn(argv[0], argv, env, file_actions=actions, setsid=True)
    except OSError as exc:
        raise StackError(f"could not start {name} ({argv[0]}): {exc.strerror}") from exc
    (layout.pids / f"{name}.pid").write_text(f"{pid}\n")
    return pid


def _stop(layout: Layout, name: str, timeout_s: float) -> bool:
    """SIGTERM our ``name`` service, wait (bounded), then SIGKILL its process group. Returns if it ran."""
    pid = _pid(layout, name)
    if pid is None:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    _wait(lambda: not _alive(pid), timeout_s)
    # The session leader may be gone while its children linger: end the group it leads.
    if not _wait(lambda: not _group_alive(pid), GROUP_EXIT_TIMEOUT_S if _alive(pid) else 2.0):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        _wait(lambda: not _alive(pid), GROUP_EXIT_TIMEOUT_S)
    (layout.pids / f"{name}.pid").unlink(missing_ok=True)
    return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _wait(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if done():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or default_port


def _taken(port: int, what: str, hint: str) -> StackError:
    return StackError(f"port {port} ({what}) is already in use by a process vidx did not start{hint}")


# -- RabbitMQ -------------------------------------------------------------------------------------------


def _rabbitmq_env(settings: Settings, layout: Layout) -> dict[str, str]:
    _, amqp_port = _host_port(settings.amqp.url.get_secret_value(), 5672)
    _, mgmt_port = _host_port(settings.amqp.management_url, 15672)
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


def _start_rabbitmq(settings: Settings, layout: Layout, echo: Echo) -> None:
    url = settings.amqp.url.get_secret_value()
    host, port = _host_port(url, 5672)
    log = layout.log("rabbitmq")
    if (pid := _pid(layout, "rabbitmq")) is None:
        if _port_open(host, port):
            hint = ": a system RabbitMQ? stop it (systemctl stop rabbitmq-server) or change VIDX_AMQP__URL"
            raise _taken(port, "AMQP", hint)
        if not RABBITMQ_SERVER.exists():
            raise StackError(f"{RABBITMQ_SERVER} not found: apt-get install rabbitmq-server")
        marker = layout.pids / "epmd.owned"
        if not _port_open("127.0.0.1", EPMD_PORT):
            marker.touch()  # the Erlang VM will start epmd for us: down stops it
        pid = _spawn(layout, "rabbitmq", [str(RABBITMQ_SERVER)], _rabbitmq_env(settings, layout))
        echo(f"rabbitmq: starting (pid {pid})")
    import pika
    import pika.exceptions

    from events.subscribe import declare_event_topology

    deadline = time.monotonic() + RABBITMQ_START_TIMEOUT_S
    while True:
        if not _alive(pid):
            raise StackError(f"RabbitMQ exited during start-up; see {log} and {layout.logs / 'rabbitmq'}/")
        try:
            params = pika.URLParameters(url)
            params.connection_attempts, params.socket_timeout = 1, 5
            connection = pika.BlockingConnection(params)
            break
        except pika.exceptions.AMQPError as exc:
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


def _stop_epmd(layout: Layout) -> None:
    marker = layout.pids / "epmd.owned"
    epmd = shutil.which("epmd")
    if not marker.exists() or epmd is None:
        return
    names = subprocess.run([epmd, "-names"], capture_output=True, text=True, timeout=10).stdout
    if not any(line.startswith("name ") for line in names.splitlines()):
        subprocess.run([epmd, "-kill"], capture_output=True, timeout=10)
    marker.unlink(missing_ok=True)


# -- MinIO ----------------------------------------------------------------------------------------------


def minio_client(settings: Settings) -> Any:
    from minio import Minio

    s3 = settings.s3
    parsed = urlparse(s3.endpoint_url)
    return Minio(
        parsed.netloc,
        access_key=s3.access_key.get_secret_value(),
        secret_key=s3.secret_key.get_secret_value(),
        secure=parsed.scheme == "https",
        region=s3.region,
    )


def _minio_binary(layout: Layout) -> str:
    try:
        done = subprocess.run(
            ["bash", str(MINIO_INSTALLER)], capture_output=True, text=True, timeout=MINIO_BUILD_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise StackError(f"building MinIO took over {MINIO_BUILD_TIMEOUT_S:.0f}s; run {MINIO_INSTALLER}") from exc
    if done.returncode != 0 or not done.stdout.strip():
        layout.log("minio-install").write_text(done.stderr)
        raise StackError(f"{MINIO_INSTALLER.name} failed; see {layout.log('minio-install')}")
    return done.stdout.strip().splitlines()[-1]


def _start_minio(settings: Settings, layout: Layout, echo: Echo) -> None:
    from events.subscribe import minio_notify_env, prepare_buckets

    host, port = _host_port(settings.s3.endpoint_url, 9000)
    log = layout.log("minio")
    if (pid := _pid(layout, "minio")) is None:
        if _port_open(host, port):
            raise _taken(port, "S3", ": set VIDX_S3__ENDPOINT_URL to another port")
        env = {
            **os.environ,
            "MINIO_ROOT_USER": settings.s3.access_key.get_secret_value(),
            "MINIO_ROOT_PASSWORD": settings.s3.secret_key.get_secret_value(),
            **minio_notify_env(settings.amqp, settings.amqp.url.get_secret_value(), layout.minio_queue),
        }
        argv = [
            _minio_binary(layout),
            "server",
            str(layout.minio_data),
            "--address",
            f"{host}:{port}",
            "--console-address",
            f"{host}:{port + 1}",
        ]
        pid = _spawn(layout, "minio", argv, env)
        echo(f"minio: starting (pid {pid})")
    import httpx

    def live() -> bool:
        if not _alive(pid):
            raise StackError(f"MinIO exited during start-up; see {log}")
        try:
            return httpx.get(f"{settings.s3.endpoint_url}/minio/health/live", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    if not _wait(live, MINIO_START_TIMEOUT_S):
        raise StackError(f"MinIO was not live within {MINIO_START_TIMEOUT_S:.0f}s; see {log}")
    client = minio_client(settings)
    try:
        prepare_buckets(client, settings.s3.buckets, settings.s3.index_bucket, settings.amqp.queue_arn)
    except Exception as exc:  # minio raises S3Error, urllib3 errors, ValueError
        raise StackError(f"setting up buckets failed ({type(exc).__name__}: {exc}); see {log}") from exc
    echo(
        f"minio: running (pid {pid}, {settings.s3.endpoint_url}, console http://{host}:{port + 1}); "
        f"buckets {', '.join(settings.s3.buckets)} publish events to {settings.amqp.queue_arn}"
    )


# -- Ray and the Serve app ------------------------------------------------------------------------------


def _child_env(settings: Settings, layout: Layout) -> dict[str, str]:
    """Environment of Ray and drivers: Ray workers have another cwd, so relative paths are made absolute."""
    token = layout.root / "ray-auth-token"
    if not token.exists():
        token.touch(mode=0o600)
        token.write_text(secrets.token_hex(32))
    env = {
        **os.environ,
        "VIDX_STATE_DIR": str(layout.root),
        "RAY_USAGE_STATS_ENABLED": "0",
        # Our own token, not ~/.ray/auth_token (which another Ray on this host may have made).
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        # Single-node mode: Ray's node IP is 127.0.0.1, not the host's address.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        # We shut Serve down first: don't wait for a drain on SIGTERM.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    }
    env.pop("RAY_AUTH_TOKEN", None)
    if Path(settings.model.id).is_dir():
        env["VIDX_MODEL__ID"] = str(Path(settings.model.id).resolve())
    return env


def _ray_address() -> str:
    return f"127.0.0.1:{RAY_GCS_PORT}"


def _start_ray(settings: Settings, layout: Layout, echo: Echo) -> None:
    log = layout.log("ray")
    address_file = layout.ray_temp / "ray_current_cluster"
    if (pid := _pid(layout, "ray")) is None:
        if _port_open("127.0.0.1", RAY_GCS_PORT):
            raise _taken(RAY_GCS_PORT, "Ray GCS", ": another Ray cluster runs here")
        if _port_open(settings.serve.host, settings.serve.port):
            raise _taken(settings.serve.port, "Serve HTTP", ": set VIDX_SERVE__PORT to another port")
        layout.ray_temp.mkdir(parents=True, exist_ok=True)
        address_file.unlink(missing_ok=True)
        ray = Path(sys.executable).with_name("ray")
        num_cpus = settings.serve.ray_num_cpus or os.cpu_count() or 1
        argv = [
            str(ray),
            "start",
            "--head",
            "--block",
            "--port",
            str(RAY_GCS_PORT),
            "--num-cpus",
            str(num_cpus),
            "--disable-usage-stats",
            "--include-dashboard=false",
            "--temp-dir",
            str(layout.ray_temp),
        ]
        pid = _spawn(layout, "ray", argv, _child_env(settings, layout))
        echo(f"ray: starting (pid {pid}, {num_cpus} CPUs)")

    def started() -> bool:
        if not _alive(pid):
            raise StackError(f"ray start exited during start-up; see {log}")
        return address_file.exists()

    if not _wait(started, RAY_START_TIMEOUT_S):
        raise StackError(f"Ray did not start within {RAY_START_TIMEOUT_S:.0f}s; see {log}")
    echo(f"ray: running (pid {pid}, address {_ray_address()}, temp dir {layout.ray_temp})")


def _driver(settings: Settings, layout: Layout, action: str, timeout_s: float) -> dict[str, Any]:
    """Run ``python -m pipeline.stack ACTION`` against our Ray cluster; returns its JSON answer."""
    log = layout.log("serve")
    with log.open("ab") as err:
        try:
            done = subprocess.run(
                [sys.executable, "-m", "pipeline.stack", action, _ray_address()],
                stdout=subprocess.PIPE,
                stderr=err,
                env=_child_env(settings, layout),
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise StackError(f"Serve '{action}' did not finish within {timeout_s:.0f}s; see {log}") from exc
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    try:
        answer: dict[str, Any] = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError) as exc:
        raise StackError(f"Serve '{action}' failed (exit {done.returncode}); see {log}") from exc
    if answer.get("error"):
        raise StackError(f"{answer['error']}; see {log} and {layout.ray_temp}/session_latest/logs/serve/")
    return answer


def _healthy(settings: Settings) -> bool:
    import httpx

    try:
        return httpx.get(f"{settings.api_url}/healthz", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def _start_app(settings: Settings, layout: Layout, echo: Echo) -> None:
    name = settings.serve.app_name
    if _healthy(settings) and _driver(settings, layout, "app-status", DRIVER_TIMEOUT_S)["status"] == RUNNING:
        echo(f"app: {name} already running")
        return
    echo(f"app: deploying {name} (model {settings.model.id}; up to {APP_START_TIMEOUT_S:.0f}s)")
    _driver(settings, layout, "deploy", APP_START_TIMEOUT_S + DRIVER_TIMEOUT_S)
    if not _wait(lambda: _healthy(settings), HEALTH_TIMEOUT_S):
        raise StackError(
            f"{settings.api_url}/healthz did not answer 200 within {HEALTH_TIMEOUT_S:.0f}s; "
            f"see {layout.ray_temp}/session_latest/logs/serve/"
        )
    echo(f"app: {name} running at {settings.api_url}")


# -- the stack ------------------------------------------------------------------------------------------


def up(settings: Settings, echo: Echo = print) -> None:
    """Start (or leave running) RabbitMQ, MinIO, Ray and the Serve app. Raises StackError."""
    layout = Layout.of(settings)
    layout.create()
    _start_rabbitmq(settings, layout, echo)
    _start_minio(settings, layout, echo)
    _start_ray(settings, layout, echo)
    _start_app(settings, layout, echo)
    echo(
        f"vidx is up: API {settings.api_url}  (logs: {layout.logs}/, Serve logs: "
        f"{layout.ray_temp}/session_latest/logs/serve/; stop with 'vidx down')"
    )


def down(settings: Settings, echo: Echo = print) -> None:
    """Stop what ``up`` started, newest first; idempotent. Raises StackError if something won't stop."""
    layout = Layout.of(settings)
    if not layout.pids.exists():
        echo("nothing to stop")
        return
    if _pid(layout, "ray") is not None:
        try:
            _driver(settings, layout, "shutdown", DRIVER_TIMEOUT_S)
            echo("app: serve shut down")
        except StackError as exc:  # stopping the node below ends the replicas anyway
            echo(f"app: {exc}")
    for name, timeout_s in (
        ("ray", RAY_STOP_TIMEOUT_S),
        ("minio", MINIO_STOP_TIMEOUT_S),
        ("rabbitmq", RABBITMQ_STOP_TIMEOUT_S),
    ):
        echo(f"{name}: {'stopped' if _stop(layout, name, timeout_s) else 'not running'}")
        if _pid(layout, name) is not None:
            raise StackError(f"{name} did not stop; see {layout.log(name)}")
    _stop_epmd(layout)


def status(settings: Settings) -> list[ComponentStatus]:
    """Each component: running or stopped, with pid, ports and URLs; the app with its Serve status."""
    layout = Layout.of(settings)
    _, amqp_port = _host_port(settings.amqp.url.get_secret_value(), 5672)
    out: list[ComponentStatus] = []
    for name, where in (
        ("rabbitmq", f"amqp port {amqp_port}, management {settings.amqp.management_url}"),
        ("minio", settings.s3.endpoint_url),
        ("ray", _ray_address()),
    ):
        pid = _pid(layout, name) if layout.pids.exists() else None
        detail = f"pid {pid}, {where}" if pid else "stopped"
        out.append(ComponentStatus(name, pid is not None, detail, {"pid": pid, "address": where}))
    app: dict[str, Any] = {"url": settings.api_url, "status": "NOT_STARTED"}
    if out[-1].running:
        try:
            app.update(_driver(settings, layout, "app-status", DRIVER_TIMEOUT_S))
        except StackError as exc:
            app["status"] = f"unknown ({exc})"
    app["healthy"] = _healthy(settings) if out[-1].running else False
    running = app["status"] == RUNNING and app["healthy"]
    detail = f"{app['status']} at {settings.api_url}" if out[-1].running else "stopped"
    out.append(ComponentStatus("app", running, detail, app))
    return out


# -- Serve driver (runs in a subprocess, prints one JSON line) ------------------------------------------


def _serve_action(action: str, address: str) -> dict[str, Any]:
    import ray
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    settings = Settings()
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    name = settings.serve.app_name
    if action == "shutdown":
        serve.shutdown()
        return {"status": "SHUTDOWN"}
    if action == "deploy":
        from pipeline.deployments import build_app

        serve.start(http_options={"host": settings.serve.host, "port": settings.serve.port})
        target = serve.RunTarget(build_app(settings), name=name, route_prefix=settings.serve.route_prefix)
        serve.run_many([target], wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    deadline = time.monotonic() + (APP_START_TIMEOUT_S if action == "deploy" else 0)
    while True:
        try:
            app = serve.status().applications.get(name)
        except Exception as exc:  # no Serve controller yet
            print(f"serve.status: {exc!r}", file=sys.stderr)
            app = None
        if app is None:
            return {"status": "NOT_STARTED"}
        deployments = {d: s.status.value for d, s in app.deployments.items()}
        if action != "deploy" or app.status == ApplicationStatus.RUNNING:
            return {"status": app.status.value, "deployments": deployments}
        if app.status == ApplicationStatus.DEPLOY_FAILED or time.monotonic() >= deadline:
            failed = [(d, s.message) for d, s in app.deployments.items() if s.message]
            failed = failed or [(name, app.message)]
            for d, message in failed:
                print(f"--- {d}: {message}", file=sys.stderr)
            last = [ln.strip() for ln in failed[0][1].splitlines() if ln.strip()] or ["no message"]
            state = "failed" if app.status == ApplicationStatus.DEPLOY_FAILED else "timed out"
            error = f"Serve app {name} {state}: {failed[0][0]}: {last[-1]}"
            return {"status": app.status.value, "error": error}
        time.sleep(2.0)


if __name__ == "__main__":
    print(json.dumps(_serve_action(sys.argv[1], sys.argv[2])), flush=True)

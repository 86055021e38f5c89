"""The Ray head node of the local stack, and the environment of Ray and of Serve drivers.

Ray is started with ``ray start --head --block``: that process owns the node and tears it down on SIGTERM.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from infra.dev.stack.keys import key_env
from infra.dev.stack.layout import Echo, Layout, StackError
from infra.dev.stack.process import alive, port_open, running_pid, spawn, taken, wait
from pipeline.serve.resources import RAY_NODE_ENV
from pipeline.settings import Settings

RAY_GCS_PORT = 6379
RAY_START_TIMEOUT_S = 120.0
RAY_STOP_TIMEOUT_S = 60.0


def child_env(settings: Settings, layout: Layout) -> dict[str, str]:
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
        **RAY_NODE_ENV,
    }
    env.pop("RAY_AUTH_TOKEN", None)
    # The app reads its keys from the stack's key files (paths only: keys stay out of environments).
    env.update(key_env(settings, layout))
    # The driver rebuilds Settings from this environment: hand it the model this stack was asked for.
    model = Path(settings.model.id)
    env["VIDX_MODEL__ID"] = str(model.resolve()) if model.is_dir() else settings.model.id
    return env


def ray_address() -> str:
    return f"127.0.0.1:{RAY_GCS_PORT}"


def dashboard_url(settings: Settings) -> str:
    """The Ray dashboard of the local stack (bound to loopback: it has no authentication of its own)."""
    return f"http://127.0.0.1:{settings.serve.ray_dashboard_port}"


def start_ray(settings: Settings, layout: Layout, echo: Echo) -> None:
    """Start the Ray head (or reuse ours) and wait until it has written its address. Raises StackError."""
    log = layout.log("ray")
    address_file = layout.ray_temp / "ray_current_cluster"
    if (pid := running_pid(layout, "ray")) is None:
        if port_open("127.0.0.1", RAY_GCS_PORT):
            raise taken(RAY_GCS_PORT, "Ray GCS", ": another Ray cluster runs here")
        if port_open(settings.serve.host, settings.serve.port):
            raise taken(settings.serve.port, "Serve HTTP", ": set VIDX_SERVE__PORT to another port")
        dashboard_port = settings.serve.ray_dashboard_port
        if port_open("127.0.0.1", dashboard_port):
            raise taken(dashboard_port, "Ray dashboard", ": set VIDX_SERVE__RAY_DASHBOARD_PORT to another port")
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
            "--include-dashboard=true",
            "--dashboard-host",
            "127.0.0.1",
            "--dashboard-port",
            str(dashboard_port),
            "--temp-dir",
            str(layout.ray_temp),
        ]
        pid = spawn(layout, "ray", argv, child_env(settings, layout))
        echo(f"ray: starting (pid {pid}, {num_cpus} CPUs)")

    def started() -> bool:
        if not alive(pid):
            raise StackError(f"ray start exited during start-up; see {log}")
        return address_file.exists()

    if not wait(started, RAY_START_TIMEOUT_S):
        raise StackError(f"Ray did not start within {RAY_START_TIMEOUT_S:.0f}s; see {log}")
    url = dashboard_url(settings)
    token = layout.root / "ray-auth-token"
    echo(f"ray: running (pid {pid}, address {ray_address()}, temp dir {layout.ray_temp})")
    echo(f"ray: dashboard {url} (it asks for the Ray auth token in {token})")

"""The local stack without Docker: RabbitMQ, MinIO, a Ray head node and the vidx Serve app.

Everything lives under ``settings.state_dir``: ``minio/data``, ``minio/queue``, ``rabbitmq/``, ``ray/``,
``logs/`` and ``pids/``. Each service runs in its own session (process group) so that ``down`` can end
exactly what ``up`` started (``process.py``). Serve is driven from a short-lived driver subprocess
(``python -m infra.dev.stack ACTION ADDRESS``, ``app.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from infra.dev.stack.app import DRIVER_TIMEOUT_S, RUNNING, healthy, run_driver, start_app
from infra.dev.stack.keys import StackKeys, ensure_keys
from infra.dev.stack.layout import Echo, Layout, StackError
from infra.dev.stack.minio import MINIO_STOP_TIMEOUT_S, minio_client, start_minio
from infra.dev.stack.process import host_port, running_pid, stop
from infra.dev.stack.rabbitmq import RABBITMQ_STOP_TIMEOUT_S, start_rabbitmq, stop_epmd
from infra.dev.stack.ray import RAY_STOP_TIMEOUT_S, dashboard_url, ray_address, start_ray
from pipeline.cli.errors import redact
from pipeline.settings import Settings

__all__ = [
    "ComponentStatus",
    "Echo",
    "Layout",
    "StackError",
    "StackKeys",
    "down",
    "minio_client",
    "status",
    "up",
]


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    running: bool
    detail: str
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def up(settings: Settings, echo: Echo = print) -> None:
    """Start (or leave running) RabbitMQ, MinIO, Ray and the Serve app. Raises StackError."""
    layout = Layout.of(settings)
    layout.create()
    keys = ensure_keys(settings, layout)
    start_rabbitmq(settings, layout, echo)
    start_minio(settings, layout, echo)
    start_ray(settings, layout, echo)
    start_app(settings, layout, echo)
    echo(
        f"vidx is up: API {settings.api_url}  (logs: {layout.logs}/, Serve logs: "
        f"{layout.ray_temp}/session_latest/logs/serve/; stop with 'vidx down')"
    )
    echo(describe_keys(keys))


def describe_keys(keys: StackKeys) -> str:
    """Where the keys are, never the keys themselves."""
    api = f"API key in {keys.api_key_file}" if keys.api_key_file else "API keys from your settings"
    admin = f"admin key in {keys.admin_key_file}" if keys.admin_key_file else "admin key from your settings"
    hint = (
        f'; the vidx CLI sends it, curl: -H "Authorization: Bearer $(cat {keys.api_key_file})"'
        if keys.api_key_file
        else ""
    )
    return f"keys: {api}, {admin} (kept by 'vidx down'){hint}"


def down(settings: Settings, echo: Echo = print) -> None:
    """Stop what ``up`` started, newest first; idempotent. Raises StackError if something won't stop."""
    layout = Layout.of(settings)
    if not layout.pids.exists():
        echo("nothing to stop")
        return
    if running_pid(layout, "ray") is not None:
        try:
            run_driver(settings, layout, "shutdown", DRIVER_TIMEOUT_S)
            echo("app: serve shut down")
        except StackError as exc:  # stopping the node below ends the replicas anyway
            echo(f"app: {exc}")
    for name, timeout_s in (
        ("ray", RAY_STOP_TIMEOUT_S),
        ("minio", MINIO_STOP_TIMEOUT_S),
        ("rabbitmq", RABBITMQ_STOP_TIMEOUT_S),
    ):
        echo(f"{name}: {'stopped' if stop(layout, name, timeout_s) else 'not running'}")
        if running_pid(layout, name) is not None:
            raise StackError(f"{name} did not stop; see {layout.log(name)}")
    stop_epmd(layout)


def status(settings: Settings) -> list[ComponentStatus]:
    """Each component: running or stopped, with pid, ports and URLs; the app with its Serve status."""
    layout = Layout.of(settings)
    _, amqp_port = host_port(settings.amqp.url.get_secret_value(), 5672)
    out: list[ComponentStatus] = []
    for name, where in (
        ("rabbitmq", f"amqp port {amqp_port}, management {redact(settings.amqp.management_url)}"),
        ("minio", settings.s3.endpoint_url),
        ("ray", f"{ray_address()}, dashboard {dashboard_url(settings)}"),
    ):
        pid = running_pid(layout, name) if layout.pids.exists() else None
        detail = f"pid {pid}, {where}" if pid else "stopped"
        out.append(ComponentStatus(name, pid is not None, detail, {"pid": pid, "address": where}))
    app: dict[str, Any] = {"url": settings.api_url, "status": "NOT_STARTED"}
    if out[-1].running:
        try:
            app.update(run_driver(settings, layout, "app-status", DRIVER_TIMEOUT_S))
        except StackError as exc:
            app["status"] = f"unknown ({exc})"
    app["healthy"] = healthy(settings) if out[-1].running else False
    app["api_key_file"] = str(layout.api_key_file) if layout.api_key_file.exists() else None
    running = app["status"] == RUNNING and app["healthy"]
    detail = f"{app['status']} at {settings.api_url} (the page: {settings.api_url}/)" if out[-1].running else "stopped"
    if out[-1].running and app["api_key_file"]:
        detail += f", API key in {app['api_key_file']}"
    out.append(ComponentStatus("app", running, detail, app))
    return out

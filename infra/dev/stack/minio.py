"""MinIO of the local stack: the binary (built on first use), start-up, buckets and their event targets."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from infra.dev.stack.layout import Echo, Layout, StackError
from infra.dev.stack.process import alive, host_port, port_open, running_pid, spawn, taken, wait
from pipeline.cli.common import minio_client
from pipeline.settings import Settings

# parents[3]: infra/dev/stack/minio.py -> stack -> dev -> infra -> the repository root.
MINIO_INSTALLER = Path(__file__).resolve().parents[3] / "infra/local/install-minio.sh"
#: First run builds MinIO from source with ``go install``.
MINIO_BUILD_TIMEOUT_S = 1200.0
MINIO_START_TIMEOUT_S = 60.0
MINIO_STOP_TIMEOUT_S = 30.0


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


def start_minio(settings: Settings, layout: Layout, echo: Echo) -> None:
    """Start MinIO (or reuse ours), wait until live and prepare the buckets. Raises StackError."""
    from events.subscribe import minio_notify_env, prepare_buckets

    host, port = host_port(settings.s3.endpoint_url, 9000)
    log = layout.log("minio")
    if (pid := running_pid(layout, "minio")) is None:
        if port_open(host, port):
            raise taken(port, "S3", ": set VIDX_S3__ENDPOINT_URL to another port")
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
        pid = spawn(layout, "minio", argv, env)
        echo(f"minio: starting (pid {pid})")
    import httpx

    def live() -> bool:
        if not alive(pid):
            raise StackError(f"MinIO exited during start-up; see {log}")
        try:
            return httpx.get(f"{settings.s3.endpoint_url}/minio/health/live", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    if not wait(live, MINIO_START_TIMEOUT_S):
        raise StackError(f"MinIO was not live within {MINIO_START_TIMEOUT_S:.0f}s; see {log}")
    client = minio_client(settings)
    try:
        prepare_buckets(client, settings.s3.buckets, settings.s3.index_bucket, settings.amqp.queue_arns)
    except Exception as exc:  # minio raises S3Error, urllib3 errors, ValueError
        raise StackError(f"setting up buckets failed ({type(exc).__name__}: {exc}); see {log}") from exc
    echo(
        f"minio: running (pid {pid}, {settings.s3.endpoint_url}, console http://{host}:{port + 1}); "
        f"buckets {', '.join(settings.s3.buckets)} publish events to {' and '.join(settings.amqp.queue_arns)}"
    )

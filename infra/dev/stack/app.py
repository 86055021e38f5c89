"""The vidx Serve app on our Ray head, driven from a short-lived driver subprocess.

``run_driver`` runs ``python -m infra.dev.stack ACTION ADDRESS`` (see ``__main__.py``); in that subprocess
``serve_action`` deploys, checks or shuts down the app and the driver prints one JSON line as its answer.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from typing import Any

from infra.dev.stack.layout import Echo, Layout, StackError
from infra.dev.stack.process import wait
from infra.dev.stack.ray import child_env, ray_address
from pipeline.settings import Settings

#: Model loading on a small CPU machine is slow; a hub download is slower.
APP_START_TIMEOUT_S = 600.0
HEALTH_TIMEOUT_S = 120.0
DRIVER_TIMEOUT_S = 90.0
RUNNING = "RUNNING"


def run_driver(settings: Settings, layout: Layout, action: str, timeout_s: float) -> dict[str, Any]:
    """Run ``python -m infra.dev.stack ACTION`` against our Ray cluster; returns its JSON answer.

    Raises StackError if it times out, fails or answers with an error.
    """
    log = layout.log("serve")
    with log.open("ab") as err:
        try:
            done = subprocess.run(
                [sys.executable, "-m", "infra.dev.stack", action, ray_address()],
                stdout=subprocess.PIPE,
                stderr=err,
                env=child_env(settings, layout),
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


def healthy(settings: Settings) -> bool:
    import httpx

    try:
        return httpx.get(f"{settings.api_url}/healthz", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def start_app(settings: Settings, layout: Layout, echo: Echo) -> None:
    """Deploy the Serve app unless it runs, and wait until the API is healthy. Raises StackError."""
    name = settings.serve.app_name
    if healthy(settings) and run_driver(settings, layout, "app-status", DRIVER_TIMEOUT_S)["status"] == RUNNING:
        echo(f"app: {name} already running")
        return
    echo(f"app: deploying {name} (model {settings.model.id}; up to {APP_START_TIMEOUT_S:.0f}s)")
    run_driver(settings, layout, "deploy", APP_START_TIMEOUT_S + DRIVER_TIMEOUT_S)
    if not wait(lambda: healthy(settings), HEALTH_TIMEOUT_S):
        raise StackError(
            f"{settings.api_url}/healthz did not answer 200 within {HEALTH_TIMEOUT_S:.0f}s; "
            f"see {layout.ray_temp}/session_latest/logs/serve/"
        )
    echo(f"app: {name} running at {settings.api_url}")


# -- the driver side (runs in the subprocess) -----------------------------------------------------------


def serve_action(action: str, address: str) -> dict[str, Any]:
    """Do ``action`` (deploy, app-status or shutdown) on the Ray cluster at ``address``; the JSON answer."""
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
        from pipeline.serve.app import build_app

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

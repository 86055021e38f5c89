"""Several Ray nodes on this machine, for ``python -m bench.flood --nodes N``: ``ray start --head`` and
``ray start --address …`` for each further node, as an operator would start them on separate hosts.

On exit the nodes are stopped with ``ray stop --force``, which stops *every* Ray process of this
machine: don't run it beside tests or another benchmark.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import ROOT
from pipeline.serve.resources import RAY_NODE_ENV

#: Longest wait for one ``ray start``/``ray stop``, and for every node to register.
START_TIMEOUT_S = 180.0


#: One token for every cluster this process starts: Ray reads the token once per process and keeps it,
#: so a second cluster with a token of its own would refuse this process (bench.ha starts three).
_PROCESS_TOKEN = secrets.token_hex(32)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ray_cli(*args: str) -> None:
    ray = Path(sys.executable).parent / "ray"
    env = {
        **os.environ,
        **RAY_NODE_ENV,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":"),
    }
    done = subprocess.run(
        [str(ray), *args], cwd=ROOT, env=env, timeout=START_TIMEOUT_S, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
        raise RuntimeError(f"ray {args[0]} failed ({done.returncode}): {last}")


def alive_nodes(address: str) -> int:
    from ray.util.state import list_nodes

    return sum(1 for n in list_nodes(address=address, raise_on_missing_output=False) if n.state == "ALIVE")


@contextmanager
def local_cluster(nodes: int, cpus_per_node: int) -> Iterator[str]:
    """Start ``nodes`` Ray nodes of ``cpus_per_node`` logical CPUs each; yields the head's address.
    The nodes and this process share a token of their own (Ray's token authentication, as the local
    stack does: ``infra/dev/stack/ray.py``; the same for every cluster of this process), set in
    ``os.environ`` while the cluster runs."""
    port, dashboard = _free_port(), _free_port()
    address = f"127.0.0.1:{port}"
    tmp = Path(tempfile.mkdtemp(prefix="vidx-cluster-"))
    token = tmp / "ray-auth-token"
    token.touch(mode=0o600)
    token.write_text(_PROCESS_TOKEN)
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    saved = {k: os.environ.get(k) for k in [*auth, "RAY_AUTH_TOKEN"]}
    os.environ.update(auth)
    os.environ.pop("RAY_AUTH_TOKEN", None)
    try:
        ray_cli(
            "start",
            "--head",
            f"--port={port}",
            f"--num-cpus={cpus_per_node}",
            "--include-dashboard=true",
            f"--dashboard-port={dashboard}",
            "--disable-usage-stats",
        )
        for _ in range(nodes - 1):
            ray_cli("start", f"--address={address}", f"--num-cpus={cpus_per_node}", "--disable-usage-stats")
        deadline = time.monotonic() + START_TIMEOUT_S
        while alive_nodes(address) < nodes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {nodes} Ray nodes after {START_TIMEOUT_S:g}s")
            time.sleep(1)
        yield address
    finally:
        try:
            ray_cli("stop", "--force")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            shutil.rmtree(tmp, ignore_errors=True)


def replica_nodes(app_name: str, deployment: str) -> dict[str, int]:
    """Node id -> replicas of ``deployment`` placed there over the run (dead ones included: a fleet
    that scaled down still shows where it ran)."""
    import ray
    from ray.util.state import list_actors

    actors: list[Any] = list_actors(
        address=ray.get_runtime_context().gcs_address,
        filters=[("class_name", "=", f"ServeReplica:{app_name}:{deployment}")],
        limit=10_000,
        raise_on_missing_output=False,
    )
    out: dict[str, int] = {}
    for a in actors:
        if a.node_id:
            out[a.node_id] = out.get(a.node_id, 0) + 1
    return out

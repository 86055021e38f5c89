"""Several Ray nodes on this machine, for ``python -m bench.flood --nodes N``: ``ray start --head`` and
``ray start --address …`` for each further node, as an operator would start them on separate hosts.

On exit the nodes are stopped with ``ray stop --force``, which stops *every* Ray process of this
machine: don't run it beside tests or another benchmark.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.common import ROOT

#: Longest wait for one ``ray start``/``ray stop``, and for every node to register.
START_TIMEOUT_S = 180.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ray(*args: str) -> None:
    ray = Path(sys.executable).parent / "ray"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":")}
    subprocess.run(
        [str(ray), *args],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=START_TIMEOUT_S,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def alive_nodes(address: str) -> int:
    from ray.util.state import list_nodes

    return sum(1 for n in list_nodes(address=address, raise_on_missing_output=False) if n.state == "ALIVE")


@contextmanager
def local_cluster(nodes: int, cpus_per_node: int) -> Iterator[str]:
    """Start ``nodes`` Ray nodes of ``cpus_per_node`` logical CPUs each; yields the head's address."""
    port, dashboard = _free_port(), _free_port()
    address = f"127.0.0.1:{port}"
    try:
        _ray(
            "start",
            "--head",
            f"--port={port}",
            f"--num-cpus={cpus_per_node}",
            "--include-dashboard=true",
            f"--dashboard-port={dashboard}",
            "--disable-usage-stats",
        )
        for _ in range(nodes - 1):
            _ray("start", f"--address={address}", f"--num-cpus={cpus_per_node}", "--disable-usage-stats")
        deadline = time.monotonic() + START_TIMEOUT_S
        while alive_nodes(address) < nodes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {nodes} Ray nodes after {START_TIMEOUT_S:g}s")
            time.sleep(1)
        yield address
    finally:
        _ray("stop", "--force")


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

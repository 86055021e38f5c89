"""Stopping the app's local Ray instance within a bound (``start_app``'s exit).

A CI run hung for 73 minutes in a module's teardown: ``serve.shutdown()`` had begun stopping the replicas
when the raylet, the GCS and the replicas all stopped logging at once, while the driver (pytest) went on
waiting inside Ray's C++ code, where no timeout of pytest's can reach. Here a rescuer thread watches the
shutdown. If it is not done within ``SHUTDOWN_TIMEOUT_S``, the Ray processes this process started are
listed with their states (``T``: stopped, ``D``: blocked in the kernel) in the run's warnings summary,
sent SIGCONT, and if that does not free the shutdown either, SIGKILLed (which frees it: a plain
``ray.shutdown()`` with its GCS stopped waits forever in ``GcsSubscriber.close()``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import warnings
from collections.abc import Iterable
from pathlib import Path

#: How long serve.shutdown() and ray.shutdown() together may take (Serve gives each replica up to 20 s).
SHUTDOWN_TIMEOUT_S = 90.0
#: How long the shutdown gets after each remedy (SIGCONT, then SIGKILL).
REMEDY_WAIT_S = 20.0


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of ``pid`` from /proc, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes().decode(errors="replace")  # a name may be cut mid-character
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: the fields after its last ')'.
    state, ppid = stat.rsplit(")", 1)[1].split()[:2]
    return int(ppid), state


def descendants(pid: int) -> list[int]:
    """``pid``'s children, their children, and so on."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(stat[0], []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_state(pid: int) -> str | None:
    """``pid``'s state letter (``R``, ``S``, ``D``, ``T``, ``Z`` …), or None if it is gone."""
    stat = _stat(pid)
    return None if stat is None else stat[1]


def _ray_processes() -> dict[int, str]:
    """The Ray processes this process started (raylet, GCS, agents, workers): pid -> state and command."""
    found = {}
    for pid in descendants(os.getpid()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        # Ray's binaries and scripts live under .../ray/; its workers and agents are named ray::…, ray-….
        if "/ray/" in cmdline or cmdline.startswith(("ray::", "ray-")):
            found[pid] = f"{process_state(pid)} {cmdline[:80]}"
    return found


def signal_all(pids: Iterable[int], signum: signal.Signals) -> None:
    """Send ``signum`` to each of ``pids`` that is still there."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


class RayStopRescued(UserWarning):
    """A shutdown the rescuer had to free (pyproject.toml shows it in the run's warnings summary)."""


def stop_ray(serve_first: bool) -> list[str]:
    """``serve.shutdown()`` (when ``serve_first``) and ``ray.shutdown()`` in this thread, as always, with a
    rescuer beside them: if they are not done within ``SHUTDOWN_TIMEOUT_S``, it sends the Ray processes
    SIGCONT, then SIGKILL, as the module says. Returns what the rescuer did, each step also warned of
    (``RayStopRescued``) once the shutdown is done and printed as it happens (pytest's capture keeps that
    print for a test that fails); empty when it needed no help."""
    import ray
    from ray import serve

    done = threading.Event()
    remedies: list[str] = []

    def rescue() -> None:
        wait_s = SHUTDOWN_TIMEOUT_S
        for remedy in (signal.SIGCONT, signal.SIGKILL):
            if done.wait(wait_s):
                return
            stuck = _ray_processes()
            listing = "; ".join(f"{pid} {what}" for pid, what in sorted(stuck.items()))
            remedies.append(f"Ray's shutdown is stuck: sent {remedy.name} to its processes: {listing}")
            print(remedies[-1], file=sys.__stderr__, flush=True)
            signal_all(stuck, remedy)
            wait_s = REMEDY_WAIT_S

    rescuer = threading.Thread(target=rescue, name="ray-shutdown-rescuer", daemon=True)
    rescuer.start()
    try:
        try:
            if serve_first:
                serve.shutdown()
        finally:
            ray.shutdown()
    finally:
        done.set()
        rescuer.join()
    for remedy in remedies:
        warnings.warn(remedy, RayStopRescued, stacklevel=2)
    return remedies

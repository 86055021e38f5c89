"""The stack's processes: pid files, spawning and stopping process groups, bounded waits, ports.

Each service runs in its own session (process group) so that ``down`` can end exactly what ``up``
started, never processes found by name (``ray stop`` would kill every Ray on the host).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from infra.dev.stack.layout import Layout, StackError

GROUP_EXIT_TIMEOUT_S = 10.0
POLL_S = 0.5

#: What each pid file's process has in its command line (guards against a recycled pid).
_MARKERS = {"rabbitmq": "rabbitmq-server", "minio": "minio server", "ray": "ray start"}


def alive(pid: int) -> bool:
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


def running_pid(layout: Layout, name: str) -> int | None:
    """The pid of our running ``name`` service, or None (a stale pid file is removed)."""
    path = layout.pids / f"{name}.pid"
    try:
        pid = int(path.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError):
        path.unlink(missing_ok=True)
        return None
    if _MARKERS[name] in cmdline and alive(pid):
        return pid
    path.unlink(missing_ok=True)
    return None


def spawn(layout: Layout, name: str, argv: list[str], env: dict[str, str]) -> int:
    """Start ``argv`` in a new session, output appended to logs/NAME.log; records and returns its pid.

    Raises StackError if it can't be started.
    """
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


def stop(layout: Layout, name: str, timeout_s: float) -> bool:
    """SIGTERM our ``name`` service, wait (bounded), then SIGKILL its process group. Returns if it ran."""
    pid = running_pid(layout, name)
    if pid is None:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    wait(lambda: not alive(pid), timeout_s)
    # The session leader may be gone while its children linger: end the group it leads.
    if not wait(lambda: not _group_alive(pid), GROUP_EXIT_TIMEOUT_S if alive(pid) else 2.0):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        wait(lambda: not alive(pid), GROUP_EXIT_TIMEOUT_S)
    (layout.pids / f"{name}.pid").unlink(missing_ok=True)
    return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def wait(done: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``done`` until it returns True (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if done():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def host_port(url: str, default_port: int) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or default_port


def taken(port: int, what: str, hint: str) -> StackError:
    return StackError(f"port {port} ({what}) is already in use by a process vidx did not start{hint}")

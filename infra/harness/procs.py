"""Processes of the app seen from outside: the children a replica started, and holding them still."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable, Iterator
from pathlib import Path

#: What a decode worker's command line holds (pipeline.media.decode.WORKER_ENTRY).
DECODE_WORKER = b"serve_worker"


def children_running(pid: int, marker: bytes = DECODE_WORKER) -> list[int]:
    """The processes ``pid`` started whose command line holds ``marker`` (its decode workers by default)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            # /proc/<pid>/stat: the command name may hold spaces; the parent's pid follows the state
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid and marker in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


@contextlib.contextmanager
def stopped(pids: Iterable[int]) -> Iterator[list[int]]:
    """``pids`` stopped (SIGSTOP) inside the block and continued (SIGCONT) when it ends, however it ends;
    yields those that were there to stop."""
    held = []
    try:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
                held.append(pid)
        yield held
    finally:
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

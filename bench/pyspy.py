"""py-spy around a benchmark: start it on a process for a while, and end it within a deadline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

#: How long past its recording py-spy may take to write its output, and to exit once killed.
PY_SPY_WRITE_S = 60.0
PY_SPY_KILL_WAIT_S = 10.0


def start_py_spy(
    pid: int, seconds: int, out: Path, *, nonblocking: bool = False, quiet: bool = True
) -> subprocess.Popen[bytes]:
    """Start py-spy on process ``pid`` for ``seconds`` (a flame graph SVG at ``out``; collapsed stacks,
    one line each, when ``out`` ends in ``.txt``). ``nonblocking``: sample without pausing the process;
    ``quiet``: drop py-spy's own messages (stderr). End it with ``finish_py_spy``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    spy = Path(sys.executable).parent / "py-spy"
    cmd = [str(spy), "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "50", "--output", str(out)]
    if out.suffix == ".txt":
        cmd += ["--format", "raw"]
    if nonblocking:
        cmd.append("--nonblocking")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL if quiet else None)


def finish_py_spy(spy: subprocess.Popen[bytes], timeout_s: float) -> int:
    """Wait up to ``timeout_s`` for py-spy to exit, else kill it; its exit status (negative: the signal
    that ended it).

    Raises:
        subprocess.TimeoutExpired: it had not exited ``PY_SPY_KILL_WAIT_S`` after the kill."""
    try:
        return spy.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        spy.kill()
        return spy.wait(timeout=PY_SPY_KILL_WAIT_S)

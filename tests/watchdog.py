"""The test run's watchdog: a process of its own beside pytest, so that nothing pytest does can stop it.

tests/conftest.py starts it once per run and tells it, through a pipe, each test's deadline (its
pytest-timeout plus a grace) and when the test is over. pytest-timeout stops a test with SIGALRM, which
Python runs only between bytecodes: a test blocked inside a C call (Ray's core worker waiting on a stalled
raylet, a socket read with no timeout) never sees it. The in-process ``faulthandler`` timer that watched
for that before did not fire when a CI run hung for 73 minutes with nothing printed, and it has a hole:
pytest's own faulthandler plugin cancels any such timer whenever a test phase fails
(``pytest_exception_interact``), so a teardown that blocked after a failure went unwatched. This process
can't be cancelled from inside pytest.

When a deadline passes (or the whole run's bound, or pytest's exit takes too long), it prints what it
was waiting for, pytest's processes with their states (``T``: stopped, ``D``: blocked in the kernel) and
every thread's stack (py-spy, then faulthandler through SIGABRT while pytest has it on), kills pytest and
the processes it started that are still its descendants (containers and daemonised ``ray start`` nodes are
not), and exits 1. It exits 0 as soon as pytest closes the pipe.

Messages, one a line: ``arm SECONDS WHAT`` (a deadline SECONDS from now) and ``disarm``.

Usage (by tests/conftest.py): ``python -m tests.watchdog PYTEST_PID RUN_BOUND_S``.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from infra.harness.shutdown import descendants, process_state, signal_all  # stdlib only: it starts at once

#: How long a stack dump or a process listing may take before the watchdog goes on without it.
REPORT_TIMEOUT_S = 60.0
#: How long pytest gets to die of SIGABRT (faulthandler prints its stacks first) before SIGKILL.
ABORT_WAIT_S = 10.0


def say(line: str) -> None:
    sys.stderr.write(f"watchdog: {line}\n")
    sys.stderr.flush()


def run(cmd: list[str]) -> None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=REPORT_TIMEOUT_S)
        sys.stderr.write(out.stdout + out.stderr)
    except (OSError, subprocess.SubprocessError) as exc:
        say(f"{cmd[0]} failed: {exc}")


def fire(pid: int, what: str) -> None:
    family = [pid]
    try:  # the diagnostics are best effort: whatever fails in them, the run is still killed below
        say(f"{what}; pytest (pid {pid}), its processes and its stacks follow, then the run is killed")
        family += descendants(pid)  # the watchdog forked off at its start: it is not among them
        run(["ps", "-o", "pid,ppid,pgid,stat,wchan:24,etime,args", "-p", ",".join(map(str, family))])
        py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
        if py_spy:
            run([py_spy, "dump", "--pid", str(pid)])
        else:
            say("py-spy not found: no stacks from it")
    except Exception as exc:  # reported, then on to the kill
        say(f"diagnostics failed: {exc!r}")
    # pytest enables faulthandler (until it unconfigures): SIGABRT prints every thread's Python stack from a
    # C handler, then ends it. A stopped pytest would keep the signal pending: SIGCONT first.
    signal_all([pid], signal.SIGCONT)
    for signum, wait_s in ((signal.SIGABRT, ABORT_WAIT_S), (signal.SIGKILL, 0.0)):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while process_state(pid) not in (None, "Z") and time.monotonic() < deadline:
            time.sleep(0.2)
    signal_all(family[1:], signal.SIGKILL)
    say(f"killed pytest and {len(family) - 1} processes it started")


def main(argv: list[str]) -> int:
    pid, run_bound_s = int(argv[1]), float(argv[2])
    if os.fork() > 0:
        # Not a child of pytest (tests that count their process's children would count it): the parent
        # exits at once, and this process goes on as the child of whatever reaps orphans.
        os._exit(0)
    run_deadline = time.monotonic() + run_bound_s
    deadline: float | None = None
    what = ""
    buffered = b""
    while True:
        due = run_deadline if deadline is None else min(deadline, run_deadline)
        ready, _, _ = select.select([0], [], [], max(0.0, due - time.monotonic()))
        if ready:
            chunk = os.read(0, 4096)
            if not chunk:
                return 0  # pytest closed the pipe: it is gone, nothing left to watch
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for line in lines:
                verb, _, rest = line.decode(errors="replace").partition(" ")
                if verb == "arm":
                    seconds, _, what = rest.partition(" ")
                    deadline = time.monotonic() + float(seconds)
                elif verb == "disarm":
                    deadline = None
            continue
        if time.monotonic() < due:
            continue
        if deadline is not None and deadline <= run_deadline:
            fire(pid, f"{what} ran past its deadline")
        else:
            fire(pid, f"the test run ran past its bound of {run_bound_s:g}s (VIDX_TEST_RUN_BOUND_S)")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))

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
the CPU each has used, the machine's busiest processes, and every thread's stack (py-spy, then
faulthandler through SIGABRT while pytest has it on), kills pytest and the processes it started that are
still its descendants (containers and daemonised ``ray start`` nodes are not), and exits 1. It exits 0 as
soon as pytest closes the pipe. Its last lines say again what ran past its deadline, how far the run had
got, the load and the busiest processes: a CI log cut to its tail still shows them.

Messages, one a line: ``arm SECONDS WHAT`` (a deadline SECONDS from now) and ``disarm``.

Usage (by tests/conftest.py): ``python -m tests.watchdog PYTEST_PID RUN_BOUND_S``.
"""

from __future__ import annotations

import contextlib
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


#: How long the busiest processes are watched: the CPU each uses meanwhile ranks them.
SAMPLE_S = 3.0


def _cpu_ticks() -> dict[int, int]:
    """Every process's CPU time so far (user + system, in clock ticks), from /proc."""
    ticks = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:  # fields after the command's closing parenthesis: utime and stime are the 12th and 13th
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                ticks[int(entry.name)] = int(fields[11]) + int(fields[12])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    return ticks


def busiest(count: int) -> str:
    """The ``count`` processes of the machine that used the most CPU over ``SAMPLE_S``, a line each: the
    share of a CPU, then ``ps``'s pid, niceness, state and command (run under ``REPORT_TIMEOUT_S``: reading
    another process's command line can block on it, and the kill must still come)."""
    before = _cpu_ticks()
    time.sleep(SAMPLE_S)
    after, hz = _cpu_ticks(), os.sysconf("SC_CLK_TCK")
    used = sorted(((t - before[p], p) for p, t in after.items() if p in before), reverse=True)[:count]
    cmd = ["ps", "-o", "pid=,ni=,stat=,args=", "-p", ",".join(str(p) for _, p in used)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=REPORT_TIMEOUT_S).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        out = f"ps failed: {exc}"
    described = {line.split(None, 1)[0]: line.strip()[:120] for line in out.splitlines() if line.strip()}
    return "\n".join(f"  {100 * t / hz / SAMPLE_S:5.0f}% pid {described.get(str(p), f'{p} (gone)')}" for t, p in used)


def load() -> str:
    """The load averages and the memory still available, from /proc (best effort)."""
    try:
        avg = Path("/proc/loadavg").read_text().split()[:3]
        mem = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return f"load {' '.join(avg)} on {os.cpu_count()} CPUs, {mem['MemAvailable'].strip()} of memory available"
    except (OSError, KeyError, ValueError) as exc:
        return f"load unknown ({exc})"


def fire(pid: int, what: str, progress: str = "") -> None:
    family, top = [pid], "(not read)"
    try:  # the diagnostics are best effort: whatever fails in them, the run is still killed below
        say(f"{what}; pytest (pid {pid}), its processes and its stacks follow, then the run is killed")
        say(load())
        family += descendants(pid)  # the watchdog forked off at its start: it is not among them
        run(["ps", "-o", "pid,ppid,pgid,ni,stat,wchan:24,pcpu,time,etime,args", "-p", ",".join(map(str, family))])
        say(f"the machine's busiest processes (CPU used over {SAMPLE_S:g} s):")
        top = busiest(12)
        sys.stderr.write(top + "\n")
        py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
        if py_spy:
            run([py_spy, "dump", "--pid", str(pid)])
        else:
            say("py-spy not found: no stacks from it")
    except Exception as exc:  # reported, then on to the kill
        say(f"diagnostics failed: {exc!r}")
    with contextlib.suppress(Exception):  # the processes pytest started during the report are killed too
        family += [p for p in descendants(pid) if p not in family]
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
    # Again, last: a log cut to its tail keeps these lines.
    say(f"{what}{progress}; {load()}; the busiest processes before the kill:")
    sys.stderr.write("\n".join(top.splitlines()[:8]) + "\n")


def main(argv: list[str]) -> int:
    pid, run_bound_s = int(argv[1]), float(argv[2])
    if os.fork() > 0:
        # Not a child of pytest (tests that count their process's children would count it): the parent
        # exits at once, and this process goes on as the child of whatever reaps orphans.
        os._exit(0)
    started = time.monotonic()
    run_deadline = started + run_bound_s
    deadline: float | None = None
    what, done = "", 0
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
                    deadline, done = None, done + 1
            continue
        if time.monotonic() < due:
            continue
        progress = f" ({done} deadlines met before it, {time.monotonic() - started:.0f} s into the run)"
        if deadline is not None and deadline <= run_deadline:
            fire(pid, f"{what} ran past its deadline", progress)
        else:
            fire(pid, f"the test run ran past its bound of {run_bound_s:g}s (VIDX_TEST_RUN_BOUND_S)", progress)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))

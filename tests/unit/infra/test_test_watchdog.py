"""The test run's watchdog (tests/watchdog.py, started by tests/conftest.py), through real pytest processes:
a test that pytest-timeout's signal can't stop ends the run with its stacks printed, instead of hanging it,
and so does a teardown that blocks after its test failed (pytest's faulthandler plugin cancels in-process
timers on a failure: the watchdog before this one, a ``faulthandler`` timer, missed that case)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

#: A test the SIGALRM of pytest-timeout can't reach (the signal is blocked, as it is in effect while the
#: main thread waits inside a C call), which would otherwise sleep for ten minutes.
BLOCKED = """
import signal
import time

import pytest


@pytest.mark.timeout(1)
def test_blocked_past_its_timeout():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(600)
"""

#: A test that fails, then its fixture's teardown blocks where the timeout can't reach.
FAILED_THEN_STUCK = """
import signal
import time

import pytest


@pytest.fixture
def stuck_teardown():
    yield
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(600)


@pytest.mark.timeout(1)
def test_fails_then_its_teardown_blocks(stuck_teardown):
    raise AssertionError("a failing call")
"""


@pytest.mark.parametrize(
    ("probe", "frame"),
    [(BLOCKED, "test_blocked_past_its_timeout"), (FAILED_THEN_STUCK, "stuck_teardown")],
    ids=["blocked", "failed-then-stuck"],
)
def test_a_test_stuck_where_its_timeout_cant_reach_ends_the_run_with_its_stacks(
    tmp_path: Path, probe: str, frame: str
) -> None:
    env = {**os.environ, "VIDX_TEST_WATCHDOG_GRACE_S": "2", "VIDX_TEST_TEARDOWN_BOUND_S": "3"}
    ini, path = tmp_path / "pytest.ini", tmp_path / "test_probe.py"
    ini.write_text("[pytest]\n")
    path.write_text(probe)
    pytest_args = ["-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "-c", str(ini), "--rootdir", str(tmp_path)]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_args, str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # without the watchdog the probe sleeps 600 s: this raises, and the test fails
    )
    assert result.returncode != 0, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert "test_probe.py::" in result.stderr and "ran past its deadline" in result.stderr, result.stderr[-3000:]
    # The stuck frame as a stack prints it (py-spy: "name (file:line)", faulthandler: "in name"), not
    # only as part of the test's node id.
    assert f"{frame} (test_probe.py:" in result.stderr or f"in {frame}\n" in result.stderr, result.stderr[-3000:]
    assert "killed pytest" in result.stderr, result.stderr[-3000:]
    # A CI log shows its tail: the report ends by saying again what ran past its deadline, how far the run
    # had got, the load and the busiest processes (the watchdog's own sampling among them or not).
    tail = result.stderr.splitlines()[-9:]
    summary = [line for line in tail if "ran past its deadline" in line]
    assert summary and "deadlines met before it" in summary[0] and "load " in summary[0], tail
    assert any("% pid " in line for line in tail), tail

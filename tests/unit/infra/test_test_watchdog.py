"""The watchdog behind pytest-timeout (tests/conftest.py), through a real pytest process: a test that
pytest-timeout's signal can't stop ends the run with every thread's stack printed, instead of hanging it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

#: A test the SIGALRM of pytest-timeout can't reach (the signal is blocked, as it is in effect while the
#: main thread waits inside a C call), which would otherwise sleep for ten minutes.
PROBE = """
import signal
import time

import pytest


@pytest.mark.timeout(1)
def test_blocked_past_its_timeout():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(600)
"""


def test_a_test_stuck_where_its_timeout_cant_reach_ends_the_run_with_its_stacks(tmp_path: Path) -> None:
    env = {**os.environ, "VIDX_TEST_WATCHDOG_GRACE_S": "2"}
    ini, probe = tmp_path / "pytest.ini", tmp_path / "test_probe.py"
    ini.write_text("[pytest]\n")
    probe.write_text(PROBE)
    pytest_args = ["-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "-c", str(ini), "--rootdir", str(tmp_path)]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_args, str(probe)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # without the watchdog the probe sleeps 600 s: this raises, and the test fails
    )
    assert result.returncode == 1, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert "Timeout (0:00:03)!" in result.stderr, result.stderr[-2000:]
    assert "in test_blocked_past_its_timeout" in result.stderr, result.stderr[-2000:]

"""Fixtures shared by every tier. Services are started once per session, only by tests that ask."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from pytest_timeout import _get_item_settings  # pytest-timeout is pinned (pyproject.toml)

from infra.harness.services import Services, start_services

#: How long past its own timeout a test may go on before the watchdog ends the run (see below).
WATCHDOG_GRACE_S = float(os.environ.get("VIDX_TEST_WATCHDOG_GRACE_S", "120"))
#: How long the interpreter may take to exit once pytest is done (atexit handlers, threads joined).
EXIT_GRACE_S = 120.0
#: How long a test's teardown may take, from its start, whatever the test's timeout left it: pytest-timeout
#: stops timing a test that failed, and a module's teardown stops its app's Ray (infra/harness/shutdown.py
#: frees a stuck shutdown within 90 + 20 + 20 s).
TEARDOWN_BOUND_S = float(os.environ.get("VIDX_TEST_TEARDOWN_BOUND_S", "300"))
#: The bound on the whole run: past it the watchdog ends the run with its stacks. ``make test`` takes ~37
#: minutes here; CI stops a run at 90 minutes, installs included, and would print nothing of a hang.
RUN_BOUND_S = float(os.environ.get("VIDX_TEST_RUN_BOUND_S", "4500"))
_watchdog = pytest.StashKey[subprocess.Popen[bytes] | None]()


def pytest_configure(config: pytest.Config) -> None:
    """Start the watchdog (tests/watchdog.py): a process of its own, so that nothing this process does
    (a C call that never returns, pytest's faulthandler plugin cancelling timers after a failure) can
    keep it from ending a stuck run with its stacks. Output capture is suspended while plugins
    configure: it writes to the run's real stderr."""
    watchdog = subprocess.Popen(
        [sys.executable, "-m", "tests.watchdog", str(os.getpid()), str(RUN_BOUND_S)],
        cwd=Path(__file__).resolve().parents[1],
        stdin=subprocess.PIPE,
        start_new_session=True,  # out of pytest's process group: a signal to the group does not reach it
    )
    # It forks and its first process exits: the watchdog is no child of ours.
    if watchdog.wait(timeout=30) != 0:
        raise pytest.UsageError(f"the test watchdog did not start (exit {watchdog.returncode})")
    config.stash[_watchdog] = watchdog


def _tell_watchdog(config: pytest.Config, message: str) -> None:
    watchdog = config.stash.get(_watchdog, None)
    if watchdog is None or watchdog.stdin is None:
        return
    try:
        watchdog.stdin.write(f"{message}\n".encode())
        watchdog.stdin.flush()
    except (BrokenPipeError, ValueError):  # it fired already, or it died: say so once, the run is unwatched
        config.stash[_watchdog] = None
        print("the test watchdog is gone: the rest of the run is unwatched", file=sys.__stderr__, flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    """Each test (setup, call and teardown, module and session fixtures torn down inside it) gets
    ``WATCHDOG_GRACE_S`` past its pytest-timeout before the watchdog ends the run with every stack."""
    timeout = _get_item_settings(item).timeout
    if timeout:
        _tell_watchdog(item.config, f"arm {timeout + WATCHDOG_GRACE_S} {item.nodeid}")
    try:
        yield
    finally:
        _tell_watchdog(item.config, "disarm")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    """The teardown gets ``TEARDOWN_BOUND_S`` of its own (a failed test's time may be all spent)."""
    if _get_item_settings(item).timeout:
        _tell_watchdog(item.config, f"arm {TEARDOWN_BOUND_S} {item.nodeid} (teardown)")
    yield


def pytest_enter_pdb(config: pytest.Config) -> None:
    # Someone is debugging: no deadline (pytest-timeout stands down too).
    _tell_watchdog(config, "disarm")


def pytest_unconfigure(config: pytest.Config) -> None:
    # The same once the run is over: an interpreter that can't exit (a thread that won't join, an atexit
    # handler that blocks) is ended with its stacks rather than hold CI. The pipe closes when it exits.
    _tell_watchdog(config, f"arm {EXIT_GRACE_S} the interpreter's exit after pytest")


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    with start_services() as svc:
        yield svc


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from infra.dev.tinymodel import build_tiny_siglip

    return build_tiny_siglip(tmp_path_factory.mktemp("tiny-siglip"), seed=0)


def _tier(nodeid: str) -> str:
    for tier in ("unit", "integration", "e2e"):
        if nodeid.startswith(f"tests/{tier}/"):
            return tier
    return "other"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int) -> None:
    """Print outcomes per tier. With VIDX_NO_SKIPS=1 (``make test``, CI) a skipped integration or e2e
    test fails the run: a skip there would hide a missing service."""
    counts: dict[str, dict[str, int]] = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            if getattr(report, "when", "call") == "teardown" and outcome == "passed":
                continue
            tier = counts.setdefault(_tier(report.nodeid), {})
            tier[outcome] = tier.get(outcome, 0) + 1
    for tier in ("unit", "integration", "e2e"):
        c = counts.get(tier, {})
        terminalreporter.write_line(
            f"tier {tier}: {c.get('passed', 0)} passed, {c.get('failed', 0) + c.get('error', 0)} failed, "
            f"{c.get('skipped', 0)} skipped"
        )
    if os.environ.get("VIDX_NO_SKIPS") != "1":
        return
    skipped = [r.nodeid for r in terminalreporter.stats.get("skipped", []) if _tier(r.nodeid) in ("integration", "e2e")]
    if skipped:
        terminalreporter.write_line(f"FAILED: {len(skipped)} integration/e2e tests were skipped: {skipped}")
        terminalreporter._session.exitstatus = pytest.ExitCode.TESTS_FAILED  # type: ignore[attr-defined]

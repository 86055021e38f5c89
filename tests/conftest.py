"""Fixtures shared by every tier. Services are started once per session, only by tests that ask."""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from pytest_timeout import _get_item_settings  # pytest-timeout is pinned (pyproject.toml)

from infra.harness.services import Services, start_services

#: How long past its own timeout a test may go on before the watchdog ends the run (see below).
WATCHDOG_GRACE_S = float(os.environ.get("VIDX_TEST_WATCHDOG_GRACE_S", "120"))
#: How long the interpreter may take to exit once pytest is done (atexit handlers, threads joined).
EXIT_GRACE_S = 120.0
_watchdog_fd = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    # Output capture is suspended while plugins configure: fd 2 is the run's real stderr here.
    config.stash[_watchdog_fd] = os.dup(2)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    """The watchdog behind pytest-timeout. Its timeout raises in the main thread from a signal handler,
    which runs only between Python bytecodes: a test blocked inside a C call (Ray's core worker, a
    socket read without a timeout) or a teardown that blocks again after the timeout fired would hang
    the whole run until CI kills it, with nothing printed. ``faulthandler``'s timer is a C thread: once
    a test (setup, call and teardown, module and session fixtures included) runs ``WATCHDOG_GRACE_S``
    past its own timeout, it prints every thread's stack to the real stderr and exits the run with 1."""
    timeout = _get_item_settings(item).timeout
    if timeout:
        faulthandler.dump_traceback_later(timeout + WATCHDOG_GRACE_S, exit=True, file=item.config.stash[_watchdog_fd])
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_unconfigure(config: pytest.Config) -> None:
    # The same once the run is over: an interpreter that can't exit (a thread that won't join, an atexit
    # handler that blocks) prints its stacks and exits with 1 rather than hold CI.
    if _watchdog_fd in config.stash:
        faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=config.stash[_watchdog_fd])


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

"""Fixtures shared by every tier. Services are started once per session, only by tests that ask."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.harness.services import Services, start_services


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

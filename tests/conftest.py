"""Fixtures shared by every tier. Services are started once per session, only by tests that ask."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.services import Services, start_services


@pytest.fixture(scope="session")
def services() -> Iterator[Services]:
    with start_services() as svc:
        yield svc


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.tinymodel import build_tiny_siglip

    return build_tiny_siglip(tmp_path_factory.mktemp("tiny-siglip"), seed=0)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int) -> None:
    """With VIDX_NO_SKIPS=1 (``make test``, CI) a skipped integration or e2e test fails the run:
    a skip there would hide a missing service."""
    if os.environ.get("VIDX_NO_SKIPS") != "1":
        return
    skipped = [
        r.nodeid
        for r in terminalreporter.stats.get("skipped", [])
        if "/integration/" in r.nodeid or "/e2e/" in r.nodeid
    ]
    if skipped:
        terminalreporter.write_line(f"FAILED: {len(skipped)} integration/e2e tests were skipped: {skipped}")
        terminalreporter._session.exitstatus = pytest.ExitCode.TESTS_FAILED  # type: ignore[attr-defined]

"""Fixtures of the integration tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.harness.services import Services
from tests.harness import Stack, running_stack


@pytest.fixture
def stack(services: Services, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    with running_stack(services, tiny_model_dir, monkeypatch) as s:
        yield s

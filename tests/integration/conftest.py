"""Fixtures of the integration tier."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Stack, running_stack
from tests.services import Services


@pytest.fixture
def stack(services: Services, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    with running_stack(services, tiny_model_dir, monkeypatch) as s:
        yield s

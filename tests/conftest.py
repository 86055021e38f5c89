"""Fixtures shared by every tier. Services are started once per session, only by tests that ask."""

from __future__ import annotations

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

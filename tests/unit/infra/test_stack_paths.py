"""infra/dev/stack: the scripts `vidx up` runs are where it looks for them."""

from __future__ import annotations

import os

from infra.dev.stack.minio import MINIO_INSTALLER


def test_vidx_up_finds_the_minio_installer() -> None:
    assert MINIO_INSTALLER.is_file() and os.access(MINIO_INSTALLER, os.X_OK), MINIO_INSTALLER

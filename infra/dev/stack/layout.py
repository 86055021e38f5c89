"""Where the local stack keeps its state, and the error every part of the stack raises."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.cli.common import ADMIN_KEY_FILE, API_KEY_FILE
from pipeline.settings import Settings
from storage.errors import VidxError

#: Ray's unix socket paths (under the temp dir) must stay below 107 characters.
RAY_TEMP_MAX_CHARS = 40

Echo = Callable[[str], None]


class StackError(VidxError):
    """Raised when a local service can't be started, checked or stopped (one line, names the log)."""


@dataclass(frozen=True)
class Layout:
    """Where the local stack keeps its state."""

    root: Path

    @classmethod
    def of(cls, settings: Settings) -> Layout:
        return cls(settings.state_dir.resolve())

    def create(self) -> None:
        for path in (self.minio_data, self.minio_queue, self.root / "rabbitmq", self.logs, self.pids):
            path.mkdir(parents=True, exist_ok=True)

    @property
    def minio_data(self) -> Path:
        return self.root / "minio" / "data"

    @property
    def minio_queue(self) -> Path:
        return self.root / "minio" / "queue"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def api_key_file(self) -> Path:
        return self.root / API_KEY_FILE

    @property
    def admin_key_file(self) -> Path:
        return self.root / ADMIN_KEY_FILE

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    @property
    def ray_temp(self) -> Path:
        path = self.root / "ray"
        return path if len(str(path)) <= RAY_TEMP_MAX_CHARS else Path(f"/tmp/vidx-ray-{os.getuid()}")

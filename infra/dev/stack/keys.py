"""API keys of the local stack: made once by ``vidx up``, kept by ``down``, reused by the next ``up``.

Each key lives in its own file under the state dir (mode 0600); the app is handed the file paths
(``VIDX_API_KEY_FILE``, ``VIDX_ADMIN_KEY_FILE``) and the CLI reads the same files, so a key never
appears on a command line, in the environment of a process, or in any output.
"""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from infra.dev.stack.layout import Layout, StackError
from pipeline.settings import Settings

#: Random bytes in a generated key (43 URL-safe characters).
KEY_BYTES = 32
#: Owner read/write only.
KEY_FILE_MODE = 0o600


@dataclass(frozen=True)
class StackKeys:
    """Where the stack's keys are: a file, or None when the settings already configure that key."""

    api_key_file: Path | None
    admin_key_file: Path | None


def ensure_keys(settings: Settings, layout: Layout) -> StackKeys:
    """Make the key files the settings don't replace (kept if they exist). Raises StackError."""
    api = None if settings.api_keys else layout.api_key_file
    admin = None if settings.admin_key else layout.admin_key_file
    for path in (api, admin):
        if path is not None:
            _ensure_key_file(path)
    return StackKeys(api, admin)


def _ensure_key_file(path: Path) -> None:
    if path.exists() and path.stat().st_size > 0:
        if stat.S_IMODE(path.stat().st_mode) & 0o077:  # someone loosened it: keys are the owner's only
            path.chmod(KEY_FILE_MODE)
        return
    # Written whole to a private temporary file, then renamed: a crash never leaves an empty key file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, KEY_FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(secrets.token_urlsafe(KEY_BYTES) + "\n")
        os.chmod(tmp, KEY_FILE_MODE)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StackError(f"could not create the key file {path}: {exc.strerror}") from exc


def key_env(settings: Settings, layout: Layout) -> dict[str, str]:
    """``VIDX_*_KEY_FILE`` for the app, for each stack key file that exists and isn't replaced."""
    env: dict[str, str] = {}
    if not settings.api_keys and layout.api_key_file.exists():
        env["VIDX_API_KEY_FILE"] = str(layout.api_key_file)
    if settings.admin_key is None and layout.admin_key_file.exists():
        env["VIDX_ADMIN_KEY_FILE"] = str(layout.admin_key_file)
    return env

"""The ``vidx`` command line without services: help texts, one-line failures, status of a stopped stack."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app

COMMANDS = ["up", "down", "status", "upload", "search", "videos", "index", "tiny-model", "wait"]


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Settings pointing at an empty state dir and at ports where nothing listens."""
    state = tmp_path / "state"
    monkeypatch.setenv("VIDX_STATE_DIR", str(state))
    monkeypatch.setenv("VIDX_SERVE__PORT", str(_unused_port()))
    monkeypatch.setenv("VIDX_S3__ENDPOINT_URL", f"http://127.0.0.1:{_unused_port()}")
    monkeypatch.setenv("VIDX_AMQP__URL", f"amqp://guest:guest@127.0.0.1:{_unused_port()}/%2F")
    monkeypatch.delenv("VIDX_API_KEY", raising=False)
    return state


def test_help() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_help(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_search_without_api_fails_in_one_line(offline: Path) -> None:
    result = CliRunner().invoke(app, ["search", "a cat"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "not reachable" in lines[0] and "vidx up" in lines[0]
    assert "Traceback" not in result.output


def test_search_needs_text_or_image(offline: Path) -> None:
    result = CliRunner().invoke(app, ["search"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == ["vidx: give either a TEXT or --image FILE"]


def test_upload_of_missing_file_fails_in_one_line(offline: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["upload", str(tmp_path / "missing.mp4")])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [f"vidx: no such file: {tmp_path / 'missing.mp4'}"]


def test_status_of_stopped_stack(offline: Path) -> None:
    result = CliRunner().invoke(app, ["status", "--json"])
    assert result.exit_code == 0, result.output
    components = json.loads(result.stdout)
    assert [c["name"] for c in components] == ["rabbitmq", "minio", "ray", "app"]
    assert all(not c["running"] for c in components)
    assert not offline.exists()  # status only looks


def test_status_table(offline: Path) -> None:
    result = CliRunner().invoke(app, ["status"])
    assert result.exit_code == 0
    rows = result.stdout.strip().splitlines()
    assert len(rows) == 4 and all(" stopped " in row for row in rows)


def test_down_with_nothing_running(offline: Path) -> None:
    result = CliRunner().invoke(app, ["down"])
    assert result.exit_code == 0
    assert "nothing to stop" in result.stdout


def test_invalid_settings_fail_in_one_line(offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIDX_SERVE__PORT", "not-a-port")
    result = CliRunner().invoke(app, ["status"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vidx: invalid settings:"), result.stderr

"""The ``vidx`` command line without services: help texts, one-line failures, status of a stopped stack."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from events.config import AmqpSettings
from pipeline.cli.main import app
from tests.unit.cli.cli_fakes import offline_env, services_reachable

COMMANDS = ["up", "down", "status", "upload", "search", "videos", "index", "tiny-model", "wait"]


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Settings pointing at an empty state dir and at ports where nothing listens."""
    return offline_env(tmp_path, monkeypatch)


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
    assert [c["name"] for c in components] == ["rabbitmq", "minio", "ray", "app", "check"]
    assert all(not c["running"] for c in components[:4])
    assert components[4]["state"] is None and "not answering" in components[4]["detail"]
    assert not offline.exists()  # status only looks


def test_status_table(offline: Path) -> None:
    result = CliRunner().invoke(app, ["status"])
    assert result.exit_code == 0
    header, *rows = result.stdout.strip().splitlines()
    assert header.split() == ["COMPONENT", "STATE", "DETAIL"]
    assert len(rows) == 5 and all(" stopped " in row for row in rows[:4])
    assert rows[4].startswith("check ") and "unknown" in rows[4]


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


# -- API keys of the local stack ------------------------------------------------------------------------


@pytest.fixture
def fake_services(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``vidx up`` with every service start replaced by a note of its name."""
    import infra.dev.stack as stack

    started: list[str] = []
    for name in ("start_rabbitmq", "start_minio", "start_ray", "start_app"):
        monkeypatch.setattr(stack, name, lambda *_args, _n=name: started.append(_n))
    return started


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_up_makes_keys_says_where_and_never_prints_them(offline: Path, fake_services: list[str]) -> None:
    result = CliRunner().invoke(app, ["up"])
    assert result.exit_code == 0, result.output
    api, admin = offline / "api-key", offline / "admin-key"
    key, admin_key = api.read_text().strip(), admin.read_text().strip()
    assert len(key) >= 40 and len(admin_key) >= 40 and key != admin_key
    assert _mode(api) == 0o600 and _mode(admin) == 0o600
    assert str(api.resolve()) in result.output and str(admin.resolve()) in result.output
    assert key not in result.output and admin_key not in result.output
    # down keeps them; the next up reuses them.
    assert CliRunner().invoke(app, ["down"]).exit_code == 0
    assert CliRunner().invoke(app, ["up"]).exit_code == 0
    assert api.read_text().strip() == key and admin.read_text().strip() == admin_key


def test_up_leaves_configured_keys_alone(
    offline: Path, fake_services: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VIDX_API_KEY", "my-own-key-0123456789abcdef")
    result = CliRunner().invoke(app, ["up"])
    assert result.exit_code == 0, result.output
    assert not (offline / "api-key").exists() and (offline / "admin-key").exists()
    assert "API keys from your settings" in result.output
    assert "my-own-key-0123456789abcdef" not in result.output


def test_a_loosened_key_file_is_tightened(offline: Path, fake_services: list[str]) -> None:
    offline.mkdir(parents=True)
    (offline / "api-key").write_text("kept-key-0123456789abcdef\n")
    (offline / "api-key").chmod(0o644)
    assert CliRunner().invoke(app, ["up"]).exit_code == 0
    assert _mode(offline / "api-key") == 0o600
    assert (offline / "api-key").read_text() == "kept-key-0123456789abcdef\n"


def test_an_empty_key_file_left_by_a_crash_is_replaced(offline: Path, fake_services: list[str]) -> None:
    offline.mkdir(parents=True)
    (offline / "api-key").write_text("")
    assert CliRunner().invoke(app, ["up"]).exit_code == 0
    assert len((offline / "api-key").read_text().strip()) >= 16 and _mode(offline / "api-key") == 0o600
    assert not list(offline.glob(".api-key.*"))


def test_the_app_is_handed_key_files_not_keys(offline: Path, fake_services: list[str]) -> None:
    from infra.dev.stack.layout import Layout
    from infra.dev.stack.ray import child_env
    from pipeline.settings import Settings

    assert CliRunner().invoke(app, ["up"]).exit_code == 0
    settings = Settings()
    env = child_env(settings, Layout.of(settings))
    assert env["VIDX_API_KEY_FILE"] == str((offline / "api-key").resolve())
    assert env["VIDX_ADMIN_KEY_FILE"] == str((offline / "admin-key").resolve())
    key = (offline / "api-key").read_text().strip()
    assert all(key not in value for value in env.values())
    # What the app builds from that environment accepts the stack's keys.
    app_settings = Settings(api_key_file=Path(env["VIDX_API_KEY_FILE"]))
    assert [k.get_secret_value() for k in app_settings.api_keys] == [key]


def test_cli_sends_the_stack_key(offline: Path, fake_services: list[str]) -> None:
    from pipeline.cli.common import ApiClient
    from pipeline.settings import Settings

    assert CliRunner().invoke(app, ["up"]).exit_code == 0
    key = (offline / "api-key").read_text().strip()
    admin_key = (offline / "admin-key").read_text().strip()
    assert ApiClient(Settings())._client.headers["authorization"] == f"Bearer {key}"
    assert ApiClient(Settings(), admin=True)._client.headers["authorization"] == f"Bearer {admin_key}"


def test_cli_prefers_the_configured_key(offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.cli.common import ApiClient
    from pipeline.settings import Settings

    monkeypatch.setenv("VIDX_API_KEY", "configured-key-0123456789")
    assert ApiClient(Settings())._client.headers["authorization"] == "Bearer configured-key-0123456789"


def test_cli_without_any_key_sends_none(offline: Path) -> None:
    from pipeline.cli.common import ApiClient
    from pipeline.settings import Settings

    assert "authorization" not in ApiClient(Settings())._client.headers


def test_a_refused_key_is_one_line_that_says_what_to_set(offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx

    from pipeline.cli import main as cli

    def refuse(request: httpx.Request) -> httpx.Response:
        body = {"error": {"code": "unauthorized", "message": "a valid API key is required"}}
        return httpx.Response(401, json=body, headers={"WWW-Authenticate": "Bearer"})

    real_init = cli.ApiClient.__init__

    def init(self: cli.ApiClient, settings: object, admin: bool = False) -> None:
        real_init(self, settings, admin)  # type: ignore[arg-type]
        self._client = httpx.Client(base_url=self.url, transport=httpx.MockTransport(refuse))

    monkeypatch.setattr(cli.ApiClient, "__init__", init)
    result = CliRunner().invoke(app, ["videos"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "(401: " in lines[0] and "VIDX_API_KEY" in lines[0], result.stderr


# -- vidx parked list|replay (the sub-app, over a stand-in broker) ---------------------------------------


def _parked(args: list[str]) -> Any:
    from pipeline.cli.admin import parked_app
    from pipeline.settings import Settings

    return CliRunner().invoke(parked_app, args, obj=Settings())


@pytest.fixture
def parked_broker(offline: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    from events.parked import park
    from tests.unit.events.test_parked import VIDEO, FakeChannel, patch_broker

    broker = patch_broker(monkeypatch)
    services_reachable(monkeypatch)  # the stand-in broker answers; nothing listens on the port
    queue = AmqpSettings().parked_queue
    park(FakeChannel(broker), queue, b"\xffnot json", "not JSON: Expecting value", 1)
    park(FakeChannel(broker), queue, VIDEO, "gave up after 5 attempts: task queue unavailable", 5)
    return broker


def test_parked_list_shows_each_event_with_its_reason(parked_broker: Any) -> None:
    from events.parked import parked_id
    from tests.unit.events.test_parked import VIDEO

    result = _parked(["list"])
    assert result.exit_code == 0, result.output
    header, first, second = result.stdout.strip().splitlines()
    assert header.split() == ["ID", "PARKED", "AT", "ATTEMPTS", "OBJECTS", "REASON"]
    assert first.startswith(parked_id(b"\xffnot json"))
    assert first.split()[3:] == ["1", "-", "not", "JSON:", "Expecting", "value"]
    assert second.startswith(parked_id(VIDEO))
    assert second.endswith("5  s3://videos/clips/a b.mp4  gave up after 5 attempts: task queue unavailable")
    listed = json.loads(_parked(["list", "--json"]).stdout)
    assert [e["attempts"] for e in listed] == [1, 5] and listed[1]["uris"] == ["s3://videos/clips/a b.mp4"]
    assert len(parked_broker.queues[AmqpSettings().parked_queue]) == 2  # listing changed nothing


def test_parked_replay_puts_the_chosen_events_back_and_names_the_missing(parked_broker: Any) -> None:
    from events.parked import parked_id
    from tests.unit.events.test_parked import VIDEO

    result = _parked(["replay", parked_id(VIDEO), "nope"])
    assert result.exit_code == 1
    assert result.stdout.strip().splitlines() == [
        f"replayed {parked_id(VIDEO)}  s3://videos/clips/a b.mp4",
        "1 replayed, 1 left in the parked queue",
    ]
    assert result.stderr.strip() == "vidx: not found: nope"
    assert parked_broker.bodies(AmqpSettings().events_queue) == [VIDEO]


def test_parked_replay_needs_ids_or_all_not_both(offline: Path) -> None:
    for args in (["replay"], ["replay", "p1", "--all"]):
        result = _parked(args)
        assert result.exit_code == 1
        assert result.stderr.strip().splitlines() == ["vidx: name parked event ids or pass --all (not both)"]


def test_parked_list_without_a_broker_fails_in_one_line(offline: Path) -> None:
    result = _parked(["list"])
    assert result.exit_code == 1
    port = AmqpSettings.model_validate({"url": os.environ["VIDX_AMQP__URL"]}).url.get_secret_value().rsplit(":", 1)[1]
    assert result.stderr.strip().splitlines() == [
        f"vidx: RabbitMQ is not reachable at 127.0.0.1:{port.split('/')[0]} — run `vidx up`, or set VIDX_AMQP__URL"
    ]


def test_a_plugin_that_cannot_load_is_named_and_the_others_still_register(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from importlib.metadata import EntryPoint

    import typer

    from pipeline.cli import main

    plugins = [
        EntryPoint("broken", "vidx_missing_plugin.cli:register", main.PLUGIN_GROUP),
        EntryPoint("dev", "infra.dev.cli:register", main.PLUGIN_GROUP),
    ]
    monkeypatch.setattr(main, "entry_points", lambda group: [p for p in plugins if p.group == group])
    target = typer.Typer()
    assert main.register_plugins(target) == ["broken"]
    assert "up" in {c.callback.__name__ for c in target.registered_commands if c.callback}
    assert "'broken' commands (vidx_missing_plugin.cli:register) could not be loaded" in capsys.readouterr().err

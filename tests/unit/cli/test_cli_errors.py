"""Every ``vidx`` failure is one line on stderr, exit status 1, no traceback, naming the component that
failed (RabbitMQ, MinIO, the vidx API), where it is (host:port, never credentials) and what to do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from pipeline.cli.errors import redact
from pipeline.cli.main import app
from tests.unit.cli.cli_fakes import FakeApi, FakeMinio, services_reachable, unused_port

PASSWORD = "s3cr3t-pw"


@pytest.fixture
def ports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Settings pointing at ports where nothing listens; the AMQP URL carries a password."""
    found = {"api": unused_port(), "s3": unused_port(), "amqp": unused_port()}
    monkeypatch.setenv("VIDX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("VIDX_SERVE__PORT", str(found["api"]))
    monkeypatch.setenv("VIDX_S3__ENDPOINT_URL", f"http://127.0.0.1:{found['s3']}")
    monkeypatch.setenv("VIDX_AMQP__URL", f"amqp://vidx:{PASSWORD}@127.0.0.1:{found['amqp']}/%2F")
    for name in ("VIDX_API_KEY", "VIDX_API_KEYS", "VIDX_API_KEY_FILE", "VIDX_ADMIN_KEY", "VIDX_ADMIN_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "clip.mp4").write_bytes(b"bytes")
    return found


def _one_line(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output and PASSWORD not in result.output
    return lines[0]


RABBITMQ = "vidx: RabbitMQ is not reachable at 127.0.0.1:{amqp} — run `vidx up`, or set VIDX_AMQP__URL"
MINIO = "vidx: MinIO is not reachable at 127.0.0.1:{s3} — run `vidx up`, or set VIDX_S3__ENDPOINT_URL"
API = (
    "vidx: the vidx API is not reachable at http://127.0.0.1:{api} — run `vidx up`,"
    " or set VIDX_SERVE__HOST / VIDX_SERVE__PORT"
)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["dlq", "list"], RABBITMQ),
        (["dlq", "replay", "--all"], RABBITMQ),
        (["parked", "list"], RABBITMQ),
        (["parked", "replay", "--all"], RABBITMQ),
        (["serve"], RABBITMQ),
        (["check"], MINIO),
        (["check", "--repair"], MINIO),
        (["reconcile"], MINIO),
        (["reconcile", "--dry-run"], MINIO),
        (["upload", "@clip"], MINIO),
        (["upload", "@clip", "--wait"], MINIO),
        (["videos"], API),
        (["search", "a dog"], API),
        (["index", "s3://videos/a.mp4"], API),
        (["wait", "--timeout", "0.5"], None),
    ],
)
def test_an_unreachable_component_is_named_with_its_address_and_the_fix(
    args: list[str], expected: str | None, ports: dict[str, int], tmp_path: Path
) -> None:
    args = [str(tmp_path / "clip.mp4") if a == "@clip" else a for a in args]
    if expected is None:  # `vidx wait` retries until its deadline, then says why it gave up
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 124
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("vidx: not done after 0.5s: ") and line.endswith(
            API.format(**ports).removeprefix("vidx: ")
        )
        return
    assert _one_line(args) == expected.format(**ports)


def test_rabbitmq_only_matters_to_check_when_it_repairs(ports: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.cli.errors import Component

    monkeypatch.setattr(Component, "reachable", lambda self, timeout_s=0.0: self.name != "RabbitMQ")
    assert _one_line(["check", "--repair"]) == RABBITMQ.format(**ports)
    assert _one_line(["reconcile"]) == RABBITMQ.format(**ports)


def test_a_refused_broker_login_names_the_setting(ports: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    import pika
    import pika.exceptions

    services_reachable(monkeypatch)

    def refuse(params: Any) -> Any:
        raise pika.exceptions.ProbableAuthenticationError("ConnectionClosedByBroker: (403) 'ACCESS_REFUSED'")

    monkeypatch.setattr(pika, "BlockingConnection", refuse)
    assert _one_line(["parked", "list"]) == (
        f"vidx: RabbitMQ at 127.0.0.1:{ports['amqp']} refused the credentials (ProbableAuthenticationError)"
        " — check the user, password and vhost in VIDX_AMQP__URL"
    )


def test_refused_s3_credentials_name_the_settings(
    ports: dict[str, int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from minio.error import S3Error

    services_reachable(monkeypatch)
    minio = FakeMinio().install(monkeypatch)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise S3Error(None, "InvalidAccessKeyId", "The Access Key Id does not exist", "/videos", "r", "h")  # type: ignore[arg-type]

    monkeypatch.setattr(minio, "fput_object", refuse)
    assert _one_line(["upload", str(tmp_path / "clip.mp4")]) == (
        f"vidx: MinIO at 127.0.0.1:{ports['s3']} refused the credentials (InvalidAccessKeyId)"
        " — check VIDX_S3__ACCESS_KEY and VIDX_S3__SECRET_KEY"
    )


def test_a_missing_bucket_says_how_to_make_it(
    ports: dict[str, int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from minio.error import S3Error

    services_reachable(monkeypatch)
    minio = FakeMinio().install(monkeypatch)

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise S3Error(None, "NoSuchBucket", "The specified bucket does not exist", "/videos", "r", "h")  # type: ignore[arg-type]

    monkeypatch.setattr(minio, "fput_object", missing)
    line = _one_line(["upload", str(tmp_path / "clip.mp4")])
    assert line.startswith("vidx: MinIO has no bucket videos — run `vidx up`")


def test_the_index_store_refusing_its_key_names_the_s3_settings(
    ports: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import storage.tables

    services_reachable(monkeypatch)

    def refuse(s3: Any) -> Any:  # what lancedb raises, more or less
        raise ValueError('Generic S3 error: response error "<Code>SignatureDoesNotMatch</Code>", after 0 retries')

    monkeypatch.setattr(storage.tables, "IndexStore", refuse)
    assert _one_line(["check"]) == (
        f"vidx: MinIO at 127.0.0.1:{ports['s3']} refused the credentials (SignatureDoesNotMatch)"
        " — check VIDX_S3__ACCESS_KEY and VIDX_S3__SECRET_KEY"
    )


def test_a_component_that_goes_away_mid_command_is_named(
    ports: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import storage.tables
    from pipeline.cli.errors import Component

    probes: list[str] = []

    def reachable(self: Component, timeout_s: float = 0.0) -> bool:
        probes.append(self.name)
        return len(probes) == 1  # up for the first probe, gone after

    monkeypatch.setattr(Component, "reachable", reachable)
    monkeypatch.setattr(
        storage.tables, "IndexStore", lambda s3: (_ for _ in ()).throw(ValueError("IO error: 12 kB of Rust"))
    )
    assert _one_line(["check"]) == MINIO.format(**ports)


def test_an_unexpected_library_error_names_the_component_and_hides_credentials(
    ports: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from events.parked import ParkedQueue

    services_reachable(monkeypatch)

    def boom(self: Any, limit: int | None = None) -> Any:
        raise RuntimeError(f"could not open amqp://vidx:{PASSWORD}@127.0.0.1:5672/%2F\nsecond line")

    monkeypatch.setattr(ParkedQueue, "list", boom)
    assert _one_line(["parked", "list"]) == (
        f"vidx: RabbitMQ at 127.0.0.1:{ports['amqp']} failed: RuntimeError: could not open "
        "amqp://***@127.0.0.1:5672/%2F — see `vidx status` and its log"
    )


def test_redact_removes_the_user_info_of_every_url() -> None:
    text = "a amqp://u:p@h:5672/v and https://key:secret@s3.example.com/b, http://plain.example/x"
    assert redact(text) == "a amqp://***@h:5672/v and https://***@s3.example.com/b, http://plain.example/x"
    # A password with an "@" in it: none of it is left.
    assert redact("amqp://u:p@ss@host:5672/%2F") == "amqp://***@host:5672/%2F"


# -- the API's answers ---------------------------------------------------------------------------------


def test_a_refused_key_says_which_setting_to_set(ports: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    FakeApi(status=401).install(monkeypatch)
    assert _one_line(["videos"]) == (
        "vidx: the vidx API refused GET /v1/videos (401: refused by the stand-in): sent no key"
        " — set VIDX_API_KEY or VIDX_API_KEY_FILE, or run `vidx up`, which makes one"
    )


def test_a_server_error_says_to_retry(ports: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    FakeApi(status=503).install(monkeypatch)
    assert _one_line(["search", "a dog"]) == (
        "vidx: the vidx API answered 503 to GET /v1/search: refused by the stand-in — retry later, or see `vidx status`"
    )


def test_an_api_that_does_not_answer_in_time_is_named(ports: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.cli.common import ApiClient

    real_init = ApiClient.__init__

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    def init(client: ApiClient, settings: Any, admin: bool = False) -> None:
        real_init(client, settings, admin)
        client._client = httpx.Client(base_url=client.url, transport=httpx.MockTransport(slow))

    monkeypatch.setattr(ApiClient, "__init__", init)
    line = _one_line(["index", "s3://videos/a.mp4"])
    assert line.startswith(
        f"vidx: the vidx API at http://127.0.0.1:{ports['api']} did not answer POST /v1/index within"
    )
    assert line.endswith("— see `vidx status`")


def test_invalid_settings_name_the_variable(ports: dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIDX_SERVE__PORT", "eighty")
    result = CliRunner().invoke(app, ["videos"])
    assert result.exit_code == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("vidx: invalid settings: serve.port:") and line.endswith("(from VIDX_SERVE__PORT)")

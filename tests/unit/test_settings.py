"""pipeline/settings.py: one typed settings object read from VIDX_* environment variables."""

from __future__ import annotations

import os

import pytest

from pipeline.decode import DecodeLimits
from pipeline.settings import DEFAULT_MODEL_ID, SamplingSettings, Settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Start every test from an environment without VIDX_ variables, so the developer's don't leak in."""
    for name in list(os.environ):
        if name.upper().startswith("VIDX_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_defaults_run_the_local_stack() -> None:
    settings = Settings()

    assert settings.s3.endpoint_url == "http://127.0.0.1:9000"
    assert settings.s3.buckets == ["videos"]
    assert settings.s3.upload_bucket == "videos"
    assert settings.sampling.every_s == 1.0
    assert settings.model.id == DEFAULT_MODEL_ID
    assert settings.api_key is None
    assert settings.api_url == "http://127.0.0.1:8000"
    assert isinstance(settings.limits, DecodeLimits)


def test_nested_values_come_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIDX_S3__ENDPOINT_URL", "http://minio.internal:9000")
    monkeypatch.setenv("VIDX_SAMPLING__EVERY_S", "0.5")
    monkeypatch.setenv("VIDX_S3__BUCKETS", '["a","b"]')
    monkeypatch.setenv("VIDX_LIMITS__MAX_FRAMES", "123")
    monkeypatch.setenv("VIDX_SERVE__PORT", "8123")

    settings = Settings()

    assert settings.s3.endpoint_url == "http://minio.internal:9000"
    assert settings.sampling.every_s == 0.5
    assert settings.s3.buckets == ["a", "b"]
    assert settings.s3.upload_bucket == "a"
    assert settings.limits.max_frames == 123
    assert settings.api_url == "http://127.0.0.1:8123"
    # Setting one nested field keeps the defaults of its siblings.
    assert settings.s3.region == "us-east-1"
    assert settings.sampling.decode_max_side == 384


def test_env_names_are_case_insensitive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("vidx_sampling__every_s", "2")

    assert Settings().sampling.every_s == 2.0


def test_other_prefixes_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("S3__ENDPOINT_URL", "http://elsewhere:9000")
    monkeypatch.setenv("VIDX_NOT_A_SETTING", "x")

    assert Settings().s3.endpoint_url == "http://127.0.0.1:9000"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("VIDX_SAMPLING__EVERY_S", "0"),
        ("VIDX_SAMPLING__EVERY_S", "-1"),
        ("VIDX_SAMPLING__EVERY_S", "often"),
        ("VIDX_S3__BUCKETS", "[]"),
        ("VIDX_S3__BUCKETS", "not json"),
        ("VIDX_LIMITS__MAX_PIXELS", "0"),
        ("VIDX_MODEL__DEVICE", "tpu"),
    ],
)
def test_invalid_values_are_rejected(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)

    # pydantic's ValidationError and pydantic-settings' SettingsError (bad JSON) are both ValueErrors.
    with pytest.raises(ValueError):
        Settings()


def test_secrets_do_not_show(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIDX_S3__ACCESS_KEY", "AKIA-visible-nowhere")
    monkeypatch.setenv("VIDX_S3__SECRET_KEY", "s3-secret-value")
    monkeypatch.setenv("VIDX_AMQP__URL", "amqp://vidx:amqp-password@rabbit:5672/%2F")
    monkeypatch.setenv("VIDX_API_KEY", "api-key-value")

    settings = Settings()

    assert settings.s3.secret_key.get_secret_value() == "s3-secret-value"
    assert settings.amqp.url.get_secret_value() == "amqp://vidx:amqp-password@rabbit:5672/%2F"
    assert settings.api_key is not None
    assert settings.api_key.get_secret_value() == "api-key-value"
    shown = [
        repr(settings),
        str(settings),
        repr(settings.s3),
        repr(settings.amqp),
        settings.model_dump_json(),
    ]
    for text in shown:
        for secret in ("AKIA-visible-nowhere", "s3-secret-value", "amqp-password", "api-key-value"):
            assert secret not in text


def test_constructor_arguments_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIDX_SAMPLING__EVERY_S", "0.5")

    settings = Settings(sampling=SamplingSettings(every_s=2.0))

    assert settings.sampling.every_s == 2.0

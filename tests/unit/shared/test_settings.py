"""pipeline/settings.py: one typed settings object read from VIDX_* environment variables."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.media.settings import DecodeLimits
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
    assert settings.api_keys == [] and settings.admin_key is None and not settings.auth_enabled
    assert 60 <= settings.s3.presign_ttl_s <= 3600
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
    monkeypatch.setenv("VIDX_API_KEY", "api-key-value-0123456789")
    monkeypatch.setenv("VIDX_ADMIN_KEY", "admin-key-value-0123456789")

    settings = Settings()

    assert settings.s3.secret_key.get_secret_value() == "s3-secret-value"
    assert settings.amqp.url.get_secret_value() == "amqp://vidx:amqp-password@rabbit:5672/%2F"
    assert settings.api_key is not None
    assert settings.api_key.get_secret_value() == "api-key-value-0123456789"
    shown = [
        repr(settings),
        str(settings),
        repr(settings.s3),
        repr(settings.amqp),
        settings.model_dump_json(),
    ]
    for text in shown:
        for secret in ("AKIA-visible-nowhere", "s3-secret-value", "amqp-password", "api-key-value", "admin-key-value"):
            assert secret not in text


def test_constructor_arguments_override_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIDX_SAMPLING__EVERY_S", "0.5")

    settings = Settings(sampling=SamplingSettings(every_s=2.0))

    assert settings.sampling.every_s == 2.0


KEY_A = "key-a-0123456789abcdef"
KEY_B = "key-b-0123456789abcdef"


def test_api_keys_gather_from_list_single_and_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    key_file = tmp_path / "api-key"
    key_file.write_text("key-from-file-0123456789\n")
    admin_file = tmp_path / "admin-key"
    admin_file.write_text("admin-from-file-0123456789")
    monkeypatch.setenv("VIDX_API_KEYS", f'["{KEY_A}", "{KEY_B}"]')
    monkeypatch.setenv("VIDX_API_KEY", KEY_A)
    monkeypatch.setenv("VIDX_API_KEY_FILE", str(key_file))
    monkeypatch.setenv("VIDX_ADMIN_KEY_FILE", str(admin_file))

    settings = Settings()

    assert [k.get_secret_value() for k in settings.api_keys] == [KEY_A, KEY_B, "key-from-file-0123456789"]
    assert settings.admin_key is not None and settings.admin_key.get_secret_value() == "admin-from-file-0123456789"
    assert settings.auth_enabled


def test_an_admin_key_alone_turns_auth_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIDX_ADMIN_KEY", KEY_A)

    assert Settings().auth_enabled


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("VIDX_API_KEY", "short-key", "at least 16"),
        ("VIDX_API_KEY", "a key with spaces in it", "no spaces"),
        ("VIDX_API_KEYS", '["0123456789abcdef", ""]', "at least 16"),
        ("VIDX_ADMIN_KEY", "short", "admin_key"),
        ("VIDX_API_KEY_FILE", "/nonexistent/vidx/api-key", "cannot read /nonexistent/vidx/api-key"),
    ],
)
def test_bad_keys_are_rejected_without_quoting_them(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    monkeypatch.setenv(name, value)

    with pytest.raises(ValueError, match=message) as info:
        Settings()

    if "FILE" not in name:
        assert value not in str(info.value)


def test_an_empty_key_file_is_rejected(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv("VIDX_API_KEY_FILE", str(tmp_path / "empty"))

    with pytest.raises(ValueError, match="at least 16"):
        Settings()


def test_admin_key_and_admin_key_file_exclude_each_other(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "admin").write_text(KEY_B)
    monkeypatch.setenv("VIDX_ADMIN_KEY", KEY_A)
    monkeypatch.setenv("VIDX_ADMIN_KEY_FILE", str(tmp_path / "admin"))

    with pytest.raises(ValueError, match="not both"):
        Settings()


def test_validation_errors_never_quote_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIDX_S3__SECRET_KEY", "s3-secret-value")
    monkeypatch.setenv("VIDX_AMQP__URL", "amqp://vidx:amqp-password@rabbit:5672/%2F")
    monkeypatch.setenv("VIDX_API_KEY", "bad key with spaces")

    with pytest.raises(ValueError) as info:
        Settings()

    for secret in ("s3-secret-value", "amqp-password", "bad key with spaces"):
        assert secret not in str(info.value)


@pytest.mark.parametrize("ttl", ["0", "5", "3601", "604800"])
def test_presigned_links_are_short_lived(monkeypatch: pytest.MonkeyPatch, ttl: str) -> None:
    monkeypatch.setenv("VIDX_S3__PRESIGN_TTL_S", ttl)

    with pytest.raises(ValueError):
        Settings()


def test_autoscaling_is_on_by_default_with_documented_bounds() -> None:
    a = Settings().autoscale
    assert a.enabled and a.poll_interval_s == 1.0 and a.upscale_delay_s == 0.0 and a.downscale_delay_s == 10.0
    assert (a.consumer_min_replicas, a.consumer_max_replicas) == (1, 2)
    assert (a.encoder_min_replicas, a.encoder_max_replicas, a.encoder_target_ongoing_requests) == (1, 2, 32.0)
    assert Settings().serve.layout == "auto"
    assert Settings().serve.resolved_layout(cluster_has_gpu=False) == "fused"
    assert Settings().serve.resolved_layout(cluster_has_gpu=True) == "split"


def test_the_consumer_target_defaults_to_what_one_replica_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIDX_SERVE__CONSUMER_CONCURRENCY", "6")
    assert Settings().autoscale.consumer_target_per_replica == 6
    monkeypatch.setenv("VIDX_AUTOSCALE__CONSUMER_TARGET_PER_REPLICA", "10")
    assert Settings().autoscale.consumer_target_per_replica == 10


def test_autoscale_settings_come_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIDX_AUTOSCALE__ENABLED", "false")
    monkeypatch.setenv("VIDX_AUTOSCALE__POLL_INTERVAL_S", "2")
    monkeypatch.setenv("VIDX_AUTOSCALE__UPSCALE_DELAY_S", "15")
    monkeypatch.setenv("VIDX_AUTOSCALE__DOWNSCALE_DELAY_S", "60")
    monkeypatch.setenv("VIDX_SERVE__LAYOUT", "fused")
    s = Settings()
    assert not s.autoscale.enabled and s.autoscale.poll_interval_s == 2.0
    assert (s.autoscale.upscale_delay_s, s.autoscale.downscale_delay_s) == (15.0, 60.0)
    assert s.serve.layout == "fused"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("VIDX_AUTOSCALE__CONSUMER_MIN_REPLICAS", "5"),  # above the max of 4
        ("VIDX_AUTOSCALE__ENCODER_MIN_REPLICAS", "3"),
        ("VIDX_AUTOSCALE__POLL_INTERVAL_S", "0"),
        ("VIDX_AUTOSCALE__CONSUMER_TARGET_PER_REPLICA", "0"),
        ("VIDX_SERVE__LAYOUT", "both"),
        ("VIDX_SERVE__API_MAX_IN_FLIGHT", "128"),  # leaves the probes no slot
    ],
)
def test_invalid_autoscale_and_admission_values_are_rejected(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError):
        Settings()

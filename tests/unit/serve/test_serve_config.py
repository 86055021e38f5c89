"""The Serve config made from the settings (pipeline.serve.config, ``vidx serve-config``): the
committed file is the generator's output, Ray's schema takes it strictly, settings flow into it,
credentials never do, and the builder it names builds the app it describes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from pipeline.cli.deploy import load_settings
from pipeline.cli.deploy import serve_config as serve_config_command
from pipeline.serve.config import (
    HEADER,
    IMPORT_PATH,
    embed,
    render,
    serve_config,
    settings_args,
    validate_serve_config,
)
from pipeline.settings import Settings
from tests.manifests import SERVE_CONFIG

REGENERATE = "vidx serve-config --no-env --out infra/serve/vidx.yaml"
SECRETS = {
    "s3": {"access_key": "AKIA-not-a-real-key-1", "secret_key": "s3-secret-not-real-22"},
    "amqp": {"url": "amqp://vidx:broker-pass-not-real@rabbitmq:5672/%2F"},
    "api_keys": ["api-key-not-real-0123456789"],
    "admin_key": "admin-key-not-real-0123456789",
}


@pytest.fixture(autouse=True)
def _no_vidx_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings here come from the test alone, whatever the shell exported."""
    import os

    for name in [n for n in os.environ if n.startswith("VIDX_") and n != "VIDX_NO_SKIPS"]:
        monkeypatch.delenv(name)


def deployments(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in config["applications"][0]["deployments"]}


def test_the_committed_default_config_is_the_generators_output() -> None:
    generated = render(serve_config(load_settings(None, use_env=False)))
    assert SERVE_CONFIG.read_text() == generated, f"infra/serve/vidx.yaml is stale: run {REGENERATE}"
    assert generated.startswith(HEADER)


@pytest.mark.parametrize(
    ("values", "gpu"),
    [
        ({}, False),
        ({}, True),
        ({"serve": {"layout": "fused"}}, True),
        ({"autoscale": {"enabled": False}, "serve": {"consumer_replicas": 3, "encoder_replicas": 2}}, False),
        ({"writer": {"catalog_grouped": False}, "serve": {"api_max_queued_requests": -1}}, False),
    ],
    ids=["default", "gpu", "fused-gpu", "fixed-replicas", "no-catalog-writer"],
)
def test_ray_takes_the_config_strictly(values: dict[str, Any], gpu: bool) -> None:
    config = serve_config(Settings(**values), gpu=gpu)
    schema = validate_serve_config(config)
    app = schema.applications[0]
    assert (app.name, app.import_path, app.route_prefix) == ("vidx", IMPORT_PATH, "/")
    assert [d.name for d in app.deployments] == list(deployments(config))


def test_the_gpu_variant_reserves_gpus_by_layout() -> None:
    split = deployments(serve_config(Settings(), gpu=True))
    assert split["Encoder"]["ray_actor_options"]["num_gpus"] == 1.0
    assert split["IndexConsumer"]["ray_actor_options"]["num_gpus"] == 0.0
    fused = deployments(serve_config(Settings(serve={"layout": "fused"}), gpu=True))
    assert (
        fused["Encoder"]["ray_actor_options"]["num_gpus"]
        == fused["IndexConsumer"]["ray_actor_options"]["num_gpus"]
        == pytest.approx(0.2)
    )
    cpu = deployments(serve_config(Settings(), gpu=False))
    assert cpu["Encoder"]["ray_actor_options"]["num_gpus"] == 0.0
    # A GPU share set in the settings wins over the cluster's kind.
    pinned = deployments(serve_config(Settings(serve={"encoder_num_gpus": 0.5}), gpu=False))
    assert pinned["Encoder"]["ray_actor_options"]["num_gpus"] == 0.5


def test_autoscaling_settings_flow_into_the_config() -> None:
    autoscale = {
        "encoder_min_replicas": 2,
        "encoder_max_replicas": 7,
        "encoder_target_ongoing_requests": 9.0,
        "upscale_delay_s": 3.0,
        "downscale_delay_s": 45.0,
        "consumer_min_replicas": 2,
        "consumer_max_replicas": 12,
    }
    config = serve_config(Settings(autoscale=autoscale, serve={"consumer_concurrency": 6}))
    validate_serve_config(config)
    encoder = deployments(config)["Encoder"]["autoscaling_config"]
    assert encoder == {
        "min_replicas": 2,
        "max_replicas": 7,
        "target_ongoing_requests": 9.0,
        "upscale_delay_s": 3.0,
        "downscale_delay_s": 45.0,
    }
    consumer = deployments(config)["IndexConsumer"]
    # The consumer's bounds travel in args: its queue-depth policy is built by the app builder.
    assert "autoscaling_config" not in consumer and "num_replicas" not in consumer
    assert consumer["max_ongoing_requests"] == 6
    args = config["applications"][0]["args"]
    assert args["autoscale"] == autoscale and args["serve"] == {"consumer_concurrency": 6}

    fixed = deployments(serve_config(Settings(autoscale={"enabled": False}, serve={"consumer_replicas": 5})))
    assert fixed["IndexConsumer"]["num_replicas"] == 5 and fixed["Encoder"]["num_replicas"] == 1
    assert "autoscaling_config" not in fixed["Encoder"]


def test_only_the_settings_given_travel_as_args_and_come_back_whole(tmp_path: Path) -> None:
    assert serve_config(Settings())["applications"][0]["args"] == {}
    given = {"s3": {"endpoint_url": "http://minio:9000", "buckets": ["a", "b"]}, "sampling": {"every_s": 2.5}}
    settings = Settings(**given, state_dir=tmp_path)
    args = settings_args(settings)
    assert args == {**given, "state_dir": str(tmp_path)}
    assert Settings(**args).model_dump() == settings.model_dump()


def test_no_credential_reaches_the_config() -> None:
    settings = Settings(**{**SECRETS, "s3": {**SECRETS["s3"], "endpoint_url": "http://minio:9000"}})
    text = render(serve_config(settings))
    for secret in ["AKIA-not-a-real-key-1", "s3-secret-not-real-22", "broker-pass-not-real", "api-key-not-real"]:
        assert secret not in text
    assert "admin-key-not-real" not in text
    assert settings_args(settings) == {"s3": {"endpoint_url": "http://minio:9000"}}


def test_a_url_setting_with_credentials_is_refused_without_quoting_them() -> None:
    settings = Settings(amqp={"management_url": "http://ops:mgmt-pass-not-real@rabbitmq:15672"})
    with pytest.raises(ValueError, match=r"amqp\.management_url.*VIDX_AMQP__MANAGEMENT_URL") as caught:
        serve_config(settings)
    assert "mgmt-pass-not-real" not in str(caught.value)


def _with(config: dict[str, Any], deployment: str, **options: Any) -> dict[str, Any]:
    changed = copy.deepcopy(config)
    for d in changed["applications"][0]["deployments"]:
        if d["name"] == deployment:
            d.update(options)
    return changed


def test_a_misspelled_or_mistyped_field_is_rejected() -> None:
    config = serve_config(Settings())
    with pytest.raises(ValueError, match=r"applications\[0\]\.deployments\[0\]\.max_ongoing_request\b"):
        validate_serve_config(_with(config, "Api", max_ongoing_request=5))
    typo = {"min_replicas": 1, "max_replica": 3}  # Ray's schema takes any dict here
    with pytest.raises(ValueError, match=r"autoscaling_config\.max_replica\b"):
        validate_serve_config(_with(config, "Encoder", autoscaling_config=typo))
    with pytest.raises(ValueError, match=r"ray_actor_options\.num_gpu\b"):
        validate_serve_config(_with(config, "Encoder", ray_actor_options={"num_gpu": 1}))
    with pytest.raises(ValueError, match="unknown fields in the Serve config: proxy_locaton"):
        validate_serve_config({**config, "proxy_locaton": "EveryNode"})
    with pytest.raises(ValueError, match="max_ongoing_requests"):  # strict: no "5" for 5
        validate_serve_config(_with(config, "Api", max_ongoing_requests="5"))
    misspelled = copy.deepcopy(config)
    misspelled["applications"][0]["args"] = {"autoscale": {"consumer_max_replica": 8}}
    with pytest.raises(ValueError, match=r"applications\[0\]\.args\.autoscale\.consumer_max_replica\b"):
        validate_serve_config(misspelled)


def test_the_builder_refuses_args_that_are_no_settings() -> None:
    from pipeline.serve.config import app_builder

    with pytest.raises(ValueError, match=r"unknown settings in the Serve config's args: sampling\.every\b"):
        app_builder({"sampling": {"every": 2}})


def test_the_builder_builds_the_app_the_config_describes(tmp_path: Path) -> None:
    """What Ray does with the file: import ``import_path``, call it with ``args``, build the graph;
    every option the config states is the one the code gives that deployment."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app
    from ray.serve._private.utils import import_attr

    from pipeline.serve.autoscale import POLICY_PATH

    settings = Settings(state_dir=tmp_path, autoscale={"encoder_max_replicas": 3, "consumer_max_replicas": 6})
    config = serve_config(settings)
    app_config = config["applications"][0]
    app = call_user_app_builder_with_args_if_necessary(import_attr(app_config["import_path"]), app_config["args"])
    built = {d.name: d for d in build_app(app, name=app_config["name"]).deployments}
    assert set(built) == set(deployments(config))
    for name, options in deployments(config).items():
        code = built[name]
        c = code._deployment_config
        assert code.ray_actor_options == options["ray_actor_options"], name
        for key in ("max_ongoing_requests", "max_queued_requests", "num_replicas", "graceful_shutdown_timeout_s"):
            if key in options:
                assert getattr(c, key) == options[key], (name, key)
        if "autoscaling_config" in options:
            assert c.autoscaling_config.model_dump(include=set(options["autoscaling_config"])) == pytest.approx(
                options["autoscaling_config"]
            ), name
        if "backpressure_config" in options:
            assert c.backpressure_config.model_dump() == options["backpressure_config"], name
    consumer = built["IndexConsumer"]._deployment_config.autoscaling_config
    assert (consumer.policy.policy_function, consumer.max_replicas) == (POLICY_PATH, 6)
    assert "TextConsumer" not in built  # no text source on


@pytest.mark.parametrize("autoscale", [True, False])
def test_with_a_text_source_on_the_app_has_a_text_consumer_on_the_text_queue(tmp_path: Path, autoscale: bool) -> None:
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app
    from ray.serve._private.utils import import_attr

    settings = Settings(
        state_dir=tmp_path,
        text={"subtitles": True},
        serve={"text_consumer_replicas": 2, "text_consumer_concurrency": 3},
        autoscale={"enabled": autoscale, "text_max_replicas": 5},
    )
    config = serve_config(settings)
    app_config = config["applications"][0]
    app = call_user_app_builder_with_args_if_necessary(import_attr(app_config["import_path"]), app_config["args"])
    built = {d.name: d for d in build_app(app, name=app_config["name"]).deployments}
    text = built["TextConsumer"]._deployment_config
    assert text.max_ongoing_requests == 3 and deployments(config)["TextConsumer"]["max_ongoing_requests"] == 3
    if autoscale:
        assert (text.autoscaling_config.min_replicas, text.autoscaling_config.max_replicas) == (1, 5)
        assert "num_replicas" not in deployments(config)["TextConsumer"]
    else:
        assert text.num_replicas == 2 == deployments(config)["TextConsumer"]["num_replicas"]


def test_embed_rewrites_only_the_serve_config_block() -> None:
    manifest = "# head\nspec:\n  serveConfigV2: |\n    old: 1\n\n    older: 2\n\n  rayClusterConfig:\n    x: 1 # kept\n"
    out = embed(manifest, {"applications": []})
    assert out == "# head\nspec:\n  serveConfigV2: |\n    applications: []\n\n  rayClusterConfig:\n    x: 1 # kept\n"
    assert embed(out, {"applications": []}) == out
    with pytest.raises(ValueError, match="serveConfigV2"):
        embed("spec: {}\n", {})


def _cli() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _main(ctx: typer.Context) -> None:
        ctx.obj = Settings()

    app.command("serve-config")(serve_config_command)
    return app


def test_the_command_writes_the_config_and_the_manifest(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "vidx.yaml"
    done = runner.invoke(_cli(), ["serve-config", "--no-env", "--out", str(out)])
    assert done.exit_code == 0, done.output
    assert out.read_text() == SERVE_CONFIG.read_text()

    manifest = tmp_path / "rayservice.yaml"
    manifest.write_text("kind: RayService\nspec:\n  serveConfigV2: |\n    {}\n  rayClusterConfig: {}\n")
    profile = tmp_path / "settings.yaml"
    profile.write_text("serve:\n  host: 0.0.0.0\n")
    args = ["serve-config", "--settings", str(profile), "--gpu", "--rayservice", str(manifest)]
    done = runner.invoke(_cli(), args)
    assert done.exit_code == 0, done.output
    import yaml

    embedded = yaml.safe_load(yaml.safe_load(manifest.read_text())["spec"]["serveConfigV2"])
    assert embedded == serve_config(Settings(serve={"host": "0.0.0.0"}), gpu=True)


def test_the_command_fails_in_one_line_on_bad_settings(tmp_path: Path) -> None:
    bad = tmp_path / "settings.yaml"
    bad.write_text("serve:\n  port: not-a-port\n")
    done = CliRunner().invoke(_cli(), ["serve-config", "--settings", str(bad)])
    assert done.exit_code == 2
    lines = done.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vidx serve-config: invalid settings: serve.port: ")
    assert "not-a-port" not in done.output
    bad.write_text("- a list\n")
    done = CliRunner().invoke(_cli(), ["serve-config", "--settings", str(bad)])
    assert done.exit_code == 2 and "must hold a mapping" in done.output


def test_the_command_is_registered_in_the_cli() -> None:
    from pipeline.cli.main import app

    assert "serve-config" in [c.name for c in app.registered_commands]

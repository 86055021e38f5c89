"""The deploy manifests hold up offline: the RayService decodes strictly against the pinned KubeRay
CRD, its serveConfigV2 is the generator's output for the Kubernetes profile and passes Ray's schema,
its credentials come from Secrets, and the compose file matches the Compose specification. Each
check is also shown to fail on a broken file. The schemas come from Go's module cache (make install):
a missing one skips, or fails under VIDX_NO_SKIPS=1 (CI)."""

from __future__ import annotations

import copy
import os
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.cli.deploy import load_settings
from pipeline.serve.config import embed, serve_config, validate_serve_config
from tests.manifests import (
    COMPOSE,
    COMPOSE_HA,
    K8S_SETTINGS,
    RAYSERVICE,
    ROOT,
    compose_errors,
    load_yaml,
    rayservice_errors,
)

REGENERATE = (
    "vidx serve-config --no-env --settings infra/kuberay/settings.yaml --gpu --rayservice infra/kuberay/rayservice.yaml"
)
#: Settings that hold credentials: each must reach the pods from a Secret, never as a literal.
SECRET_ENV = {"VIDX_S3__ACCESS_KEY", "VIDX_S3__SECRET_KEY", "VIDX_AMQP__URL", "VIDX_API_KEYS", "VIDX_ADMIN_KEY"}


@pytest.fixture(autouse=True)
def _no_vidx_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("VIDX_") and n != "VIDX_NO_SKIPS"]:
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def rayservice() -> dict[str, Any]:
    document: dict[str, Any] = load_yaml(RAYSERVICE.read_text())
    return document


def containers(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Group name ('head', 'cpu', 'gpu') -> its pod spec."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"]}
    groups.update({g["groupName"]: g for g in cluster["workerGroupSpecs"]})
    return {name: group["template"]["spec"] for name, group in groups.items()}


# -- RayService -----------------------------------------------------------------------------------------


def test_the_rayservice_matches_the_kuberay_crd_strictly(rayservice: dict[str, Any]) -> None:
    assert (rayservice["apiVersion"], rayservice["kind"]) == ("ray.io/v1", "RayService")
    assert rayservice_errors(rayservice) == []


@pytest.mark.parametrize(
    ("path", "wrong"),
    [
        (["spec", "rayClusterConfig", "workerGroupSpecs", 0, "minReplica"], 1),  # top of the CRD's own types
        (["spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0, "imagePulPolicy"], "x"),
        (["spec", "serveConfigv2"], "{}"),
    ],
    ids=["worker-group", "container", "spec"],
)
def test_a_misspelled_field_fails_the_check(rayservice: dict[str, Any], path: list[Any], wrong: Any) -> None:
    broken = copy.deepcopy(rayservice)
    node: Any = broken
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = wrong
    errors = rayservice_errors(broken)
    assert len(errors) == 1 and f"'{path[-1]}' was unexpected" in errors[0], errors


def test_a_mistyped_or_missing_field_fails_the_check(rayservice: dict[str, Any]) -> None:
    broken = copy.deepcopy(rayservice)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["maxReplicas"] = "four"
    del broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["name"]
    errors = rayservice_errors(broken)
    assert any("maxReplicas: 'four' is not of type 'integer'" in e for e in errors), errors
    assert any("'name' is a required property" in e for e in errors), errors


def test_a_key_given_twice_fails_to_load() -> None:
    text = RAYSERVICE.read_text().replace("  rayClusterConfig:\n", "  serveConfigV2: x\n  rayClusterConfig:\n", 1)
    with pytest.raises(yaml.YAMLError, match="duplicate key 'serveConfigV2'"):
        load_yaml(text)


def test_serve_config_v2_is_generated_from_the_kubernetes_profile(rayservice: dict[str, Any]) -> None:
    settings = load_settings(K8S_SETTINGS, use_env=False)
    generated = serve_config(settings, gpu=True)
    embedded = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    assert embedded == generated, f"serveConfigV2 is stale: run {REGENERATE}"
    text = RAYSERVICE.read_text()
    assert embed(text, generated) == text, f"serveConfigV2 is not as the generator writes it: run {REGENERATE}"


def test_serve_config_v2_passes_rays_schema_and_points_in_cluster(rayservice: dict[str, Any]) -> None:
    config = validate_serve_config(yaml.safe_load(rayservice["spec"]["serveConfigV2"]))
    app = config.applications[0]
    assert config.http_options.host == "0.0.0.0"
    assert app.args["s3"]["endpoint_url"].endswith(".svc.cluster.local:9000")
    assert app.args["amqp"]["management_url"].endswith(".svc.cluster.local:15672")
    (encoder,) = [d for d in app.deployments if d.name == "Encoder"]
    assert encoder.ray_actor_options.num_gpus == 1.0


def test_credentials_come_from_secrets_only(rayservice: dict[str, Any]) -> None:
    for group, spec in containers(rayservice).items():
        for container in spec["containers"]:
            env = {e["name"]: e for e in container["env"]}
            assert set(env) >= SECRET_ENV, group
            for name in SECRET_ENV:
                assert set(env[name]) == {"name", "valueFrom"} and "secretKeyRef" in env[name]["valueFrom"], name
    args = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert "url" not in args.get("amqp", {}) and not {"access_key", "secret_key"} & set(args.get("s3", {}))
    assert not {"api_keys", "api_key", "admin_key"} & set(args)


def test_the_manifest_asks_for_quorum_queues_gcs_fault_tolerance_and_spread_cpu_workers(
    rayservice: dict[str, Any],
) -> None:
    """The HA settings: quorum queues on the RabbitMQ cluster, the GCS's state in Redis (its password
    from a Secret) so the head can be replaced, and CPU workers on at least two Kubernetes nodes."""
    args = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["amqp"]["queue_type"] == "quorum"
    cluster = rayservice["spec"]["rayClusterConfig"]
    fault_tolerance = cluster["gcsFaultToleranceOptions"]
    assert fault_tolerance["redisAddress"].endswith(".svc.cluster.local:6379")
    assert set(fault_tolerance["redisPassword"]["valueFrom"]) == {"secretKeyRef"}
    cpu = next(g for g in cluster["workerGroupSpecs"] if g["groupName"] == "cpu")
    assert cpu["minReplicas"] >= 2 and cpu["replicas"] >= 2
    (spread,) = cpu["template"]["spec"]["topologySpreadConstraints"]
    assert (spread["topologyKey"], spread["maxSkew"]) == ("kubernetes.io/hostname", 1)
    assert spread["labelSelector"]["matchLabels"].items() <= cpu["template"]["metadata"]["labels"].items()


def test_gpu_workers_ask_for_gpus_and_cache_the_model(rayservice: dict[str, Any]) -> None:
    gpu = containers(rayservice)["gpu"]
    (container,) = gpu["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert gpu["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in gpu["tolerations"])
    hf_home = {e["name"]: e.get("value") for e in container["env"]}["HF_HOME"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert hf_home.startswith(mounts["model-cache"] + "/")
    assert "model-cache" in {v["name"] for v in gpu["volumes"]}


def test_images_are_pinned_to_the_project_version(rayservice: dict[str, Any]) -> None:
    with (ROOT / "pyproject.toml").open("rb") as f:
        project = tomllib.load(f)["project"]
    images = {c["image"] for spec in containers(rayservice).values() for c in spec["containers"]}
    assert {image.rsplit(":", 1)[-1] for image in images} == {project["version"]}, images
    cluster = rayservice["spec"]["rayClusterConfig"]
    ray_pin = next(d for d in project["dependencies"] if d.startswith("ray[serve]=="))
    assert cluster["rayVersion"] == ray_pin.split("==")[1]


# -- compose --------------------------------------------------------------------------------------------


def test_the_compose_file_matches_the_compose_specification() -> None:
    assert compose_errors(load_yaml(COMPOSE.read_text())) == []


def test_a_broken_compose_file_is_rejected() -> None:
    document = load_yaml(COMPOSE.read_text())
    document["services"]["vidx"]["enviroment"] = document["services"]["vidx"].pop("environment")
    errors = compose_errors(document)
    assert any("'enviroment' was unexpected" in e for e in errors), errors
    document = load_yaml(COMPOSE.read_text())
    document["services"]["minio"]["depends_on"]["rabbitmq"]["condition"] = "service_happy"
    assert any("services.minio.depends_on" in e for e in compose_errors(document))


def test_compose_publishes_on_loopback_only_and_holds_no_credentials() -> None:
    document = load_yaml(COMPOSE.read_text())
    ports = [p for service in document["services"].values() for p in service.get("ports", [])]
    assert ports and all(str(p).startswith("127.0.0.1:") for p in ports), ports
    text = COMPOSE.read_text()
    assert "guest:guest" not in text and "minioadmin" not in text
    env = {k: v for s in document["services"].values() for k, v in (s.get("environment") or {}).items()}
    for name in ("MINIO_ROOT_PASSWORD", "RABBITMQ_DEFAULT_PASS"):
        assert str(env[name]).startswith("${") and ":?" in str(env[name])  # refuses to start unset


def test_the_ha_compose_file_matches_the_specification_and_the_tests_topology() -> None:
    """compose-ha.yaml: valid Compose, loopback ports only, no literal credentials, quorum queues, and
    the same HAProxy config as the topology the tests start (infra/harness/ha.py)."""
    from infra.harness.ha import haproxy_config

    text = COMPOSE_HA.read_text()
    document = load_yaml(text)
    assert compose_errors(document) == []
    services = document["services"]
    ports = [p for service in services.values() for p in service.get("ports", [])]
    assert ports and all(str(p).startswith("127.0.0.1:") for p in ports), ports
    assert "guest:guest" not in text and "minioadmin" not in text
    rabbits = sorted(n for n in services if n.startswith("rmq-"))
    minios = sorted(n for n in services if n.startswith("minio-"))
    assert (len(rabbits), len(minios)) == (3, 4)
    assert services["haproxy"]["environment"]["HAPROXY_CONFIG"] == haproxy_config(rabbits, minios)
    assert services["vidx"]["environment"]["VIDX_AMQP__QUEUE_TYPE"] == "quorum"
    assert services["vidx"]["environment"]["VIDX_S3__ENDPOINT_URL"] == "http://haproxy:9000"
    assert {services[n]["environment"]["VIDX_ERLANG_COOKIE"] for n in rabbits} == {
        "${VIDX_ERLANG_COOKIE:?run infra/compose-credentials.sh (it adds the cookie)}"
    }


@pytest.mark.parametrize(
    ("compose", "service", "host"), [(COMPOSE, "minio", "rabbitmq"), (COMPOSE_HA, "minio-0", "haproxy")]
)
def test_the_compose_minio_publishes_events_as_minio_notify_env_says(compose: Path, service: str, host: str) -> None:
    """The compose files copy events.subscribe.minio_notify_env by hand (YAML can't call it): every target
    variable it emits, with the same value (the broker URL and store limit aside)."""
    from events.config import AmqpSettings
    from events.subscribe import minio_notify_env

    env = load_yaml(compose.read_text())["services"][service]["environment"]
    url = f"amqp://${{VIDX_AMQP_USER}}:${{VIDX_AMQP_PASSWORD}}@{host}:5672"
    wanted = minio_notify_env(AmqpSettings(), url, "/queue")
    optional = {k for k in wanted if "_QUEUE_LIMIT_" in k}  # MinIO's own default applies
    assert {k: v for k, v in wanted.items() if k not in optional} == {
        k: str(v) for k, v in env.items() if k.startswith("MINIO_NOTIFY_") and k not in optional
    }


def test_the_credentials_script_generates_private_distinct_values_once(tmp_path: Path) -> None:
    import stat
    import subprocess

    script = ROOT / "infra" / "compose-credentials.sh"
    target = tmp_path / ".env"
    out = subprocess.run([str(script), str(target)], capture_output=True, text=True, check=True)
    values = dict(line.split("=", 1) for line in target.read_text().splitlines() if "=" in line)
    secrets = {"VIDX_MINIO_PASSWORD", "VIDX_AMQP_PASSWORD", "VIDX_ERLANG_COOKIE"}
    assert set(values) == {"VIDX_MINIO_USER", "VIDX_AMQP_USER"} | secrets
    assert len(set(values.values())) == 5 and all(len(values[k]) == 48 for k in secrets)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert not any(v in out.stdout + out.stderr for v in values.values())  # never printed
    subprocess.run([str(script), str(target)], capture_output=True, check=True)
    assert dict(line.split("=", 1) for line in target.read_text().splitlines() if "=" in line) == values
    # A file written before the HA stack (here without a newline at its end) gets its cookie added on a
    # line of its own, and keeps every other value.
    target.write_text("\n".join(f"{k}={v}" for k, v in values.items() if k != "VIDX_ERLANG_COOKIE"))
    out = subprocess.run([str(script), str(target)], capture_output=True, text=True, check=True)
    again = dict(line.split("=", 1) for line in target.read_text().splitlines() if "=" in line)
    assert again.keys() == values.keys() and len(again["VIDX_ERLANG_COOKIE"]) == 48
    assert {k: again[k] for k in values if k != "VIDX_ERLANG_COOKIE"} == {
        k: v for k, v in values.items() if k != "VIDX_ERLANG_COOKIE"
    }
    assert again["VIDX_ERLANG_COOKIE"] not in out.stdout + out.stderr

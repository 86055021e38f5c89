"""Strict, offline checks of the deploy manifests: the RayService against the CRD that ships with the
pinned KubeRay operator, the compose file against the Compose specification's JSON schema.

Both schemas come from Go modules (pyproject.toml [tool.vidx.pins]) that ``make install`` fetches into
Go's module cache (infra/local/install-schemas.sh); here they are read from that cache only, never
from the network. A CRD's schema accepts unknown fields only where the API server would prune them,
so it is made strict the way kubeconform's ``-strict`` does it: ``additionalProperties: false`` on
every object schema that lists its properties and says nothing else about extra ones.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import tempfile
import tomllib
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
RAYSERVICE = ROOT / "infra/kuberay/rayservice.yaml"
K8S_SETTINGS = ROOT / "infra/kuberay/settings.yaml"
COMPOSE = ROOT / "infra/compose.yaml"
COMPOSE_HA = ROOT / "infra/compose-ha.yaml"
SERVE_CONFIG = ROOT / "infra/serve/vidx.yaml"
CRD_FILE = "config/crd/bases/ray.io_rayservices.yaml"
COMPOSE_SCHEMA_FILE = "schema/compose-spec.json"
GO_TIMEOUT_S = 60


def missing(what: str) -> NoReturn:
    """A tool or file a check needs is not here: a skip, except where nothing may be skipped (CI)."""
    message = f"{what}; run 'make install' (infra/local/install-schemas.sh)"
    if os.environ.get("VIDX_NO_SKIPS") == "1":
        pytest.fail(message)
    pytest.skip(message)


def pin(name: str) -> str:
    with (ROOT / "pyproject.toml").open("rb") as f:
        value: str = tomllib.load(f)["tool"]["vidx"]["pins"][name]
    return value


@cache
def _module_dir(module_pin: str) -> Path | None:
    go = shutil.which("go")
    if go is None:
        return None
    # GOPROXY=off: the module cache or nothing (a test never downloads). Outside any module.
    env = {**os.environ, "GOPROXY": "off", "GOFLAGS": "-mod=mod"}
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run(
            [go, "mod", "download", "-json", module_pin],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=GO_TIMEOUT_S,
        )
    try:
        info = json.loads(done.stdout)
    except ValueError:
        return None
    return Path(info["Dir"]) if info.get("Dir") and not info.get("Error") else None


def module_file(pin_name: str, relative: str) -> Path:
    """``relative`` inside the module pinned as ``pin_name``, from Go's module cache."""
    module_pin = pin(pin_name)
    if shutil.which("go") is None:
        missing(f"no 'go' on PATH to find {module_pin} in the module cache")
    directory = _module_dir(module_pin)
    if directory is None or not (directory / relative).is_file():
        missing(f"{module_pin} ({relative}) is not in Go's module cache")
    return directory / relative


class UniqueKeyLoader(yaml.CSafeLoader if hasattr(yaml, "CSafeLoader") else yaml.SafeLoader):  # type: ignore[misc]
    """YAML's safe loader, refusing a key given twice in one mapping (kubectl refuses it too)."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_yaml(text: str) -> Any:
    """One YAML document; raises yaml.YAMLError, duplicate keys included."""
    return yaml.load(text, Loader=UniqueKeyLoader)


def strict(schema: Any) -> Any:
    """A copy of an OpenAPI v3 schema with ``additionalProperties: false`` wherever an object lists
    its ``properties`` and neither allows extra ones nor keeps unknown fields."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@cache
def rayservice_schema(version: str = "v1") -> dict[str, Any]:
    """The strict schema of a RayService at ``version``, from the pinned operator's CRD."""
    crd = yaml.load(module_file("kuberay", CRD_FILE).read_text(), Loader=UniqueKeyLoader)
    (found,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema: dict[str, Any] = strict(found["schema"]["openAPIV3Schema"])
    return schema


@cache
def compose_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(module_file("compose_spec", COMPOSE_SCHEMA_FILE).read_text())
    return schema


def _messages(validator: Any, document: Any) -> list[str]:
    found = sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in found]


def rayservice_errors(document: Any) -> list[str]:
    """What the strict CRD schema finds wrong with a RayService document ([] when nothing)."""
    # OpenAPI v3's schema objects are JSON Schema draft 4 with extensions (x-kubernetes-*, ignored here).
    return _messages(jsonschema.Draft4Validator(rayservice_schema()), document)


def compose_errors(document: Any) -> list[str]:
    """What the Compose specification's schema finds wrong with a compose document."""
    return _messages(jsonschema.Draft202012Validator(compose_schema()), document)

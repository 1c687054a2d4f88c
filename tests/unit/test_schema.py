"""`ray-slurm schema` (issue 25): Ray's shipped cluster schema with this provider's sections
from the config model; every shipped cluster config passes it, and it refuses what the model
refuses."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from ray_slurm_provider.cli import schema
from ray_slurm_provider.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (ROOT / "cluster-configs").rglob("*.yaml")
                 if "cluster_name" in (yaml.safe_load(p.read_text()) or {}))


@pytest.fixture(scope="module")
def printed() -> dict[str, Any]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["schema"]) == 0
    loaded: dict[str, Any] = json.loads(out.getvalue())
    jsonschema.Draft7Validator.check_schema(loaded)
    return loaded


def errors(schema_: dict[str, Any], config: dict[str, Any]) -> list[str]:
    found = jsonschema.Draft7Validator(schema_).iter_errors(config)
    return [".".join(map(str, e.absolute_path)) + ": " + e.message for e in found]


def test_the_configs_are_found() -> None:
    assert len(CONFIGS) >= 10 and any(p.parent.name == "megatron" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cluster_config_passes_the_printed_schema(printed: dict[str, Any],
                                                        path: Path) -> None:
    assert errors(printed, yaml.safe_load(path.read_text())) == []


def _sandbox() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "cluster-configs" / "sandbox.yaml")
                                            .read_text())
    return loaded


def _node_config(config: dict[str, Any]) -> dict[str, Any]:
    nc: dict[str, Any] = next(iter(config["available_node_types"].values()))["node_config"]
    return nc


@pytest.mark.parametrize("change, where", [
    (lambda c: _node_config(c).update(partiton="cpu"), "node_config: Additional properties"),
    (lambda c: c["provider"].update(slurm_api="grpc"), "provider.slurm_api: 'grpc' is not one"),
    (lambda c: _node_config(c).update(cpus="four"), "node_config.cpus: 'four' is not valid"),
    (lambda c: _node_config(c).update(time=14400), "node_config.time: 14400 is not valid"),
    (lambda c: _node_config(c).update(container={"runtime": "dockr"}), "container.runtime"),
    (lambda c: c["provider"].update(object_store_fraction=1.5), "object_store_fraction"),
    (lambda c: c.update(idle_timout_minutes=5), "Additional properties"),  # Ray's own part
])
def test_the_schema_refuses_what_the_model_refuses(printed: dict[str, Any], change: Any,
                                                   where: str) -> None:
    config = copy.deepcopy(_sandbox())
    assert errors(printed, config) == []
    change(config)
    found = errors(printed, config)
    assert len(found) == 1 and where in found[0], found


def test_rays_schema_is_read_at_run_time_and_the_internal_keys_pass(
        printed: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(printed["properties"]) >= {"cluster_name", "head_node_type", "setup_commands"}
    config = copy.deepcopy(_sandbox())
    config["provider"]["_node_types"] = {}  # what bootstrap writes for the head
    assert errors(printed, config) == []
    fake = {"type": "object", "properties": {
        "provider": {"type": "object"},
        "available_node_types": {"patternProperties": {".*": {"properties": {}}}}}}
    monkeypatch.setattr(schema.rayapi, "config_schema", lambda: copy.deepcopy(fake))
    assert set(schema.cluster_schema()["properties"]) == {"provider", "available_node_types"}


def test_no_copy_of_rays_schema_in_the_repository() -> None:
    # Venvs (.venv, and .venv-ray-floor that scripts/test.sh builds) hold Ray's own copy.
    found = []
    for parent, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith((".venv", ".git"))]
        found += [os.path.join(parent, n) for n in names if n == "ray-schema.json"]
    assert found == []

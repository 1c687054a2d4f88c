"""Every shipped cluster config passes Ray's own schema and this provider's config model."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from ray_slurm_provider.provider.bootstrap import validate

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "cluster-configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_is_valid(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    validate_config(prepare_config(config))
    cluster = validate(config, live=False)
    assert config["head_node_type"] in cluster.node_types


def test_configs_exist() -> None:
    assert {p.name for p in CONFIGS} >= {"sandbox.yaml", "slurm-cpu.yaml", "slurm-gpu.yaml"}

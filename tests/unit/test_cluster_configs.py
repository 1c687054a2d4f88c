"""Every shipped cluster config passes Ray's own schema and this provider's config model."""

from __future__ import annotations

import re
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


def test_the_temp_dir_the_configs_document_is_the_one_jobs_use() -> None:
    """Issue 26.18: slurm-cpu.yaml said `<root>/rsp-<job id>`; the temp dir is
    `<temp_dir_root>/rsp-<uid>/<job id>` (jobs.temp_dir), below the user's private parent."""
    from ray_slurm_provider.jobs import temp_dir

    real = temp_dir("<root>", "<job id>", uid=0).replace("rsp-0", "rsp-<uid>")
    path = re.compile(r"<(?:temp_dir_)?root>/rsp-(?:<[^>]*>|[^ )<])*")
    documented = {(p.name, m.group(0)) for p in CONFIGS for m in path.finditer(p.read_text())}
    assert documented, "a config documents provider.temp_dir_root's dir"
    assert {(name, d.replace("<temp_dir_root>", "<root>")) for name, d in documented} == {
        (name, real) for name, _ in documented}

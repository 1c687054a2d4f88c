"""The validation pipeline (issue 25): one ordered list of findings (level, key path,
message), the same for `ray up`, `ray-slurm validate` and the head's autoscaler at start."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from ray_slurm_provider.provider import validation
from ray_slurm_provider.slurm.client import Node
from tests.fakes import FakeSlurm

BASE: dict[str, Any] = {
    "cluster_name": "c1", "max_workers": 4,
    "provider": {"type": "external", "module": "ray_slurm_provider.provider.SlurmNodeProvider"},
    "head_node_type": "head",
    "available_node_types": {
        "head": {"resources": {"CPU": 0}, "node_config": {"partition": "cpu", "time": "4:00:00"}},
        "a": {"resources": {"CPU": 1}, "node_config": {"partition": "cpu", "time": "1:00:00"}},
        "b": {"resources": {"CPU": 1}, "node_config": {"partition": "cpu", "time": "1:00:00"}},
    },
}


def cfg(**node_configs: dict[str, Any]) -> dict[str, Any]:
    c = copy.deepcopy(BASE)
    for t, nc in node_configs.items():
        c["available_node_types"][t]["node_config"].update(nc)
    return c


def info() -> Any:
    return FakeSlurm(nodes=[Node("n1", "127.0.0.2", "IDLE", 2, 4000, "")], partitions={
        "cpu": {"default": True, "nodes": ["n1"], "max_time_s": 86400},
        "open": {"nodes": ["n1"]}}).cluster_info()


def seen(found: list[validation.Finding]) -> list[tuple[str, str, str]]:
    return [(f.level, f.key, f.rule) for f in found]


def test_a_good_config_has_no_findings() -> None:
    assert validation.validate(cfg(), info=info(), env={}) == []


def test_every_node_types_problem_in_order_with_its_key_path() -> None:
    found = validation.validate(cfg(a={"time": "soon"}, b={"mem": "lots"}))
    assert seen(found) == [("error", "available_node_types.a.node_config.time", "values"),
                           ("error", "available_node_types.b.node_config.mem", "values")]
    assert found[0].message.startswith("'soon' is not a Slurm time limit")
    assert str(found[1]).startswith("available_node_types.b.node_config.mem: 'lots' is not")


def test_a_stage_with_errors_ends_the_run() -> None:
    c = cfg(a={"time": "soon"})  # stage 3
    c["available_node_types"]["b"]["min_workers"] = -1  # stage 1
    c["idle_timout_minutes"] = 5  # stage 2 (Ray's schema)
    assert seen(validation.validate(c)) == [
        ("error", "available_node_types.b.min_workers", "scaling")]
    del c["available_node_types"]["b"]["min_workers"]
    assert seen(validation.validate(c)) == [("error", "(top level)", "ray schema")]
    del c["idle_timout_minutes"]
    assert seen(validation.validate(c)) == [
        ("error", "available_node_types.a.node_config.time", "values")]


def test_the_model_stage_collects_its_rules() -> None:
    c = cfg(a={"partiton": "cpu"})
    c["max_workers"] = -1
    c["worker_start_ray_commands"] = ["ray start --address=x; echo never"]
    assert seen(validation.validate(c)) == [
        ("error", "available_node_types.a.node_config.partiton", "model"),
        ("error", "max_workers", "scaling"),
        ("error", "worker_start_ray_commands[0]", "start commands")]
    c = cfg()
    c["head_node_type"] = "hed"
    (f,) = validation.validate(c)
    assert (f.key, f.rule) == ("head_node_type", "head type") and "'hed' is not one of" in (
        f.message)


def test_live_findings_per_node_type_and_warnings_do_not_stop() -> None:
    found = validation.validate(cfg(a={"partition": "gpu"}, b={"time": "2-00:00:00"},
                                    head={"partition": "open", "time": None}),
                                info=info(), env={"RAY_UP_enable_autoscaler_v2": "0"})
    assert seen(found) == [
        ("warning", "available_node_types.head.node_config.time", "limits"),
        ("error", "available_node_types.a.node_config.partition", "partition"),
        ("error", "available_node_types.b.node_config.time", "limits"),
        ("warning", "available_node_types.head.node_config.exclusive", "autoscaler v1")]


def test_slurm_unreachable_is_a_warning_and_info_is_asked_only_after_the_model() -> None:
    asked = []

    def down() -> Any:
        from ray_slurm_provider.slurm.client import TransientSlurmError

        asked.append(1)
        raise TransientSlurmError("squeue", "Unable to contact slurm controller", "x")

    assert seen(validation.validate(cfg(), info=down)) == [("warning", "slurm", "slurm")]
    validation.validate(cfg(a={"time": "soon"}), info=down)
    assert asked == [1]


def test_accounts_are_checked_when_associations_are_given() -> None:
    from ray_slurm_provider.slurm.sacct import parse_associations

    def assocs() -> Any:
        return parse_associations("team-a||normal|normal\n")

    found = validation.validate(cfg(a={"account": "team-b"}, b={"qos": "normal"}),
                                associations=assocs)
    assert seen(found) == [("error", "available_node_types.a.node_config.account",
                            "accounting")]


def test_ray_up_validate_and_the_head_call_the_same_pipeline(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from ray_slurm_provider.cli import validate as cli_validate
    from ray_slurm_provider.cli.common import Cluster
    from ray_slurm_provider.config import parse_provider
    from ray_slurm_provider.provider import bootstrap
    from ray_slurm_provider.provider.provider import SlurmNodeProvider
    from ray_slurm_provider.state import ClusterDir

    calls: list[str] = []
    real = validation.run

    def spy(config: Any, cluster: Any = None, **kw: Any) -> Any:
        calls.append("yaml" if config is not None else "section")
        return real(config, cluster, **kw)

    monkeypatch.setattr(validation, "run", spy)
    c = cfg()
    c["provider"]["state_dir"] = str(tmp_path)
    bootstrap.validate(copy.deepcopy(c), live=False)  # `ray up`, `run` and `sbatch`
    pcfg = parse_provider(c["provider"])
    cli_validate.validate_findings(Cluster("c.yaml", c, pcfg, ClusterDir(str(tmp_path), "c1")),
                                   live=False)
    monkeypatch.setattr(bootstrap, "_cluster_info", lambda *_: info())
    up = bootstrap.bootstrap_config(copy.deepcopy(c))
    SlurmNodeProvider(up["provider"], "c1")  # the head's autoscaler
    assert calls == ["yaml", "yaml", "yaml", "section"]

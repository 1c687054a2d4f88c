"""Every node-type value is checked before `ray up` submits anything: time format and MaxTime,
drain lead time, GPUs / GPU type / CPUs / memory against the partition, and whatever the
renderer would refuse. Each error names the key path, the bad value and the valid choices."""

from __future__ import annotations

import copy
from typing import Any

import click
import pytest

from ray_slurm_provider.config import ConfigError
from ray_slurm_provider.jobs import temp_dir_root_max
from ray_slurm_provider.provider.bootstrap import validate
from ray_slurm_provider.provider.provider import SlurmNodeProvider
from ray_slurm_provider.slurm.client import Node
from tests.fakes import FakeSlurm

NC = "available_node_types.w.node_config"
BASE: dict[str, Any] = {
    "cluster_name": "c1",
    "provider": {"type": "external", "module": "x"},
    "head_node_type": "head",
    "available_node_types": {
        "head": {"resources": {"CPU": 0}, "node_config": {"partition": "cpu", "time": "4:00:00"}},
        "w": {"resources": {"CPU": 1}, "node_config": {"partition": "cpu", "time": "1:00:00"}},
    },
}


def fake() -> FakeSlurm:
    nodes = [Node("n1", "127.0.0.2", "IDLE", 2, 4000, "gpu:2"),
             Node("n2", "127.0.0.3", "IDLE", 2, 4000, "gpu:a100:4(S:0)")]
    return FakeSlurm(nodes=nodes, partitions={
        "cpu": {"default": True, "nodes": ["n1"], "max_time_s": 86400},
        "gpu": {"nodes": ["n2"], "default_time_s": 3600},
        "open": {"nodes": ["n1"]},
    })


@pytest.fixture(autouse=True)
def live(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ray_slurm_provider.provider.bootstrap._cluster_info",
                        lambda *_: fake().cluster_info())


def cfg(node_config: dict[str, Any] | None = None, resources: dict[str, Any] | None = None,
        **provider: Any) -> dict[str, Any]:
    c = copy.deepcopy(BASE)
    c["provider"].update(provider)
    w = c["available_node_types"]["w"]
    w["node_config"].update(node_config or {})
    w["resources"].update(resources or {})
    return c


@pytest.mark.parametrize("node_config, resources, match", [
    ({"time": "1h"}, {}, rf"{NC}\.time: '1h' is not a Slurm time limit; valid forms: MM, MM:SS"),
    ({"time": "2-00:00:00"}, {}, rf"{NC}\.time: '2-00:00:00' is longer than partition 'cpu' "
     r"allows; valid: at most its MaxTime 1-00:00:00"),
    ({"time": "10", "drain_before_limit_s": 600}, {}, rf"{NC}\.drain_before_limit_s: 600s is "
     r"not shorter than the time limit '10'; valid: 0 to 599"),
    ({"drain_before_limit_s": -1}, {}, rf"{NC}\.drain_before_limit_s: -1 is negative"),
    ({"partition": "gpu", "time": None, "drain_before_limit_s": 3600}, {},
     rf"{NC}\.drain_before_limit_s: 3600s is not shorter than the time limit 01:00:00 of "
     r"partition 'gpu'; valid: 0 to 3599"),
    ({"gpus": 3}, {}, rf"{NC}\.gpus: 3 is more than the 2 GPUs of any node of partition 'cpu'; "
     r"valid: 0 to 2 \(partitions with GPUs: cpu, gpu, open\)"),
    ({"partition": "gpu"}, {"GPU": 8}, r"available_node_types\.w\.resources\.GPU: 8 is more "
     r"than the 4 GPUs of any node of partition 'gpu'; valid: 0 to 4"),
    ({"partition": "gpu", "gpus": 1, "gpu_type": "h100"}, {}, rf"{NC}\.gpu_type: 'h100' is not "
     r"a GPU type of partition 'gpu'; valid: a100"),
    ({"gpus": 1, "gpu_type": "a100"}, {}, rf"{NC}\.gpu_type: 'a100' is not a GPU type of "
     r"partition 'cpu'; valid: none \(untyped GRES\)"),
    ({"cpus": 4}, {}, rf"{NC}\.cpus: 4 is more than the 2 CPUs per node of partition 'cpu'; "
     r"valid: 1 to 2"),
    ({}, {"CPU": 3}, r"available_node_types\.w\.resources\.CPU: 3 is more than the 2 CPUs"),
    ({"mem": "8G"}, {}, rf"{NC}\.mem: '8G' is more than the 4000M per node of partition 'cpu'"),
    ({"mem": "lots"}, {}, rf"{NC}\.mem: 'lots' is not a Slurm memory size; valid: a whole"),
    ({"environment": {"BAD-NAME": "x"}}, {}, r"provider\.environment / "
     rf"{NC}\.environment: invalid value 'BAD-NAME'; allowed: a name matching"),
    ({"sbatch_options": {"partition": "x"}}, {}, rf"{NC}\.sbatch_options: invalid value "
     r"'partition'; allowed: not --partition or a prefix of it"),
    ({"extra_directives": ["--time=5"]}, {}, rf"{NC}\.extra_directives: invalid value"),
    ({"constraint": "a b"}, {}, rf"{NC}\.constraint: invalid value 'a b'; allowed: a node "
     r"feature expression"),
    ({"prologue": ["echo a\r"]}, {}, rf"{NC}\.prologue / initialization_commands / "
     r"worker_setup_commands: invalid value"),
])
def test_bad_values_name_path_value_and_choices(node_config: dict[str, Any],
                                                resources: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        validate(cfg(node_config, resources))


def test_provider_values() -> None:
    with pytest.raises(ConfigError, match=rf"provider\.temp_dir_root: '/{'x' * 40}' is longer "
                       rf"than {temp_dir_root_max()} characters"):
        validate(cfg(temp_dir_root="/" + "x" * 40))
    with pytest.raises(ConfigError, match=r"provider\.state_dir: invalid value '/my dir/c1/logs"):
        validate(cfg(state_dir="/my dir"))
    with pytest.raises(ConfigError, match=r"provider\.environment / .*invalid value 'UID'"):
        validate(cfg(environment={"UID": "0"}))
    with pytest.raises(ConfigError, match=r"provider\.auth\.mode: 'off' is not one of 'token', "
                       r"'disabled'"):
        validate(cfg(auth={"mode": "off"}))
    with pytest.raises(ConfigError, match=r"cluster_name: 'a b' is not a valid name"):
        validate({**cfg(), "cluster_name": "a b"})


def test_good_config_and_no_limit_warning(capsys: pytest.CaptureFixture[str]) -> None:
    validate(cfg({"partition": "gpu", "gpus": 2, "gpu_type": "a100", "time": None}))
    assert capsys.readouterr().err == ""
    validate(cfg({"partition": "open", "time": None}))
    assert ("Warning: available_node_types.w.node_config.time: not set and partition 'open' "
            "has no time limit") in capsys.readouterr().err
    validate(cfg({"partition": "open", "time": "UNLIMITED", "drain_before_limit_s": 0}))


def test_ray_up_refuses_before_submitting() -> None:
    with pytest.raises(click.ClickException, match=rf"Invalid cluster config: {NC}\.time"):
        SlurmNodeProvider.bootstrap_config(cfg({"time": "soon"}))


# --- issue 14.17: Ray's own keys are checked too, with the ranges Ray's schema lacks --------
@pytest.mark.parametrize("where, key, value, match", [
    ("w", "max_workers", -2, r"available_node_types\.w\.max_workers: -2 is negative"),
    ("w", "min_workers", -1, r"available_node_types\.w\.min_workers: -1 is negative"),
    ("w", "min_workers", 5, r"available_node_types\.w\.min_workers: 5 is more than its "
                            r"max_workers 3"),
    (None, "max_workers", -3, r"^max_workers: -3 is negative"),
    (None, "idle_timeout_minutes", -1, r"idle_timeout_minutes: -1 is negative"),
    (None, "upscaling_speed", 0, r"upscaling_speed: 0 is not above 0"),
])
def test_ray_keys_out_of_range_are_refused_with_the_key_path(
        where: str | None, key: str, value: Any, match: str) -> None:
    c = cfg()
    c["available_node_types"]["w"]["max_workers"] = 3
    (c["available_node_types"][where] if where else c)[key] = value
    with pytest.raises(ConfigError, match=match):
        validate(c)
    with pytest.raises(click.ClickException, match=match.lstrip("^")):
        SlurmNodeProvider.bootstrap_config(c)  # `ray up` refuses it before submitting


def test_a_misspelt_key_gets_the_nearest_valid_one() -> None:
    c = cfg()
    c["available_node_types"]["w"]["node_config"]["partiton"] = "cpu"
    with pytest.raises(ConfigError, match=r"node_config\.partiton: unknown key; did you mean "
                                          r"'partition'\?"):
        validate(c)


def test_v1_warns_when_two_ray_nodes_can_share_a_host(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 14.13: v1 keys load by IP, so a worker beside the head (or another worker) on one
    host merges with it, and a busy node can be terminated as idle."""
    from ray_slurm_provider.cluster import parse_cluster
    from ray_slurm_provider.provider.validation import v1_colocation_warning

    monkeypatch.setenv("RAY_UP_enable_autoscaler_v2", "0")
    SlurmNodeProvider.bootstrap_config(cfg())
    err = capsys.readouterr().err
    assert "autoscaler v1" in err and "available_node_types.w.node_config.exclusive" in err
    exclusive = cfg({"exclusive": True})
    exclusive["available_node_types"]["head"]["node_config"]["exclusive"] = True
    assert v1_colocation_warning(parse_cluster(exclusive), {"RAY_UP_enable_autoscaler_v2": "0"}
                                 ) is None
    assert v1_colocation_warning(parse_cluster(cfg()), {}) is None  # v2: matched by job id


def test_a_partition_of_mixed_gpu_types_takes_what_its_largest_node_of_the_type_has(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 15: the accounting sandbox's gpu partition has two h100:2 nodes and one a100:1,
    as real sites mix them. `gpus: 2, gpu_type: h100` fits two nodes; it was refused as
    "more than the 1 GPUs per node" (the smallest node's count)."""
    nodes = [Node("n1", "a", "IDLE", 2, 4000, "gpu:h100:2"),
             Node("n2", "b", "IDLE", 2, 4000, "gpu:h100:2"),
             Node("n3", "c", "IDLE", 2, 4000, "gpu:a100:1")]
    mixed = FakeSlurm(nodes=nodes, partitions={"cpu": {"default": True, "nodes": ["n1"]},
                                               "gpu": {"nodes": ["n1", "n2", "n3"]}})
    monkeypatch.setattr("ray_slurm_provider.provider.bootstrap._cluster_info",
                        lambda *_: mixed.cluster_info())
    validate(cfg({"partition": "gpu", "gpus": 2, "gpu_type": "h100"}))
    validate(cfg({"partition": "gpu", "gpus": 2}))  # untyped: any node with 2
    with pytest.raises(ConfigError, match=rf"{NC}\.gpus: 2 is more than the 1 a100 GPUs of any "
                       r"node of partition 'gpu'; valid: 0 to 1"):
        validate(cfg({"partition": "gpu", "gpus": 2, "gpu_type": "a100"}))
    with pytest.raises(ConfigError, match=rf"{NC}\.gpus: 3 is more than the 2 GPUs of any "
                       r"node of partition 'gpu'; valid: 0 to 2"):
        validate(cfg({"partition": "gpu", "gpus": 3}))

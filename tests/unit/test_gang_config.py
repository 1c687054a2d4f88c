"""Issue 16: a gang node type (`node_config.nodes: N`, N >= 2) is checked before anything is
submitted, by `ray-slurm validate` and `ray up` alike, each error naming the key path."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import pytest

from ray_slurm_provider.config import ConfigError
from ray_slurm_provider.provider.bootstrap import validate
from ray_slurm_provider.provider.provider import SlurmNodeProvider
from tests.unit.test_config_checks import NC, cfg, live  # noqa: F401  (autouse: fake Slurm)


def gang(nodes: Any, max_workers: int | None = 4, min_workers: int | None = 0,
         speed: float | None = 2.0, **node_config: Any) -> dict[str, Any]:
    c = cfg({"nodes": nodes, **node_config})
    if speed is not None:
        c["upscaling_speed"] = speed
    w = c["available_node_types"]["w"]
    if max_workers is not None:
        w["max_workers"] = max_workers
    if min_workers is not None:
        w["min_workers"] = min_workers
    return c


@pytest.mark.parametrize("config, match", [
    (gang(0), rf"{NC}\.nodes: 0 is less than 1; valid: 1 \(one node per job\) or more"),
    (gang(-2), rf"{NC}\.nodes: -2 is less than 1"),
    (gang("two"), rf"{NC}\.nodes: expected an integer, got .two."),
    (gang(2, max_workers=3), r"available_node_types\.w\.max_workers: 3 is not a multiple of "
     rf"{NC}\.nodes 2 \(a gang type starts whole groups of 2 nodes\); valid: 0, 2, 4"),
    (gang(2, max_workers=4, min_workers=1), r"available_node_types\.w\.min_workers: 1 is not "
     rf"a multiple of {NC}\.nodes 2"),
    (gang(2, max_workers=None), r"available_node_types\.w\.max_workers: a gang type "
     r"\(nodes: 2\) needs its own max_workers, a multiple of 2"),
    (gang(2, partition="gpu"), rf"{NC}\.nodes: 2 is more than the 1 node\(s\) of partition "
     r"'gpu'; valid: 1 to 1"),
    # v2 would request part of a group per tick, then terminate members as surplus.
    (gang(2, speed=1.0), rf"upscaling_speed: 1.0 is below {NC}\.nodes 2: the autoscaler "
     r"would ask for part of a gang group at a time .*; valid: 2 or more"),
    (gang(2, speed=0.5), r"upscaling_speed: 0.5 is below"),
])
def test_bad_gangs_are_refused_by_validate_and_ray_up(config: dict[str, Any],
                                                      match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        validate(config)
    with pytest.raises(click.ClickException, match=match):
        SlurmNodeProvider.bootstrap_config(config)


def test_the_head_is_never_a_gang() -> None:
    c = cfg()
    c["available_node_types"]["head"]["node_config"]["nodes"] = 2
    with pytest.raises(ConfigError, match=r"available_node_types\.head\.node_config\.nodes: "
                                          r"the head is one node; valid: 1"):
        validate(c)


def test_a_good_gang_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.fakes import FakeSlurm
    from tests.unit.test_config_checks import fake

    def two_nodes() -> FakeSlurm:
        f = fake()
        f.partitions["cpu"]["nodes"] = ["n1", "n2"]
        return f

    monkeypatch.setattr("ray_slurm_provider.provider.bootstrap._cluster_info",
                        lambda *_: two_nodes().cluster_info())
    cluster = validate(gang(2))
    assert cluster.node_type("w").node_config.nodes == 2
    assert cluster.node_type("head").node_config.nodes == 1


def three_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Partition `cpu` with three nodes: room for a gang of 3."""
    from tests.unit.test_config_checks import fake

    f = fake()
    f.partitions["cpu"]["nodes"] = ["n1", "n2", "n3"]
    f.nodes["n3"] = replace(f.nodes["n1"], name="n3")
    monkeypatch.setattr("ray_slurm_provider.provider.bootstrap._cluster_info",
                        lambda *_: f.cluster_info())


def two_gangs(speed: float | None) -> dict[str, Any]:
    """Gang types `w` (nodes: 2) and `g` (nodes: 3); `upscaling_speed` as given."""
    c = gang(2, speed=speed)
    c["available_node_types"]["g"] = {
        "resources": {"CPU": 1}, "max_workers": 3,
        "node_config": {"partition": "cpu", "time": "1:00:00", "nodes": 3}}
    return c


def test_an_unset_upscaling_speed_becomes_the_largest_gang_nodes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26.5: a user who adds `nodes: N` need not know about upscaling_speed: `ray up`
    (bootstrap_config) sets it to the largest N when the YAML does not set it."""
    three_nodes(monkeypatch)
    resolved = SlurmNodeProvider.bootstrap_config(two_gangs(speed=None))
    assert resolved["upscaling_speed"] == 3
    # One set in the YAML is kept, however large; only one below N is refused (above).
    assert SlurmNodeProvider.bootstrap_config(two_gangs(speed=8))["upscaling_speed"] == 8
    assert SlurmNodeProvider.bootstrap_config(cfg()).get("upscaling_speed") is None
    with pytest.raises(click.ClickException, match=r"upscaling_speed: 2 is below "
                       r"available_node_types\.g\.node_config\.nodes 3"):
        SlurmNodeProvider.bootstrap_config(two_gangs(speed=2))


def test_ray_up_resolves_an_unset_upscaling_speed_for_a_gang(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The whole of `ray up`'s resolution (Ray's defaults, Ray's schema, this provider's
    hooks), as `ray up`, `ray-slurm run` (which runs `ray up`) and `ray-slurm sbatch` do it
    (rayapi.bootstrap_config): the config the head's autoscaler gets has the speed set."""
    import tempfile

    from ray.autoscaler._private import providers

    from ray_slurm_provider import rayapi

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # Ray's config cache
    monkeypatch.setattr(providers, "_provider_instances", {})
    three_nodes(monkeypatch)
    c = two_gangs(speed=None)
    c["provider"] = {"type": "external",
                     "module": "ray_slurm_provider.provider.SlurmNodeProvider",
                     "state_dir": str(tmp_path / "state")}
    c["max_workers"] = 7
    # The keys Ray requires of an external provider's config (they may stay empty).
    c.update({k: [] for k in ("cluster_synced_files", "initialization_commands",
                              "setup_commands", "head_setup_commands", "worker_setup_commands",
                              "head_start_ray_commands", "worker_start_ray_commands")})
    c["file_mounts"] = {}
    resolved = rayapi.bootstrap_config(c)
    assert resolved["upscaling_speed"] == 3

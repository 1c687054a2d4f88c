"""Gang options, placement report and Hydra-style overrides: pure logic."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from ray_slurm_provider.gang.context import FaultSpec
from ray_slurm_provider.gang.overrides import OverrideError, apply_overrides, parse_override
from ray_slurm_provider.gang.placement import node_bundle, shortfall_report
from ray_slurm_provider.gang.spec import GangSpec, SpecError, add_arguments, from_args


def parse(*argv: str) -> GangSpec:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return from_args(p.parse_args(list(argv)))


def test_cli_to_spec() -> None:
    s = parse("--nodes", "2", "--ranks-per-node", "8", "--cpus-per-rank", "8", "--profile",
              "efa", "--env", "NCCL_DEBUG=INFO", "--inject-fault", "crash:3:5",
              "--checkpoint-dir", "/c", "--node-local-checkpoints")
    assert (s.world_size, s.resolved_backend, s.threads) == (16, "nccl", 8)
    assert s.rank_resources() == {"CPU": 8.0, "GPU": 1.0}
    assert node_bundle(s.ranks_per_node, s.rank_resources()) == {"CPU": 64.0, "GPU": 8.0}
    assert s.fault == FaultSpec("crash", 3, 5) and not s.checkpoint_shared
    assert s.profile_env()["NCCL_DEBUG"] == "INFO"
    cpu = parse("--device", "cpu", "--ranks-per-node", "2")
    assert cpu.rank_resources() == {"CPU": 1.0} and cpu.resolved_backend == "gloo"


@pytest.mark.parametrize("kw, msg", [
    ({"nodes": 0}, "at least 1"),
    ({"cvd_policy": "mask"}, "--cvd-policy"),
    ({"max_attempts": 0}, "--max-attempts"),
    ({"env": {"RANK": "1"}}, "launcher owns"),
    ({"env": {"GLOO_SOCKET_IFNAME": "^lo"}}, "plain interface"),
    ({"profiles": ("nope",)}, "unknown profile"),
    ({"s3_uri": "s3://b/p"}, "needs --checkpoint-dir"),
    ({"s3_uri": "gs://b", "checkpoint_dir": "/c"}, "s3://"),
    ({"fault": FaultSpec("crash", 4, 1)}, "not in the gang"),
    ({"stall_timeout_s": 0}, "positive"),
])
def test_spec_refuses(kw: dict[str, object], msg: str) -> None:
    with pytest.raises(SpecError, match=msg):
        GangSpec(nodes=kw.pop("nodes", 2), ranks_per_node=2, **kw).validate()  # type: ignore[arg-type]


def test_shortfall_report_says_what_is_missing() -> None:
    text = shortfall_report(
        {"GPU": 8.0, "CPU": 64.0}, 2, 600.4,
        available={"GPU": 8.0, "CPU": 90.0}, total={"GPU": 16.0, "CPU": 192.0},
        per_node_available={"n1": {"GPU": 8.0, "CPU": 90.0}, "n2": {"GPU": 0.0, "CPU": 2.0}},
        per_node_total={"n1": {"GPU": 8.0, "CPU": 96.0}, "n2": {"GPU": 8.0, "CPU": 96.0},
                        "head": {"CPU": 4.0}})
    lines = text.splitlines()
    assert lines[0].startswith("placement group not ready after 600s: need 2 node(s) x "
                               "{CPU: 64, GPU: 8} on distinct Ray nodes (STRICT_SPREAD)")
    assert "cluster available {CPU: 90, GPU: 8} of total {CPU: 192, GPU: 16}" in text
    assert "missing in all: {CPU: 38, GPU: 8}" in text
    assert "alive nodes big enough for one bundle: 2 of 2 needed" in text
    assert "of those, free right now: 1" in text and "node n2 busy" in text
    small = shortfall_report({"GPU": 8.0}, 3, 5, {"GPU": 16.0}, {"GPU": 16.0}, {},
                             {"a": {"GPU": 8.0}, "b": {"GPU": 8.0}})
    assert "2 of 3 needed" in small and "still scaling up" in small


@dataclass
class Model:
    tensor_model_parallel_size: int = 1
    lr: float = 1e-3
    fused: bool = True
    name: str = "gpt"
    dispatcher: str | None = "deepep"


@dataclass
class Cfg:
    model: Model = field(default_factory=Model)
    extra: dict[str, object] = field(default_factory=lambda: {"a": {"b": 1}})


def test_overrides_on_dataclasses_dicts_and_objects() -> None:
    cfg = Cfg()
    done = apply_overrides(cfg, ["model.tensor_model_parallel_size=8", "model.lr=3",
                                 "model.fused=false", "model.name='007'", "extra.a.b=7",
                                 "+extra.new={x: [1, 2]}", "~model.dispatcher"])
    assert len(done) == 7
    assert cfg.model == Model(8, 3.0, False, "007", None)
    assert cfg.extra == {"a": {"b": 7}, "new": {"x": [1, 2]}}
    ns = SimpleNamespace(train=SimpleNamespace(iters=5))
    apply_overrides(ns, ["train.iters=10", "+train.eval=2"])
    assert (ns.train.iters, ns.train.eval) == (10, 2)


@pytest.mark.parametrize("text, msg", [
    ("model.tp=2", "has no 'tp'.*valid: dispatcher, fused, lr, name"),
    ("modl.lr=1", "the config has no 'modl'"),
    ("model.tensor_model_parallel_size=2.5", "expected an integer"),
    ("model.tensor_model_parallel_size=true", "expected an integer"),
    ("model.fused=1", "expected true/false"),
    ("model.lr=fast", "expected a number"),
    ("+model.lr=1", "already exists"),
    ("model.lr", "expected dotted.key=value"),
    ("model..lr=1", "bad key"),
    ("model.lr=[1", "cannot parse"),
])
def test_bad_overrides_are_errors(text: str, msg: str) -> None:
    with pytest.raises(OverrideError, match=msg):
        apply_overrides(Cfg(), [text])


def test_parse_override_forms() -> None:
    assert parse_override("a.b=").value == ""
    assert parse_override("~a.b").value is None
    assert parse_override("+a=1").add


@dataclass
class _Knobs:
    lr: float = 1e-2
    tag: str = "main"


@pytest.mark.parametrize(("text", "value"), [
    ("lr=3e-4", 3e-4), ("lr=1E5", 1e5), ("lr=-2.5e-3", -2.5e-3), ("lr=.5e1", 5.0),
    ("lr=1.0e-4", 1e-4), ("tag=2e71543", "2e71543"), ("tag='3e-4'", "3e-4"), ("tag=e5", "e5"),
])
def test_numbers_in_exponent_form_are_numbers_where_a_number_is_wanted(
        text: str, value: object) -> None:
    """`3e-4` is how a learning rate is written; YAML 1.1 (PyYAML) reads it as a string, so
    a float field refused it. A string field keeps it (a git hash like 2e71543)."""
    knobs = _Knobs()
    apply_overrides(knobs, [text])
    got = getattr(knobs, text.split("=")[0])
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("text", ["lr=1e999", "lr=-1e999", "lr=.inf", "lr=.nan"])
def test_a_number_that_is_not_finite_is_refused(text: str) -> None:
    with pytest.raises(OverrideError, match="expected a finite number"):
        apply_overrides(_Knobs(), [text])


def test_placement_group_keeps_the_gang_in_one_gang_node_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 16.6: `--placement group` asks Ray for distinct nodes of ONE group (the label the
    provider gives a gang job's members); `spread`, the default, for any distinct nodes."""
    import sys

    import ray.util.placement_group  # noqa: F401  (the module, which ray.util's name hides)

    from ray_slurm_provider.gang import placement
    from ray_slurm_provider.nodespec import GROUP_LABEL

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert from_args(p.parse_args(["--placement", "group"])).placement == "group"
    assert from_args(p.parse_args([])).placement == "spread"
    with pytest.raises(SpecError, match="--placement must be one of spread, group"):
        GangSpec(placement="pack").validate()
    calls: list[dict[str, object]] = []
    monkeypatch.setattr(sys.modules["ray.util.placement_group"], "placement_group",
                        lambda bundles, **kw: calls.append(kw) or kw)
    placement.create(2, {"CPU": 2.0}, "g", one_group=True)
    placement.create(2, {"CPU": 2.0}, "g")
    assert calls == [
        {"name": "g", "topology_strategy": {"ray.io/node-id": "STRICT_SPREAD",
                                            GROUP_LABEL: "STRICT_PACK"}},
        {"strategy": "STRICT_SPREAD", "name": "g"}]

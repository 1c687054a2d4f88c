"""The Megatron template's job scripts, without torch or Megatron: configs, overrides, CLI.

The DeepSeek job cannot run here (Megatron-Bridge needs Transformer Engine and Python 3.12), so
its config handling is checked against a stand-in for what the pinned Bridge's recipe returns.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from ray_slurm_provider.gang import FatalRankError, FaultSpec, RankContext, RankInfo

MEGATRON = Path(__file__).resolve().parents[2] / "cluster-configs" / "megatron"


@pytest.fixture
def mods(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, ModuleType]]:
    monkeypatch.syspath_prepend(str(MEGATRON))
    names = ("deepseek_v2_lite", "tiny_gpt", "launch")
    yield {n: importlib.import_module(n) for n in names}
    for n in names:
        sys.modules.pop(n, None)


def bridge_like() -> SimpleNamespace:
    """The shape of Bridge 0.6.2's ConfigContainer for the fields the job touches."""
    ns = SimpleNamespace
    return ns(
        model=ns(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                 expert_model_parallel_size=8, sequence_parallel=False, seq_length=4096,
                 moe_permute_fusion=True, moe_flex_dispatcher_backend="deepep"),
        dataset=ns(seq_length=4096), train=ns(train_iters=1_000_000, global_batch_size=512,
                                              micro_batch_size=1),
        validation=ns(eval_interval=2000), scheduler=ns(lr_warmup_iters=2000),
        checkpoint=ns(save_interval=2000, save="nemo_experiments", load="nemo_experiments"),
        dist=ns(external_gpu_device_mapping=False))


def test_deepseek_recipe_called_bare_then_seed_settings_then_overrides(
        mods: dict[str, ModuleType]) -> None:
    ds = mods["deepseek_v2_lite"]
    calls: list[tuple[Any, ...]] = []

    def recipe(*args: Any, **kwargs: Any) -> SimpleNamespace:
        calls.append((args, kwargs))
        return bridge_like()

    cfg = ds.build_config(["train.train_iters=1000", "model.tensor_model_parallel_size=4",
                           "model.moe_flex_dispatcher_backend=null"], recipe=recipe)
    assert calls == [((), {})]  # 0.6.2 recipes take no arguments
    m = cfg.model
    assert (m.tensor_model_parallel_size, m.expert_model_parallel_size, m.sequence_parallel,
            m.moe_permute_fusion, m.moe_flex_dispatcher_backend) == (4, 2, True, False, None)
    assert (cfg.train.train_iters, cfg.train.global_batch_size, cfg.validation.eval_interval,
            cfg.scheduler.lr_warmup_iters, cfg.checkpoint.save_interval) == (1000, 64, 100, 50,
                                                                             100)


def test_deepseek_fields_that_moved_between_releases(mods: dict[str, ModuleType]) -> None:
    cfg = bridge_like()
    del cfg.validation
    cfg.train.eval_interval = 2000
    cfg.dataset = SimpleNamespace(sequence_length=2048)
    mods["deepseek_v2_lite"].apply_seed_settings(cfg)
    assert cfg.train.eval_interval == 100 and cfg.dataset.sequence_length == 4096
    del cfg.model.moe_permute_fusion
    with pytest.raises(FatalRankError, match=r"none of model\.moe_permute_fusion"):
        mods["deepseek_v2_lite"].apply_seed_settings(cfg)


def test_deepseek_errors_are_fatal_not_retried(mods: dict[str, ModuleType]) -> None:
    ds = mods["deepseek_v2_lite"]
    with pytest.raises(FatalRankError, match="has no 'tp'"):
        ds.build_config(["model.tp=2"], recipe=bridge_like)

    def old_style(**kw: Any) -> None:
        raise TypeError("unexpected keyword")

    with pytest.raises(FatalRankError, match="recipes take no arguments"):
        ds.build_config([], recipe=lambda: old_style(x=1))
    assert ds.split_hf_path(["hf_path=/m", "a=1"]) == ("/m", ["a=1"])


@pytest.mark.parametrize("policy, external", [("node", False), ("ray", True), ("pop", False)])
def test_deepseek_launcher_settings(mods: dict[str, ModuleType], policy: str,
                                    external: bool) -> None:
    cfg = bridge_like()
    ctx = RankContext(RankInfo(0, 0, 16, 8, 0, 2, cvd_policy=policy, checkpoint_dir="/fsx/c"))
    mods["deepseek_v2_lite"].apply_launcher(cfg, ctx)
    assert cfg.checkpoint.save == cfg.checkpoint.load == "/fsx/c"
    assert cfg.dist.external_gpu_device_mapping is external


def test_forward_step_wrapper_keeps_the_signature_and_beats(mods: dict[str, ModuleType]) -> None:
    def forward_step(state: Any, data_iterator: Any, model: Any,
                     return_schedule_plan: bool = False) -> str:
        return "out"

    exits: list[int] = []
    ctx = RankContext(RankInfo(1, 1, 2, 2, 0, 1), fault=FaultSpec("crash", 1, 7),
                      exit_fn=exits.append)
    step = mods["deepseek_v2_lite"].with_heartbeat(forward_step, ctx)
    assert inspect.signature(step) == inspect.signature(forward_step)
    state = SimpleNamespace(train_state=SimpleNamespace(step=6))
    assert step(state, None, None) == "out" and ctx.poll().last_step == 6
    state.train_state.step = 7
    step(state, None, None)
    assert exits == [43]


def test_tiny_config_overrides(mods: dict[str, ModuleType]) -> None:
    cfg = mods["tiny_gpt"].build_config(["model.tensor_model_parallel_size=2",
                                         "train.train_iters=8", "checkpoint.save_interval=4"])
    assert (cfg.model.tensor_model_parallel_size, cfg.train.train_iters,
            cfg.checkpoint.save_interval, cfg.optimizer.clip_grad) == (2, 8, 4, 1.0)
    with pytest.raises(FatalRankError, match="valid:"):
        mods["tiny_gpt"].build_config(["model.layers=2"])


def test_launch_cli_recipe_defaults_and_overrides(mods: dict[str, ModuleType]) -> None:
    launch = mods["launch"]
    args, ov = launch.parse(["deepseek-v2-lite", "--nodes", "4", "train.train_iters=5"])
    assert (args.nodes, args.ranks_per_node, args.profile) == (4, 8, ["megatron", "efa"])
    assert ov == ["train.train_iters=5"]
    args, ov = launch.parse(["tiny", "--device", "cpu", "a.b=1", "+c=2", "~d"])
    assert (args.nodes, args.ranks_per_node, args.profile, ov) == (1, 1, [], ["a.b=1", "+c=2",
                                                                              "~d"])
    with pytest.raises(SystemExit):
        launch.parse(["tiny", "--no-such-flag"])


def test_launch_refuses_bad_input_before_touching_ray(mods: dict[str, ModuleType],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert mods["launch"].main(["tiny", "--device", "cpu", "model.nope=1"]) == 2
    assert "model has no 'nope'" in capsys.readouterr().err
    assert mods["launch"].main(["tiny", "--cvd-policy", "pop", "--env", "RANK=1"]) == 2

"""The seed's job: DeepSeek-V2-Lite pretraining with Megatron-Bridge, on the Ray gang launcher.

    launch.py deepseek-v2-lite [gang options] [hf_path=/fsx/models/DeepSeek-V2-Lite] [key=value]

Pinned pair: megatron-bridge 0.6.2 with megatron-core 0.19.2 (Python 3.12, Transformer Engine
in the image). In 0.6.2 recipe functions take **no arguments**:
`deepseek_v2_lite_pretrain_config()` is an alias of
`deepseek_v2_lite_pretrain_8gpu_h100_bf16_config()`. The seed called it with keyword arguments
(`tensor_model_parallel_size=8, ...`) from an older revision, which raises TypeError on 0.6.2.
So the recipe is called bare and the seed's settings are applied to the config it returns, then
your `key=value` overrides (Hydra-style, see ray_slurm_provider/launch/overrides.py), e.g.

    train.train_iters=1000 model.tensor_model_parallel_size=4 checkpoint.save_interval=50

`hf_path=DIR` points the recipe's hard-wired Hugging Face id at a local copy (offline clusters).
What the launcher decides is set last: checkpoint save/load directory (`--checkpoint-dir`, so a
gang restart resumes from the newest checkpoint) and `dist.external_gpu_device_mapping` (true
only with `--cvd-policy ray`, where each rank sees one GPU as device 0).

Nothing here imports torch or Megatron at module level: the driver may import this file.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from ray_slurm_provider.gang import FatalRankError, OverrideError, RankContext
from ray_slurm_provider.gang.overrides import Override, apply_override, parse_override

PINNED = {"megatron-bridge": "0.6.2", "megatron-core": "0.19.2"}
HF_ID = "deepseek-ai/DeepSeek-V2-Lite"

#: The seed's settings (its keyword arguments and its one mutation), as paths of the returned
#: config. Alternatives cover fields that moved between Bridge releases; the first one present
#: is set. checkpoint.save_interval: the seed had 0 (never); a restart needs checkpoints.
SEED_SETTINGS: list[tuple[tuple[str, ...], Any]] = [
    (("model.tensor_model_parallel_size",), 8),
    (("model.pipeline_model_parallel_size",), 1),
    (("model.expert_model_parallel_size",), 2),
    (("model.sequence_parallel",), True),
    (("model.seq_length",), 4096),
    (("dataset.seq_length", "dataset.sequence_length"), 4096),
    (("train.train_iters",), 500),
    (("train.global_batch_size",), 64),
    (("train.micro_batch_size",), 1),
    (("validation.eval_interval", "train.eval_interval"), 100),
    (("scheduler.lr_warmup_iters",), 50),
    (("checkpoint.save_interval",), 100),
    (("model.moe_permute_fusion",), False),
]


def _has_path(cfg: Any, path: str) -> bool:
    obj = cfg
    for name in path.split("."):
        if isinstance(obj, dict):
            if name not in obj:
                return False
            obj = obj[name]
        elif hasattr(obj, name):
            obj = getattr(obj, name)
        else:
            return False
    return True


def _set(cfg: Any, path: str, value: Any) -> None:
    try:
        apply_override(cfg, Override(tuple(path.split(".")), value, False, f"{path}={value!r}"))
    except OverrideError as e:
        raise FatalRankError(str(e)) from e


def apply_seed_settings(cfg: Any) -> list[str]:
    applied = []
    for paths, value in SEED_SETTINGS:
        path = next((p for p in paths if _has_path(cfg, p)), None)
        if path is None:
            raise FatalRankError(f"the recipe's config has none of {', '.join(paths)}: is "
                                 f"megatron-bridge {PINNED['megatron-bridge']} installed?")
        _set(cfg, path, value)
        applied.append(f"{path}={value}")
    return applied


def split_hf_path(overrides: Sequence[str]) -> tuple[str | None, list[str]]:
    hf = [o.split("=", 1)[1] for o in overrides if o.startswith("hf_path=")]
    return (hf[-1] if hf else None), [o for o in overrides if not o.startswith("hf_path=")]


def _recipe() -> Callable[[], Any]:
    from megatron.bridge.recipes.deepseek.deepseek_v2 import deepseek_v2_lite_pretrain_config

    return deepseek_v2_lite_pretrain_config  # type: ignore[no-any-return]


def _redirect_hf(hf_path: str) -> Callable[[], None]:
    """Make `AutoBridge.from_hf_pretrained(HF_ID)` load `hf_path`; returns the undo."""
    from megatron.bridge import AutoBridge

    original = AutoBridge.__dict__["from_hf_pretrained"]

    def redirected(cls: Any, path: Any, *a: Any, **k: Any) -> Any:
        return original.__func__(cls, hf_path if path == HF_ID else path, *a, **k)

    AutoBridge.from_hf_pretrained = classmethod(redirected)
    return lambda: setattr(AutoBridge, "from_hf_pretrained", original)


def build_config(overrides: Sequence[str], recipe: Callable[[], Any] | None = None,
                 hf_path: str | None = None) -> Any:
    """The recipe's config, the seed's settings, then `overrides` (in that order)."""
    undo = _redirect_hf(hf_path) if hf_path and recipe is None else None
    try:
        cfg = (recipe or _recipe())()
    except TypeError as e:
        raise FatalRankError(f"recipe call failed ({e}); this job expects megatron-bridge "
                             f"{PINNED['megatron-bridge']}, whose recipes take no arguments") from e
    finally:
        if undo:
            undo()
    apply_seed_settings(cfg)
    for text in overrides:
        try:
            apply_override(cfg, parse_override(text))
        except OverrideError as e:
            raise FatalRankError(str(e)) from e
    return cfg


def apply_launcher(cfg: Any, ctx: RankContext) -> None:
    """What the gang decides, applied last."""
    if ctx.checkpoint_dir:
        cfg.checkpoint.save = ctx.checkpoint_dir
        cfg.checkpoint.load = ctx.checkpoint_dir
    cfg.dist.external_gpu_device_mapping = ctx.info.cvd_policy == "ray"


def check_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for pkg, want in PINNED.items():
        try:
            found[pkg] = version(pkg)
        except PackageNotFoundError as e:
            raise FatalRankError(f"{pkg} is not installed in the rank's environment") from e
        if found[pkg] != want:
            print(f"[deepseek] warning: {pkg} {found[pkg]} is not the tested {want}", flush=True)
    return found


def with_heartbeat(forward_step: Callable[..., Any], ctx: RankContext) -> Callable[..., Any]:
    """forward_step that beats the launcher's heartbeat (functools.wraps keeps the signature
    Bridge inspects to decide which arguments to pass)."""

    @functools.wraps(forward_step)
    def step(*args: Any, **kwargs: Any) -> Any:
        state = args[0] if args else kwargs.get("state")
        it = getattr(getattr(state, "train_state", None), "step", None)
        ctx.heartbeat(int(it) if isinstance(it, int) else None)
        return forward_step(*args, **kwargs)

    return step


def train(ctx: RankContext, payload: dict[str, Any] | None = None) -> dict[str, Any]:
    versions = check_versions()
    hf_path, overrides = split_hf_path(list((payload or {}).get("overrides", [])))
    cfg = build_config(overrides, hf_path=hf_path)
    apply_launcher(cfg, ctx)
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    ctx.heartbeat()
    pretrain(config=cfg, forward_step_func=with_heartbeat(forward_step, ctx))
    return {"versions": versions, "train_iters": int(cfg.train.train_iters)}

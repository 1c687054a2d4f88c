"""A tiny GPT on megatron-core alone: the smallest real Megatron training loop.

It uses what Megatron's own `pretrain()` uses (GPTModel, tensor parallelism, the mcore
DistributedDataParallel wrapper, `get_megatron_optimizer`, the pipeline schedule's
forward-backward function, `dist_checkpointing` in the torch_dist format) and nothing that
needs Transformer Engine, apex or Megatron-Bridge. It trains on synthetic arithmetic sequences
(learnable, so the loss falls in a few steps), checkpoints every `checkpoint.save_interval`
steps and resumes from the newest checkpoint, so a gang restart continues where it left off.

Run it in a gang (see README.md):   launch.py tiny --nodes 2 --ranks-per-node 8 ...
or standalone on one GPU:           python tiny_gpt.py train.train_iters=20
Overrides are Hydra-style keys of `TinyConfig`, e.g. model.tensor_model_parallel_size=2.

On GPUs it uses NCCL and the device the launcher chose. This file holds no CPU workaround:
on a machine without CUDA, megatron-core needs patches, which live in the test suite.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from ray_slurm_provider.gang import FatalRankError, OverrideError, RankContext, apply_overrides

TRACKER = "latest_checkpointed_iteration.txt"


@dataclass
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 128
    seq_length: int = 32
    tensor_model_parallel_size: int = 1
    bf16: bool = False


@dataclass
class TrainConfig:
    train_iters: int = 10
    micro_batch_size: int = 4
    num_microbatches: int = 2
    seed: int = 1234
    distributed_timeout_minutes: int = 10


@dataclass
class OptimizerConfig:
    lr: float = 1e-2
    clip_grad: float = 1.0
    weight_decay: float = 0.0


@dataclass
class CheckpointConfig:
    save_interval: int = 0  # 0: never
    load: bool = True


@dataclass
class TinyConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


def build_config(overrides: list[str]) -> TinyConfig:
    """Defaults plus overrides; importable without torch (the driver checks overrides)."""
    cfg = TinyConfig()
    try:
        apply_overrides(cfg, overrides)
    except OverrideError as e:
        raise FatalRankError(str(e)) from e
    return cfg


def batch(cfg: TinyConfig, dp_rank: int, step: int, micro: int) -> Any:
    """Arithmetic sequences mod vocab, a pure function of (seed, dp rank, step, micro-batch)."""
    import torch

    m, t = cfg.model, cfg.train
    g = torch.Generator().manual_seed(t.seed * 1_000_003 + dp_rank * 10_007 + step * 101 + micro)
    start = torch.randint(0, m.vocab_size, (t.micro_batch_size, 1), generator=g)
    stride = torch.randint(1, 8, (t.micro_batch_size, 1), generator=g)
    seq = (start + stride * torch.arange(m.seq_length + 1)) % m.vocab_size
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _init_distributed(ctx: RankContext, cfg: TinyConfig) -> str:
    import torch
    import torch.distributed as dist

    timeout = timedelta(minutes=cfg.train.distributed_timeout_minutes)
    if ctx.info.device == "gpu":
        torch.cuda.set_device(ctx.info.device_index or 0)
        dist.init_process_group(ctx.info.backend, timeout=timeout,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
        return "cuda"
    dist.init_process_group(ctx.info.backend, timeout=timeout)
    return "cpu"


def _build(cfg: TinyConfig, device: str) -> tuple[Any, Any, Any]:
    import torch
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    m = cfg.model
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=m.tensor_model_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)
    dtype = torch.bfloat16 if m.bf16 else torch.float32
    tcfg = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype, bf16=m.bf16,
        attention_backend=AttnBackend.local, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False, cross_entropy_loss_fusion=False,
    )
    model = GPTModel(config=tcfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=m.vocab_size, max_sequence_length=m.seq_length,
                     position_embedding_type="rope")
    model = model.to(device=device, dtype=dtype)
    ddp = DistributedDataParallel(tcfg, DistributedDataParallelConfig(
        overlap_grad_reduce=False, use_distributed_optimizer=False), module=model)
    opt = get_megatron_optimizer(McoreOptimizerConfig(
        optimizer="adam", lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay,
        clip_grad=cfg.optimizer.clip_grad, bf16=m.bf16, params_dtype=dtype), [ddp])
    tcfg.finalize_model_grads_func = finalize_model_grads
    tcfg.no_sync_func = ddp.no_sync
    return tcfg, ddp, opt


def _sharded_state(ddp: Any, opt: Any, loading: bool) -> dict[str, Any]:
    model_sd = ddp.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=loading)}


def _save(ctx: RankContext, ddp: Any, opt: Any, iteration: int) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    root = ctx.checkpoint_dir
    assert root
    path = os.path.join(root, f"iter_{iteration:07d}")
    if ctx.rank == 0:
        shutil.rmtree(path, ignore_errors=True)  # a partial save of a failed attempt
        os.makedirs(path)
    dist.barrier()
    state = _sharded_state(ddp, opt, loading=False)
    state["iteration"] = iteration
    dist_checkpointing.save(state, path)
    dist.barrier()
    if ctx.rank == 0:
        tmp = os.path.join(root, f".{TRACKER}.tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier()
    ctx.checkpoint_saved(path)


def _load(ctx: RankContext, ddp: Any, opt: Any) -> int:
    from megatron.core import dist_checkpointing

    root = ctx.checkpoint_dir
    tracker = os.path.join(root, TRACKER) if root else ""
    if not tracker or not os.path.exists(tracker):
        return 0
    with open(tracker) as f:
        iteration = int(f.read().strip())
    state = _sharded_state(ddp, opt, loading=True)
    state["iteration"] = 0
    loaded = dist_checkpointing.load(state, os.path.join(root or "", f"iter_{iteration:07d}"))
    ddp.module.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    return int(loaded["iteration"])


def train(ctx: RankContext, payload: dict[str, Any] | None = None) -> dict[str, Any]:
    """The gang entry point: `fn(ctx, payload)` with payload {"overrides": [...]}."""
    t_import = time.monotonic()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cfg = build_config(list((payload or {}).get("overrides", [])))
    m, t = cfg.model, cfg.train
    if ctx.world_size % m.tensor_model_parallel_size:
        raise FatalRankError(f"world size {ctx.world_size} is not a multiple of TP "
                             f"{m.tensor_model_parallel_size}")
    t0 = time.monotonic()
    import_s = t0 - t_import
    device = _init_distributed(ctx, cfg)
    _, ddp, opt = _build(cfg, device)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_group = parallel_state.get_data_parallel_group()
    start = _load(ctx, ddp, opt) if cfg.checkpoint.load else 0
    resumed_from = start
    fwd_bwd = get_forward_backward_func()

    def forward_step(data: Any, model: Any) -> tuple[Any, Any]:
        tokens, labels = next(data)
        tokens, labels = tokens.to(device), labels.to(device)
        pos = torch.arange(m.seq_length, device=device).unsqueeze(0).expand_as(tokens)
        out = model(tokens, pos, None, labels=labels)

        def loss_func(out_tensor: Any) -> tuple[Any, dict[str, Any]]:
            loss = out_tensor.float().mean()
            # The schedule divides the returned loss in place: report a copy.
            return loss, {"lm loss": loss.detach().clone()}

        return out, loss_func

    ctx.heartbeat()
    setup_s = time.monotonic() - t0
    step_times = []
    for step in range(start, t.train_iters):
        ctx.heartbeat(step)
        ts = time.monotonic()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        data = iter([batch(cfg, dp_rank, step, i) for i in range(t.num_microbatches)])
        losses = fwd_bwd(forward_step_func=forward_step, data_iterator=data, model=[ddp],
                         num_microbatches=t.num_microbatches, seq_length=m.seq_length,
                         micro_batch_size=t.micro_batch_size, forward_only=False)
        _, grad_norm, _ = opt.step()
        local = torch.stack([x["lm loss"] for x in losses]).mean().to(device)
        avg = local.clone()
        dist.all_reduce(avg, group=dp_group)
        avg /= dist.get_world_size(group=dp_group)
        step_times.append(time.monotonic() - ts)
        ctx.report(step, loss=float(avg), local_loss=float(local), dp_rank=dp_rank,
                   tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                   grad_norm=None if grad_norm is None else float(grad_norm),
                   step_s=step_times[-1])
        done = step + 1
        if cfg.checkpoint.save_interval and ctx.checkpoint_dir and \
                done % cfg.checkpoint.save_interval == 0 and done < t.train_iters:
            _save(ctx, ddp, opt, done)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    gpu: dict[str, Any] = {}
    if device == "cuda":
        gpu = {"cuda_device": torch.cuda.current_device(),
               "cuda_name": torch.cuda.get_device_name(),
               "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
               "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    n_params = sum(p.numel() for p in ddp.module.parameters())
    return {"config": asdict(cfg), "resumed_from": resumed_from, "setup_s": setup_s,
            "import_s": import_s, "params_per_rank": n_params, **gpu,
            "mean_step_s": sum(step_times) / max(1, len(step_times)), "device": device,
            "torch": str(torch.__version__), "dp_rank": dp_rank}


def main(argv: list[str]) -> None:
    """One process without the launcher (one GPU, or under torchrun): JSON lines out."""
    import json

    from ray_slurm_provider.gang.rendezvous import probe_free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(probe_free_port("127.0.0.1")))
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    if "RSP_DEVICE" not in os.environ:
        import torch

        os.environ["RSP_DEVICE"] = "gpu" if torch.cuda.is_available() else "cpu"
        if os.environ["RSP_DEVICE"] == "gpu":
            os.environ.setdefault("RSP_DEVICE_INDEX", os.environ.get("LOCAL_RANK", "0"))
    ctx = RankContext.from_env()
    result = train(ctx, {"overrides": argv})
    for row in ctx.reports():
        print("REPORT " + json.dumps(row), flush=True)
    print("RESULT " + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])

"""Test-only: let megatron-core 0.16 train on a machine without CUDA (gloo, fp32).

The Megatron template never carries this. The e2e smoke test ships this package to the
cluster with the job (`py_modules`) and names `install` as Ray's `worker_process_setup_hook`,
so it runs in every worker process of the job; the local tests call `install()` directly.
`install()` itself imports nothing heavy: it patches when megatron-core's RNG module is first
imported (a rank importing its recipe), so the job supervisor and the placement probes never
load torch. It does nothing when CUDA is available.

What megatron-core assumes and what stands in for it here (see megatron.md, section 1):

* `torch.cuda.current_device()` names the device of every TP buffer and RoPE table: "cpu".
* The model-parallel RNG tracker keeps CUDA generator states: the CPU generator's instead.
* Factory calls with `device="cuda"` (optimizer scalars, schedule token counters) and
  `Tensor.cuda()`: kept on the CPU. Module-level patches rather than a TorchFunctionMode,
  because a mode is thread-local and Ray runs actor methods in their own threads.
* `torch.cuda.synchronize()` (dist_checkpointing's preload): a no-op.

Still unsupported on CPU (type-string checks in megatron-core): the distributed optimizer,
bf16 with the Megatron optimizer, and gradient clipping (`optimizer.clip_grad=0.0`).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

TRIGGER = "megatron.core.tensor_parallel.random"

FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint")


def _cpu(device: Any) -> Any:
    if device is None:
        return None
    text = str(device)
    return "cpu" if text.startswith("cuda") or text.isdigit() else device


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `_patch` right after TRIGGER is executed, whoever imports it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TRIGGER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    if TRIGGER in sys.modules:
        _patch(sys.modules[TRIGGER])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _patch(mrandom: ModuleType) -> None:
    import torch

    if torch.cuda.is_available() or getattr(torch, "_rsp_cpu_shim", False):
        return

    def wrap(fn: Any) -> Any:
        @functools.wraps(fn)
        def cpu_fn(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            return fn(*args, **kwargs)
        return cpu_fn

    for name in FACTORIES:
        setattr(torch, name, wrap(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.set_rng_state = lambda s, *a, **k: torch.set_rng_state(s)  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment,return-value]
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda s, *a, **k: torch.set_rng_state(s)
    torch._rsp_cpu_shim = True  # type: ignore[attr-defined]

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
* Gradient clipping asserts `grad.type() == "torch.cuda.FloatTensor"`: the optimizer gets the
  same clipping without that assertion.

Still unsupported on CPU (type-string checks deeper in megatron-core): the distributed
optimizer and bf16 with the Megatron optimizer; the smoke test uses neither.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

RNG_MODULE = "megatron.core.tensor_parallel.random"
OPTIMIZER_MODULE = "megatron.core.optimizer.optimizer"

FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint")


def _cpu(device: Any) -> Any:
    if device is None:
        return None
    text = str(device)
    return "cpu" if text.startswith("cuda") or text.isdigit() else device


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs the patch for a module right after the module is executed, whoever imports it."""

    def __init__(self) -> None:
        self.pending = {RNG_MODULE: _patch, OPTIMIZER_MODULE: _patch_clipping}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        patch = self.pending.pop(fullname, None)
        if patch is None:
            return None
        sys.meta_path.remove(self)  # find the real spec without coming back here
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            if self.pending and self not in sys.meta_path:
                sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Patch now what is already imported, the rest when it is imported."""
    if any(isinstance(f, _AfterImport) for f in sys.meta_path):
        return
    finder = _AfterImport()
    for name in list(finder.pending):
        if name in sys.modules:
            finder.pending.pop(name)(sys.modules[name])
    if finder.pending:
        sys.meta_path.insert(0, finder)


def _patch_clipping(optimizer_module: ModuleType) -> None:
    import torch

    if torch.cuda.is_available():
        return

    def clip_grad_by_total_norm_fp32(parameters: Any, max_norm: float, total_norm: float,
                                     use_decoupled_grad: bool = False) -> None:
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        coeff = max_norm / (total_norm + 1.0e-6)
        if coeff < 1.0:
            for p in parameters:
                g = getattr(p, attr, None)
                if g is not None:
                    g.detach().mul_(coeff)

    optimizer_module.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32  # type: ignore[attr-defined]


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
    patches: list[tuple[Any, str, Any]] = [
        (torch.Tensor, "cuda", lambda self, *a, **k: self),
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()),
        (torch.cuda, "set_rng_state", lambda s, *a, **k: torch.set_rng_state(s)),
        (torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed)),
        (mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        (mrandom, "_set_cuda_rng_state", lambda s, *a, **k: torch.set_rng_state(s)),
        (torch, "_rsp_cpu_shim", True),
    ]
    for obj, name, value in patches:
        setattr(obj, name, value)

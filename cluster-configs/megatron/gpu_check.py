#!/usr/bin/env python3
"""GPU check of the Megatron template on ONE GPU machine without internet, in at most 8 minutes.

    # on a connected machine, from the repository root: the wheels the GPU machine lacks
    python3 cluster-configs/megatron/gpu_check.py --prepare          # -> .whl/ (~55 MB)
    # on the GPU machine (python3 3.12 with torch+CUDA), repository and .whl/ carried along
    python3 cluster-configs/megatron/gpu_check.py --out "$OUT"       # <= 480 s
    # the same plumbing on a CPU box (test shim, no bf16, no big model)
    python cluster-configs/megatron/gpu_check.py --dry --out /tmp/gpu-check

Steps, each under its own timeout inside the overall budget (one failing does not stop the rest):
  env        nvidia-smi, torch and CUDA versions, bf16 support
  install    megatron-core 0.19.2 (cp312 wheel), jsonschema and Ray 2.60 (trimmed, unpacked)
             into a private site dir from .whl/, only where the image lacks them; no network
  mcore_fp32 tiny GPT on megatron-core, NCCL world 1, fp32, 20 steps: the loss falls
  mcore_bf16 the same in bf16 (Megatron's Float16Optimizer: the CUDA-only path)
  launcher   a private one-node Ray: the gang launcher with each CUDA_VISIBLE_DEVICES policy
             (node, ray, pop): rank 0 on cuda:0, the mask as the policy says, the loss falls;
             then an injected crash and a gang restart from the checkpoint
  mcore_340m a ~340M-parameter bf16 GPT: step time, tokens/s and peak memory (numbers only)
Writes results.jsonl, summary.txt and one log per step to --out. Exit code 0 when every check
that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MEGATRON = ROOT / "cluster-configs" / "megatron"
WHL = ROOT / ".whl"
SITE = Path(tempfile.gettempdir()) / "rsp-gpu-check-site"
sys.path.insert(0, str(ROOT))
from ray_slurm_provider import proc  # noqa: E402

#: What the GPU image lacks: megatron-core for Python 3.12, Ray, and Ray's jsonschema (with its
#: own dependencies; attrs is in the image). Ray is repacked without its libraries that the
#: check does not use, to fit the 64 MiB a device call may carry (the wheel is 79 MB).
CARRY = {"megatron-core": "0.19.2", "ray": "2.60.0", "jsonschema": "4.26.0",
         "jsonschema-specifications": "2025.9.1", "referencing": "0.37.0",
         "rpds-py": "2026.9.1"}
RAY_DROP = ("ray/rllib/", "ray/data/", "ray/serve/", "ray/llm/", "ray/tune/", "ray/train/",
            "ray/dashboard/client/build/", "ray/air/", "ray/workflow/")
TINY_20 = ["train.train_iters=20"]
BIG = ["model.num_layers=24", "model.hidden_size=1024", "model.num_attention_heads=16",
       "model.seq_length=2048", "model.vocab_size=32768", "model.bf16=true",
       "train.micro_batch_size=4", "train.num_microbatches=1", "train.train_iters=10",
       # The tiny model's 1e-2 made this one diverge on the H200 (loss 10.6 -> 15.3).
       "optimizer.lr=3e-4"]


class Check:
    def __init__(self, out: Path, budget_s: float, dry: bool) -> None:
        self.out, self.budget, self.dry, self.t0 = out, budget_s, dry, time.monotonic()
        self.results: list[dict[str, Any]] = []
        out.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, PYTHONUNBUFFERED="1",
                        PYTHONPATH=os.pathsep.join([str(SITE), str(ROOT), str(MEGATRON),
                                                    os.environ.get("PYTHONPATH", "")]))
        if dry:  # the test suite's CPU shim, in every Python process (Ray workers too)
            shim = Path(tempfile.mkdtemp(prefix="rsp-shim-"))
            (shim / "sitecustomize.py").write_text(
                "import megatron_cpu_shim\nmegatron_cpu_shim.install()\n")
            self.env["PYTHONPATH"] = os.pathsep.join(
                [str(shim), str(ROOT / "tests" / "e2e"), self.env["PYTHONPATH"]])

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def run(self, name: str, argv: list[str], limit: float) -> tuple[int, str, float]:
        timeout = min(limit, self.left() - 10)
        if timeout < 15:
            return -1, "skipped: out of time budget", 0.0
        t = time.monotonic()
        try:
            r = proc.run(argv, timeout=timeout, env=self.env, check=False, cwd=str(ROOT))
            rc, text = r.returncode, r.stdout + r.stderr
        except proc.CommandError as e:
            rc = 124 if isinstance(e, proc.CommandTimeout) else 127
            text = f"{e}\n{e.stdout}{e.stderr}"
        (self.out / f"{name}.log").write_text(text)
        return rc, text, time.monotonic() - t

    def record(self, name: str, ok: bool | None, wall: float, **facts: Any) -> None:
        row = {"step": name, "ok": ok, "wall_s": round(wall, 1), **facts}
        self.results.append(row)
        with (self.out / "results.jsonl").open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        state = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
        print(f"[{time.monotonic() - self.t0:6.1f}s] {state} {name} {wall:.1f}s "
              + json.dumps(facts, default=str)[:400], flush=True)


def lines(text: str, tag: str) -> list[dict[str, Any]]:
    return [json.loads(x.split(" ", 1)[1]) for x in text.splitlines() if x.startswith(tag + " ")]


def step_env(c: Check) -> None:
    rc, _, wall = c.run("env_nvidia_smi", ["nvidia-smi"], 30)
    code = ("import json, torch; c = torch.cuda.is_available(); print('ENV ' + json.dumps("
            "{'python': __import__('sys').version.split()[0], 'torch': str(torch.__version__), "
            "'cuda': torch.version.cuda, 'available': c, 'count': torch.cuda.device_count(), "
            "'gpu': torch.cuda.get_device_name(0) if c else None, 'bf16': c and "
            "torch.cuda.is_bf16_supported(), 'cvd': __import__('os').environ.get("
            "'CUDA_VISIBLE_DEVICES')}))")
    rc2, text2, wall2 = c.run("env", [sys.executable, "-c", code], 60)
    info = (lines(text2, "ENV") or [{}])[0]
    c.record("env", rc2 == 0 and (c.dry or bool(info.get("available"))), wall + wall2,
             nvidia_smi_rc=rc, **info)


def importable(c: Check, module: str) -> bool:
    rc, _, _ = c.run(f"probe_{module}", [sys.executable, "-c", f"import {module}"], 120)
    return rc == 0


def step_install(c: Check) -> None:
    t, done = time.monotonic(), []
    SITE.mkdir(parents=True, exist_ok=True)
    if not all(importable(c, m) for m in ("megatron.core", "jsonschema")):
        wheels = sorted(str(p) for p in WHL.glob("*.whl"))
        rc, _, _ = c.run("install_wheels", [sys.executable, "-m", "pip", "install", "-q",
                                            "--no-index", "--no-deps", "--no-compile",
                                            "--target", str(SITE), *wheels], 120)
        done.append(f"wheels rc={rc}: {[Path(w).name for w in wheels]}")
    if not importable(c, "ray"):
        for tar in sorted(WHL.glob("ray-*.tar.xz")):
            with tarfile.open(tar) as tf:
                tf.extractall(SITE, filter="data")
            done.append(f"unpacked {tar.name}")
    code = ("import json, megatron.core, ray; print('VER ' + json.dumps({'megatron-core': "
            "megatron.core.__version__, 'ray': ray.__version__}))")
    rc, text, _ = c.run("install_check", [sys.executable, "-c", code], 120)
    c.record("install", rc == 0, time.monotonic() - t, actions=done,
             **(lines(text, "VER") or [{}])[0])


def losses_fall(rows: list[dict[str, Any]]) -> tuple[bool, list[float]]:
    ls = [float(r["loss"]) for r in sorted(rows, key=lambda r: r["step"]) if "loss" in r]
    return bool(ls) and ls[-1] < ls[0] - 0.3, [round(x, 4) for x in ls]


def step_tiny(c: Check, name: str, overrides: list[str], limit: float) -> None:
    rc, text, wall = c.run(name, [sys.executable, str(MEGATRON / "tiny_gpt.py"), *overrides],
                           limit)
    if rc == -1:
        return c.record(name, None, 0.0, reason=text)
    res = (lines(text, "RESULT") or [{}])[0]
    ok, ls = losses_fall(lines(text, "REPORT"))
    steps = [r["step_s"] for r in lines(text, "REPORT")][2:]
    step_s = sum(steps) / len(steps) if steps else None
    m = res.get("config", {}).get("model", {})
    t = res.get("config", {}).get("train", {})
    tokens = (t.get("micro_batch_size", 0) * t.get("num_microbatches", 0)
              * m.get("seq_length", 0))
    facts = {"rc": rc, "loss": ls[:1] + ls[-1:], "device": res.get("device"),
             "cuda_name": res.get("cuda_name"), "params": res.get("params_per_rank"),
             "mean_step_s": step_s, "peak_mem_gib": res.get("peak_mem_gib"),
             "tokens_per_s": tokens / step_s if step_s else None}
    want = "cpu" if c.dry else "cuda"
    c.record(name, rc == 0 and res.get("device") == want and (ok or name == "mcore_340m"),
             wall, **facts)


def ray_suite(out_json: str, dry: bool) -> None:
    """Runs inside its own process: one private Ray, the launcher under each policy."""
    import ray

    from ray_slurm_provider.gang import FaultSpec, GangFailed, GangSpec, run_gang

    ray.init(num_cpus=4, num_gpus=0 if dry else None, include_dashboard=False,
             runtime_env={"working_dir": str(MEGATRON)})
    base: dict[str, Any] = dict(
        nodes=1, ranks_per_node=1, device="cpu" if dry else "gpu", cpus_per_rank=1,
        max_attempts=1, pg_timeout_s=60, start_timeout_s=120, stall_timeout_s=60)
    runs: dict[str, Any] = {}
    ckpt = tempfile.mkdtemp(prefix="rsp-gpu-ckpt-")
    cases: list[tuple[str, dict[str, Any], list[str]]] = [
        (p, {"cvd_policy": p}, TINY_20) for p in ("node", "ray", "pop")]
    cases.append(("restart", dict(cvd_policy="node", max_attempts=2, checkpoint_dir=ckpt,
                                  fault=FaultSpec("crash", 0, 6)),
                  ["train.train_iters=12", "checkpoint.save_interval=4"]))
    for name, kw, ov in cases:
        t = time.monotonic()
        try:
            res = run_gang(GangSpec(**{**base, **kw}), "tiny_gpt:train", {"overrides": ov})
        except GangFailed as e:
            res = e.result
        runs[name] = {"wall_s": time.monotonic() - t, **res.as_dict()}
    Path(out_json).write_text(json.dumps(runs, default=str))


def step_launcher(c: Check) -> None:
    out = c.out / "launcher.json"
    rc, text, wall = c.run("launcher", [sys.executable, __file__, "--ray-suite", str(out)]
                           + (["--dry"] if c.dry else []), 300)
    if not out.exists():
        return c.record("launcher", False, wall, rc=rc, tail=text[-800:])
    for name, run in json.loads(out.read_text()).items():
        last = run["attempts"][-1] if run["attempts"] else {}
        r0 = (last.get("results") or {}).get("0", {})
        env, result = r0.get("env", {}), r0.get("result", {})
        ok, ls = losses_fall([x for a in run["attempts"] for x in a["reports"]
                              if x["rank"] == 0 and a is last])
        cvd = env.get("CUDA_VISIBLE_DEVICES")
        if c.dry:
            dev_ok = result.get("device") == "cpu"
        else:
            expect = {"node": cvd not in (None, ""), "ray": cvd not in (None, ""),
                      "pop": cvd is None, "restart": True}[name]
            dev_ok = result.get("device") == "cuda" and result.get("cuda_device") == (
                int(env.get("LOCAL_RANK", "0")) if name == "pop" else 0) and expect
        if name == "restart":
            ok = (len(run["attempts"]) == 2 and not run["attempts"][0]["ok"]
                  and result.get("resumed_from") == 4)
        c.record(f"launcher_{name}", bool(run["ok"] and ok and dev_ok), run["wall_s"],
                 cvd=cvd, local_rank=env.get("LOCAL_RANK"), cuda_device=result.get("cuda_device"),
                 loss=ls[:1] + ls[-1:], attempts=len(run["attempts"]),
                 failure=run["attempts"][0].get("failure") if run["attempts"] else None)


def prepare() -> None:
    """On a connected machine: .whl/ with the cp312 megatron-core wheel and a trimmed Ray."""
    WHL.mkdir(exist_ok=True)
    git = proc.run(["git", "-C", str(ROOT), "rev-parse", "--git-path", "info/exclude"],
                   timeout=30, check=False)
    if git.returncode == 0:  # a worktree's is not under ROOT/.git; a fresh clone may lack it
        exclude = Path(git.stdout.strip())
        if not exclude.is_absolute():
            exclude = ROOT / exclude
        exclude.parent.mkdir(parents=True, exist_ok=True)
        text = exclude.read_text() if exclude.exists() else ""
        if "/.whl/" not in text.splitlines():
            with exclude.open("a") as f:
                f.write(("\n" if text and not text.endswith("\n") else "") + "/.whl/\n")
    plat = ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_24_x86_64",
            "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]
    dl = Path(tempfile.mkdtemp(prefix="rsp-dl-"))
    for pkg, ver in CARRY.items():
        dest = WHL if pkg != "ray" else dl
        proc.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                  "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                  *plat, "-d", str(dest), f"{pkg}=={ver}"], timeout=600)
    (wheel,) = dl.glob("ray-*.whl")
    target = WHL / f"ray-{CARRY['ray']}-cp312-trim.tar.xz"
    with zipfile.ZipFile(wheel) as zf, tarfile.open(target, "w:xz", preset=9) as tf:
        for info in zf.infolist():
            if info.is_dir() or info.filename.startswith(RAY_DROP):
                continue
            ti = tarfile.TarInfo(info.filename)
            ti.size, ti.mode = info.file_size, (info.external_attr >> 16) or 0o644
            with zf.open(info) as src:
                tf.addfile(ti, src)
    for p in sorted(WHL.iterdir()):
        print(f"{p.stat().st_size:>12,} {p}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all steps")
    p.add_argument("--dry", action="store_true", help="CPU plumbing run (test shim)")
    p.add_argument("--prepare", action="store_true", help="build .whl/ (needs network)")
    p.add_argument("--ray-suite", metavar="JSON", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.prepare:
        prepare()
        return 0
    if a.ray_suite:
        ray_suite(a.ray_suite, a.dry)
        return 0
    c = Check(Path(a.out), a.budget, a.dry)
    step_env(c)
    step_install(c)
    step_tiny(c, "mcore_fp32", TINY_20, 120)
    if not a.dry:  # bf16 with Megatron's optimizer is CUDA-only
        step_tiny(c, "mcore_bf16", [*TINY_20, "model.bf16=true"], 120)
    step_launcher(c)
    if not a.dry:
        step_tiny(c, "mcore_340m", BIG, 150)
    ran = [r for r in c.results if r["ok"] is not None]
    summary = "\n".join(f"{'PASS' if r['ok'] else 'FAIL'} {r['step']:<18} {r['wall_s']:>6}s "
                        + json.dumps({k: v for k, v in r.items()
                                      if k not in ("step", "ok", "wall_s")}, default=str)[:300]
                        for r in c.results)
    total = time.monotonic() - c.t0
    summary += f"\n{sum(r['ok'] for r in ran)}/{len(ran)} passed in {total:.0f}s"
    (c.out / "summary.txt").write_text(summary + "\n")
    print(summary)
    return 0 if ran and all(r["ok"] for r in ran) else 1


if __name__ == "__main__":
    sys.exit(main())

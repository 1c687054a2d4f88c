"""The Megatron template's CPU smoke test on the sandbox: `ray up`, `ray job submit`, `ray down`.

It runs the commands of cluster-configs/megatron/README.md (the block between the
`smoke-test` markers, read from the file, so the README and the test cannot drift): a tiny
megatron-core GPT, gloo, one gang node group (one Slurm job of 2 nodes) x 2 ranks per node, TP=2
and DP=2, 8 steps, a checkpoint at step 4, rank 3 crashing at step 5 of attempt 0. It checks the
ranks and their environment, the gang on the two nodes of one Slurm job, a falling loss, one
loss across the data-parallel ranks (and different data on them), and the gang restart resuming
from the checkpoint with the same losses. The only addition to the README's command is the CPU
shim (tests/e2e/megatron_cpu_shim), shipped with the job as a Ray worker setup hook: the
template carries no CPU workaround.

Needs the `megatron-cpu` extra (torch 2.13.0 CPU, megatron-core 0.16.1) in the environment the
sandbox's nodes run (the venv of `ray up`). Timings are printed (pytest -s), never asserted.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import ROOT, RayCluster

pytestmark = [pytest.mark.e2e]
MEGATRON = ROOT / "cluster-configs" / "megatron"
CONFIG = MEGATRON / "sandbox-cpu.yaml"
README = MEGATRON / "README.md"
SHIM = {"py_modules": ["tests/e2e/megatron_cpu_shim"],
        "worker_process_setup_hook": "megatron_cpu_shim.install"}
TIMINGS: dict[str, float] = {}


def readme_commands() -> list[list[str]]:
    """The shell commands of the README's smoke-test block, continuation lines joined."""
    text = README.read_text()
    block = text.split("<!-- smoke-test:begin -->", 1)[1].split("<!-- smoke-test:end -->", 1)[0]
    body = block.split("```bash", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in body.replace("\\\n", " ").splitlines() if line.strip()]


def test_readme_block_is_the_smoke_cluster() -> None:
    cmds = readme_commands()
    assert cmds[0] == ["ray", "up", "-y", str(CONFIG.relative_to(ROOT))]
    assert cmds[1][:2] == ["eval", f"$(ray-slurm env {CONFIG.relative_to(ROOT)})"]
    assert cmds[2][:3] == ["ray", "job", "submit"]
    assert cmds[-1] == ["ray", "down", "-y", str(CONFIG.relative_to(ROOT))]


def by_step(reports: list[dict[str, Any]], rank: int) -> dict[int, dict[str, Any]]:
    return {int(r["step"]): r for r in reports if r["rank"] == rank and "loss" in r}


@pytest.fixture
def cluster(sandbox: object, tmp_path: Path) -> Any:
    for mod in ("torch", "megatron.core"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed: pip install -e '.[megatron-cpu]'")
    c = RayCluster.from_file(tmp_path, "megatron-smoke", CONFIG)
    try:
        t0 = time.monotonic()
        try:
            c.up()
        except AssertionError as e:
            # On a loaded machine the head's raylet can miss Ray's fixed 30 s registration
            # window; `ray up` again restarts Ray in the same head job, as a user would.
            if "timed out during startup" not in str(e):
                raise
            print("RETRY ray up: the head's ray start timed out during startup")
            c.up()
        TIMINGS["ray up"] = time.monotonic() - t0
        yield c
    finally:
        TIMINGS["ray down"] = c.down()
        c.cleanup()
        print("TIMINGS", json.dumps({k: round(v, 1) for k, v in TIMINGS.items()}))


def test_tiny_gpt_gang_with_a_crash_and_a_restart(cluster: RayCluster, tmp_path: Path) -> None:
    t0 = time.monotonic()
    ckpt = tmp_path / "ckpt"
    submit = readme_commands()[2]
    argv = [a.replace("$CKPT", str(ckpt)) for a in submit[1:]]
    argv[2:2] = ["--runtime-env-json", json.dumps(SHIM)]  # after `job submit`
    cp = cluster.ray(*argv, timeout=900, env=cluster.env(RAY_ADDRESS=cluster.dashboard))
    TIMINGS["ray job submit"] = time.monotonic() - t0
    assert "succeeded" in cp.stdout, cp.stdout[-3000:]
    line = next(x for x in cp.stdout.splitlines() if x.startswith("GANG_RESULT "))
    res = json.loads(line.split(" ", 1)[1])
    first, second = res["attempts"]
    TIMINGS.update(attempt0=first["wall_s"], attempt1=second["wall_s"],
                   placement_wait=res["placement_wait_s"])

    # The injected crash: rank 3 died, the whole gang went down, attempt 1 succeeded.
    assert not first["ok"] and first["failed_rank"] == 3, first["failure"]
    assert "died" in first["failure"]
    assert second["ok"] and res["ok"]
    assert first["master"] != second["master"]  # a fresh rendezvous port

    # Ranks, environment and the gang on one group: the 2 nodes (Ray nodes) of ONE Slurm job.
    layout = {d["rank"]: d for d in second["layout"]}
    assert sorted(layout) == [0, 1, 2, 3]
    jobs = {layout[r]["slurm_job_id"] for r in range(4)}
    head = str(cluster.head()["job_id"])
    assert len(jobs) == 1 and jobs == {j for j, _ in cluster.jobs()} - {head}
    assert "placement=group" in cp.stdout
    assert layout[0]["node_id"] == layout[1]["node_id"] != layout[2]["node_id"]
    assert layout[2]["node_id"] == layout[3]["node_id"]
    for r, out in second["results"].items():
        env, rank = out["env"], int(r)
        assert env["RANK"] == r and env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["LOCAL_RANK"] == str(rank % 2) and env["NODE_RANK"] == str(rank // 2)
        assert env["MASTER_ADDR"] == layout[0]["node_ip"]
        assert env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] == "1"
        assert out["slurm_left"] == []  # SLURM_* scrubbed
        assert out["result"]["resumed_from"] == 4  # the checkpoint of attempt 0
        assert out["result"]["dp_rank"] == rank // 2  # TP=2: ranks 0,1 are DP 0
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"

    # One loss across all ranks (DP-averaged); the DP ranks saw different data; TP ranks agree.
    for att in (first, second):
        ranks = {r: by_step(att["reports"], r) for r in range(4)}
        for step, row in ranks[0].items():
            for r in (1, 2, 3):
                if step in ranks[r]:
                    assert ranks[r][step]["loss"] == pytest.approx(row["loss"], abs=1e-6)
            assert ranks[1][step]["local_loss"] == pytest.approx(row["local_loss"], abs=1e-6)
            if step in ranks[2]:
                assert ranks[2][step]["local_loss"] != pytest.approx(row["local_loss"], abs=1e-6)

    # Resumed at step 4 with the same loss as before the crash; the loss falls overall.
    a0, a1 = by_step(first["reports"], 0), by_step(second["reports"], 0)
    assert sorted(a1) == [4, 5, 6, 7] and set(a0) >= {0, 1, 2, 3, 4}
    assert a1[4]["loss"] == pytest.approx(a0[4]["loss"], rel=1e-5)
    losses = [a0[s]["loss"] for s in range(4)] + [a1[s]["loss"] for s in range(4, 8)]
    print("LOSSES", [round(x, 4) for x in losses])
    assert losses[-1] < losses[0] - 0.3
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    assert re.search(r"attempt 1: ok", cp.stdout)

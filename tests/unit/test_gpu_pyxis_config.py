"""Issue 27.4: GPUs stay fake on the sandbox, so the step that cluster-configs/enroot-pyxis.yaml
(the GPU config) renders for a GPU worker is asserted here: its `--container-*` options, and
what reaches enroot's NVIDIA hook (the step's environment)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ray_slurm_provider.agent.container import NodeContainer

CONFIG = Path(__file__).resolve().parents[2] / "cluster-configs" / "enroot-pyxis.yaml"
JOB_ENV = {"SLURM_JOB_ID": "77", "SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "2,3",
           "SLURM_CONF": "/nonexistent/slurm.conf", "PATH": "/usr/bin:/bin"}


def worker(container: dict[str, Any]) -> NodeContainer:
    c = NodeContainer.from_spec(container, cluster_name="pyxis-demo", job_id="77",
                                temp_dir="/tmp/rsp-1000/77", cluster_dir="/home/u/.rsp/pyxis-demo",
                                env=JOB_ENV, drain_timeout_s=10, head=False, env_names=[],
                                log=print)
    assert c is not None
    return c


def test_the_gpu_workers_pyxis_step() -> None:
    raw = yaml.safe_load(CONFIG.read_text())
    nc = raw["available_node_types"]["gpu_worker"]["node_config"]
    assert nc["gpus"] == 8 and nc["container"]["gpus"] is True
    argv, env = worker(nc["container"]).wrap(["ray", "start", "--block"], dict(JOB_ENV))
    assert argv[:5] == ["srun", "--nodes=1", "--ntasks=1", "--overlap", "--kill-on-bad-exit=1"]
    opts = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith("--container-")}
    assert opts["--container-image"] == "/shared/images/ray-slurm-gpu-2.60.0.sqsh"
    assert opts["--container-name"] == "rsp-pyxis-demo-77"
    assert opts["--container-mounts"].split(",") == [
        "/home/u/.rsp/pyxis-demo:/home/u/.rsp/pyxis-demo", "/tmp/rsp-1000/77:/tmp/rsp-1000/77",
        "/scratch:/scratch", "/shared/datasets:/data:ro"]
    # GPUs come from the job's allocation: no GPU option on the step; Slurm's mask and the
    # configured environment reach the container through the step's environment, and
    # NVIDIA_VISIBLE_DEVICES (the hook's switch) is left to the image (NGC: all).
    assert not [a for a in argv if a.startswith(("--gpus", "--gres", "--container-env"))]
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["NCCL_DEBUG"] == "WARN"
    assert "NVIDIA_VISIBLE_DEVICES" not in env
    assert "/opt/ray/bin/ray" in " ".join(argv)


def test_the_enroot_variant_of_the_gpu_worker() -> None:
    """The commented-out `runtime: enroot` block: `enroot start` with the same mounts in
    enroot's fstab form and the environment by name."""
    lines = CONFIG.read_text().splitlines()
    start = lines.index("      # container:") + 1
    block = []
    for ln in lines[start:]:
        if not ln.startswith("      #   "):
            break
        block.append(ln[8:])
    container = yaml.safe_load("\n".join(block))
    assert container["runtime"] == "enroot"
    c = worker(container)
    argv, env = c.wrap(["ray", "start", "--block"], dict(JOB_ENV))
    assert argv[:3] == ["enroot", "start", "--rw"]
    # The NVIDIA hook's switch: exactly the job's GPUs (host ids), as docker's --gpus; the
    # container then numbers them from 0, so Slurm's CUDA_VISIBLE_DEVICES stays out.
    assert env["NVIDIA_VISIBLE_DEVICES"] == "2,3"
    assert argv[argv.index("NVIDIA_VISIBLE_DEVICES") - 1] == "--env"
    assert "CUDA_VISIBLE_DEVICES" not in argv
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "--mount"]
    assert "/scratch:/scratch:none:x-create=auto,rbind" in mounts
    assert argv[argv.index("NCCL_DEBUG") - 1] == "--env"  # by name: no value in argv
    image = "/shared/images/ray-slurm-gpu-2.60.0.sqsh"
    assert c.rt.prepare(c.ctx) == [["enroot", "create", "--force", "--name",
                                    "rsp-pyxis-demo-77", image]]

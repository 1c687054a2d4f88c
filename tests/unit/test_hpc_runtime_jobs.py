"""Run the FULL rendered worker job script of Apptainer, Enroot and Pyxis with recording fake
binaries on PATH and check what the node agent asked them to do (the live runs are
tests/e2e/test_apptainer.py and tests/e2e/test_enroot_pyxis.py; the fake enroot fails where
the real one failed there).

The fakes record their argv and, for `... ray start ...`, print Ray's "started" banner and
exit, so the agent goes through its whole start path (address lookup, flags, container
wrapping, marking Ray up) exactly as in a real job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ray_slurm_provider import auth
from ray_slurm_provider.cluster import NodeCommands, NodeType
from ray_slurm_provider.config import NodeConfig, ProviderConfig
from ray_slurm_provider.jobs import build_job, temp_dir
from ray_slurm_provider.schema import load
from ray_slurm_provider.slurm.script import render
from ray_slurm_provider.state import ClusterDir, HeadInfo

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm-22.05"
FAKE = """#!{python}
import json, os, sys
name = os.path.basename(sys.argv[0])
with open(os.environ["REC"], "a") as f:
    f.write(json.dumps([name, *sys.argv[1:]]) + "\\n")
if name == "scontrol":
    sys.stdout.write(open({nodes!r}).read())
elif name == "enroot":
    # As the real enroot 4.1.2 does (measured on the sandbox): `start` runs a root
    # filesystem `create` made (and `remove` deleted); a --mount is an fstab line with ':'
    # for blanks, so `src:dst:ro` names the filesystem type "ro".
    roots = os.environ["REC"] + ".roots"
    os.makedirs(roots, exist_ok=True)
    args = sys.argv[1:]
    if args[0] == "create":
        os.makedirs(os.path.join(roots, args[args.index("--name") + 1]), exist_ok=True)
    elif args[0] == "remove":
        for n in args[1:]:
            if os.path.isdir(os.path.join(roots, n)):
                os.rmdir(os.path.join(roots, n))
    elif args[0] == "start":
        for i, a in enumerate(args):
            if a == "--mount" and len(args[i + 1].split(":")) >= 3 \
                    and args[i + 1].split(":")[2] != "none":
                sys.exit("enroot-mount: failed to mount: " + args[i + 1] + ": No such device")
        names = [a for a in args if os.path.isdir(os.path.join(roots, a))]
        if not names:
            sys.exit("[ERROR] No such file or directory: " + roots)
        print("Ray runtime started.", flush=True)
elif "start" in sys.argv and "ray" in " ".join(sys.argv):
    print("Ray runtime started.", flush=True)
"""
IMAGES = {"apptainer": "/shared/ray.sif", "enroot": "/shared/ray.sqsh",
          "pyxis": "/shared/ray.sqsh"}


@pytest.mark.parametrize("runtime", ["apptainer", "enroot", "pyxis"])
def test_worker_job_script_drives_the_runtime(runtime: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    for name in ("apptainer", "enroot", "srun", "scontrol"):
        p = fakebin / name
        p.write_text(FAKE.format(python=sys.executable,
                                 nodes=str(FIXTURES / "scontrol_show_node.txt")))
        p.chmod(0o755)
    image = tmp_path / IMAGES[runtime].rsplit("/", 1)[1]
    image.write_bytes(b"hsqs, not really an image")  # the agent checks squashfs's magic
    state = tmp_path / "state"
    pcfg = load(ProviderConfig, {"state_dir": str(state), "auth": {"mode": "token"}},
                "provider")
    ncfg = load(NodeConfig, {"partition": "gpu", "container": {
        "runtime": runtime, "image": str(image), "mounts": ["/data:/data", "/usr:/usr:ro"],
        "environment": {"NCCL_DEBUG": "INFO"}}}, "node_config")
    nt = NodeType("gpu_worker", ncfg, resources={"CPU": 2, "GPU": 1},
                  commands=NodeCommands(start=["ray start --address=$RAY_HEAD_IP:$RAY_GCS_PORT"]))
    spec = build_job(pcfg, "c1", nt, kind="worker", python=sys.executable)
    script = tmp_path / "job.sh"
    script.write_text(render(spec))
    ClusterDir(str(state), "c1").write_head(HeadInfo(job_id="1", ip="127.0.0.2", gcs_port=25000))
    token = auth.ensure_token(ClusterDir(str(state), "c1").root)  # as `ray up` makes it
    rec = tmp_path / "rec.jsonl"
    env = {"PATH": f"{fakebin}:{os.environ['PATH']}", "HOME": str(tmp_path), "REC": str(rec),
           "SLURM_JOB_ID": "900", "SLURMD_NODENAME": "n1", "SLURM_CPUS_ON_NODE": "2",
           "SLURM_JOB_GPUS": "1", "CUDA_VISIBLE_DEVICES": "1",
           "SLURM_CONF": str(tmp_path / "slurm.conf"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cp = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                        timeout=120)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    calls = [json.loads(line) for line in rec.read_text().splitlines()]
    starts = [c for c in calls if "start" in c and c[0] != "scontrol"]
    assert len(starts) == 1, calls
    argv = starts[0]
    ray = argv[argv.index("ray"):]
    assert ray[:2] == ["ray", "start"]
    assert "--address=127.0.0.2:25000" in ray and "--num-gpus=1" in ray
    assert any(a.startswith("--node-ip-address=127.0.0.") for a in ray)
    assert "--block" in ray
    joined = " ".join(argv)
    tmp = temp_dir('/tmp', '900')
    assert "/data:/data" in joined and f"{tmp}:{tmp}" in joined
    if runtime == "apptainer":
        assert argv[:2] == ["apptainer", "exec"] and "--nv" in argv and str(image) in argv
    elif runtime == "enroot":
        create = next(c for c in calls if c[:2] == ["enroot", "create"])
        assert create[-1] == str(image) and "rsp-c1-900" in create
        assert argv[:2] == ["enroot", "start"] and "rsp-c1-900" in argv
        assert ["--env", "NCCL_DEBUG"] == argv[argv.index("NCCL_DEBUG") - 1:][:2]
        assert any(c[:2] == ["enroot", "remove"] for c in calls)  # cleaned up at job end
    else:
        assert argv[0] == "srun" and f"--container-image={image}" in argv
        assert "--container-name=rsp-c1-900" in argv
    assert "Ray is up" in cp.stdout
    # Issue 14.22: the token exists (this used to pass when it did not) and never shows.
    secret = token.read_text().strip()
    assert len(secret) >= 32 and secret not in joined and secret not in cp.stdout

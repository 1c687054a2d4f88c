"""docker/: the Ray node images' Dockerfiles, read as Docker reads them, and the site Epilog.

Neither image can be built on the project's machine (no registry to pull a base image from), so
these tests check what can go wrong without a build: instruction order, build arguments that
are declared but unused or used but invisible (an ARG before FROM is not seen after it unless
declared again), unpinned or `latest` base images, the seed's NCCL/FI environment, that the
package comes from the build context, and that the GPU cluster config repeats the image's
environment. The Epilog runs against a recording fake `docker`; the bare-conda prologue runs
in a rendered batch script against a fake conda.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = {"gpu": DOCKER / "Dockerfile.gpu", "cpu": DOCKER / "Dockerfile.cpu"}
EPILOG = DOCKER / "slurm-epilog-docker.sh"

#: The seed's NCCL/FI environment (its Dockerfile's ENV and its EFA_ENV).
SEED_ENV = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
    "NCCL_SOCKET_IFNAME": "^docker,lo,veth",
    "NCCL_BUFFSIZE": "8388608",
    "NCCL_P2P_NET_CHUNKSIZE": "524288",
}
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?:[:][-+=?][^}]*)?\}|([A-Za-z_][A-Za-z0-9_]*))")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, `\\` continuations joined (a comment
    line inside a continued instruction is skipped, as Docker does)."""
    out: list[tuple[str, str]] = []
    buf: list[str] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not buf):
            continue
        cont = line.endswith("\\")
        buf.append(line[:-1].strip() if cont else line)
        if not cont:
            text = " ".join(b for b in buf if b)
            buf = []
            word, _, rest = text.partition(" ")
            out.append((word.upper(), rest.strip()))
    assert not buf, f"{path.name}: the last instruction ends with a backslash"
    return out


def arg_defaults(args: str) -> tuple[str, str | None]:
    name, eq, default = args.partition("=")
    return name.strip(), (default.strip().strip('"') if eq else None)


def expand(text: str, values: dict[str, str]) -> str:
    def sub(m: re.Match[str]) -> str:
        return values[m.group(1) or m.group(2)]

    return _VAR.sub(sub, text)


def env_values(instrs: list[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for word, args in instrs:
        if word == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                out[key] = value
    return out


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_structure(flavour: str) -> None:
    path = DOCKERFILES[flavour]
    instrs = instructions(path)
    known = {"ARG", "FROM", "RUN", "ENV", "COPY", "LABEL", "SHELL", "CMD", "WORKDIR", "USER"}
    assert {w for w, _ in instrs} <= known, f"{path.name}: unexpected instruction"
    first_from = next(i for i, (w, _) in enumerate(instrs) if w == "FROM")
    assert all(w == "ARG" for w, _ in instrs[:first_from]), "only ARG may precede FROM"
    assert sum(w == "FROM" for w, _ in instrs) == 1
    assert not any(w in ("ENTRYPOINT", "ADD") for w, _ in instrs)
    assert instrs[-1] == ("CMD", '["bash"]')


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_build_args_are_declared_used_and_visible(flavour: str) -> None:
    instrs = instructions(DOCKERFILES[flavour])
    first_from = next(i for i, (w, _) in enumerate(instrs) if w == "FROM")
    global_args = dict(arg_defaults(a) for w, a in instrs[:first_from])
    stage_args = dict(arg_defaults(a) for w, a in instrs[first_from + 1:] if w == "ARG")
    used_in_from = {a or b for a, b in _VAR.findall(instrs[first_from][1])}
    used_in_stage = {a or b for w, args in instrs[first_from + 1:] if w != "ARG"
                     for a, b in _VAR.findall(args)}
    # Every variable FROM uses is a global ARG with a default.
    for name in used_in_from:
        assert global_args.get(name), f"FROM uses ${name}, not a global ARG with a default"
    assert set(global_args) <= used_in_from, "a global ARG is not used by FROM"
    # A global ARG is visible after FROM only when declared again there (checked below).
    env = env_values(instrs)
    shell_vars = {"cuda_mm", "nproc", "PATH", "LD_LIBRARY_PATH"}
    undeclared = used_in_stage - set(stage_args) - set(env) - shell_vars
    assert not undeclared, f"used after FROM but not declared there: {undeclared}"
    for name in stage_args:
        assert name in used_in_stage, f"ARG {name} is declared but never used"
    assert stage_args["RAY_VERSION"] == "2.60.0"


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_base_image_is_pinned(flavour: str) -> None:
    instrs = instructions(DOCKERFILES[flavour])
    first_from = next(i for i, (w, _) in enumerate(instrs) if w == "FROM")
    defaults = {k: v or "" for k, v in (arg_defaults(a) for _, a in instrs[:first_from])}
    image = expand(instrs[first_from][1].split()[0], defaults)
    name, _, tag = image.rpartition(":")
    assert name and tag and "/" not in tag, f"{image}: no tag"
    assert tag != "latest" and "latest" not in image
    # A version number, or a distribution release's code name (which fixes the release and so
    # the Slurm client's version; security updates still roll in).
    assert re.search(r"\d", tag) or tag.split("-")[0] in {"bookworm", "trixie", "jammy",
                                                           "noble"}, f"{image}: no version"
    text = DOCKERFILES[flavour].read_text()
    assert ":latest" not in text and "@latest" not in text


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_installs_ray_this_package_and_the_slurm_client(flavour: str) -> None:
    instrs = instructions(DOCKERFILES[flavour])
    runs = " ".join(a for w, a in instrs if w == "RUN")
    copies = [a.split() for w, a in instrs if w == "COPY"]
    assert '"ray[default]==${RAY_VERSION}"' in runs
    assert "/src" in runs and ["ray_slurm_provider", "/src/ray_slurm_provider"] in copies
    for srcs in copies:
        for src in srcs[:-1]:
            assert (ROOT / src).exists(), f"COPY {src}: not in the build context"
    for pkg in ("slurm-client", "libmunge2", "python3-venv", "bash"):
        assert pkg in runs, f"{pkg} is not installed"
    assert "command -v sbatch squeue scancel scontrol srun" in runs
    ignore = (DOCKER / f"{DOCKERFILES[flavour].name}.dockerignore").read_text().split()
    assert ignore[ignore.index("*"):] == [
        "*", "!pyproject.toml", "!README.md", "!ray_slurm_provider/", "**/__pycache__",
        "**/*.pyc"]


def test_ray_version_fits_the_package() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"ray\[default\]>=([\d.]+),<([\d.]+)"', text)
    assert m, "pyproject.toml: ray[default] range not found"
    low, high = (tuple(int(x) for x in v.split(".")) for v in m.groups())
    assert low <= (2, 60, 0) < high


def test_gpu_image_has_the_seeds_efa_stack_and_environment() -> None:
    instrs = instructions(DOCKERFILES["gpu"])
    args = dict(arg_defaults(a) for w, a in instrs if w == "ARG")
    for name in ("CUDA_VERSION", "UBUNTU_VERSION", "NCCL_VERSION", "EFA_INSTALLER_VERSION",
                 "AWS_OFI_NCCL_VERSION", "GDRCOPY_VERSION"):
        assert name in args, f"ARG {name} missing"
    runs = " ".join(a for w, a in instrs if w == "RUN")
    assert "aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" in runs
    assert "--skip-kmod" in runs and "--with-libfabric=/opt/amazon/efa" in runs
    assert '"libnccl2=${NCCL_VERSION}+cuda${cuda_mm}"' in runs
    env = env_values(instrs)
    for key, value in SEED_ENV.items():
        assert env.get(key) == value, f"ENV {key}={env.get(key)!r}, the seed has {value!r}"
    assert instrs[next(i for i, (w, _) in enumerate(instrs) if w == "FROM")][1] == (
        "nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION}")


def test_gpu_config_repeats_the_images_environment() -> None:
    config = yaml.safe_load((ROOT / "cluster-configs" / "gpu-docker.yaml").read_text())
    image_env = env_values(instructions(DOCKERFILES["gpu"]))
    for name, node_type in config["available_node_types"].items():
        container = node_type["node_config"]["container"]
        assert container["runtime"] == "docker" and container["gpus"] is True
        assert container["privileged"] is False
        assert node_type["node_config"]["gpus"] == 8, name
        assert all(d.startswith("/dev/infiniband/uverbs") for d in container["devices"])
        assert container["ulimits"]["memlock"] == "-1:-1"
        for key, value in SEED_ENV.items():
            assert container["environment"][key] == value == image_env[key]
    head = config["available_node_types"]["head"]
    worker = config["available_node_types"]["gpu_worker"]
    assert worker["min_workers"] == worker["max_workers"] == config["max_workers"] == 1
    assert head["resources"]["GPU"] + worker["resources"]["GPU"] == 16  # 2 nodes x 8 GPUs


def test_example_configs_exist() -> None:
    names = {p.name for p in (ROOT / "cluster-configs").glob("*.yaml")}
    assert names >= {"gpu-docker.yaml", "apptainer.yaml", "enroot-pyxis.yaml",
                     "bare-conda.yaml"}


# -- the Epilog ---------------------------------------------------------------------------

FAKE_DOCKER = """#!/bin/sh
echo "$*" >> "$RECORD"
case "$1" in
    ps) [ -n "$PS_FAIL" ] && exit 1; printf '%s' "$PS_OUT" ;;
    rm) [ -n "$RM_FAIL" ] && exit 1 ;;
esac
exit 0
"""


def run_epilog(tmp_path: Path, job_id: str | None, **env: str) -> tuple[int, list[str]]:
    fake = tmp_path / "docker"
    fake.write_text(FAKE_DOCKER)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    record = tmp_path / "record"
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "DOCKER": str(fake),
            "RECORD": str(record), "PS_OUT": "", "PS_FAIL": "", "RM_FAIL": ""}
    if job_id is not None:
        base["SLURM_JOB_ID"] = job_id
    res = subprocess.run(["/bin/sh", str(EPILOG)], env={**base, **env}, capture_output=True,
                         text=True, timeout=60, check=False)
    calls = record.read_text().splitlines() if record.exists() else []
    return res.returncode, calls


def test_epilog_removes_the_jobs_containers(tmp_path: Path) -> None:
    rc, calls = run_epilog(tmp_path, "4242", PS_OUT="abc123\ndef456\n")
    assert rc == 0
    assert calls == ["ps -aq --filter label=slurm.job_id=4242", "rm -f abc123 def456"]


def test_epilog_without_containers_removes_nothing(tmp_path: Path) -> None:
    rc, calls = run_epilog(tmp_path, "4242")
    assert (rc, calls) == (0, ["ps -aq --filter label=slurm.job_id=4242"])


@pytest.mark.parametrize("env", [{"PS_FAIL": "1"}, {"RM_FAIL": "1", "PS_OUT": "abc\n"}])
def test_epilog_always_exits_0(tmp_path: Path, env: dict[str, str]) -> None:
    # A failing Epilog drains the node.
    rc, _ = run_epilog(tmp_path, "7", **env)
    assert rc == 0


@pytest.mark.parametrize("job_id", [None, "", "12;rm -rf /", "1 2"])
def test_epilog_ignores_a_missing_or_odd_job_id(tmp_path: Path, job_id: str | None) -> None:
    assert run_epilog(tmp_path, job_id) == (0, [])


def test_epilog_without_docker_does_nothing(tmp_path: Path) -> None:
    rc, calls = run_epilog(tmp_path, "5", DOCKER=str(tmp_path / "no-such-docker"))
    assert (rc, calls) == (0, [])


def test_epilog_is_executable() -> None:
    assert EPILOG.stat().st_mode & stat.S_IXUSR
    assert EPILOG.read_text().startswith("#!/bin/sh\n")


# -- the bare-conda prologue --------------------------------------------------------------

def test_bare_conda_prologue_activates_the_env_in_a_non_login_shell(tmp_path: Path) -> None:
    """Render the bare-conda worker's batch script, point its paths at a fake conda, and run
    it with bash as sbatch would (not a login shell, `set -eo pipefail`)."""
    from ray_slurm_provider.jobs import build_job
    from ray_slurm_provider.provider.bootstrap import validate
    from ray_slurm_provider.slurm.script import render

    base, env = tmp_path / "miniforge3", tmp_path / "envs" / "ray"
    (base / "bin").mkdir(parents=True)
    (base / "etc" / "profile.d").mkdir(parents=True)
    (env / "bin").mkdir(parents=True)
    conda = base / "bin" / "conda"
    conda.write_text(f'#!/bin/sh\n[ "$1 $2" = "info --base" ] && echo {base}\n')
    # conda.sh defines the `conda` shell function, as the real one does.
    (base / "etc" / "profile.d" / "conda.sh").write_text(
        'conda() { if [ "$1" = activate ]; then export CONDA_PREFIX="$2" '
        'PATH="$2/bin:$PATH"; else command conda "$@"; fi; }\n')
    agent = env / "bin" / "python"
    agent.write_text('#!/bin/sh\necho "CONDA_PREFIX=$CONDA_PREFIX"\necho "python=$(command -v '
                     'python)"\n')
    for f in (conda, agent):
        f.chmod(0o755)

    text = (ROOT / "cluster-configs" / "bare-conda.yaml").read_text()
    text = text.replace("/shared/miniforge3", str(base)).replace("/shared/envs/ray", str(env))
    config = yaml.safe_load(text)
    cluster = validate(config, live=False)
    pcfg = cluster.provider
    script = tmp_path / "job.sbatch"
    script.write_text(render(build_job(
        pcfg, "conda-demo", cluster.node_type("cpu_worker"), kind="worker", labels={},
        python=str(pcfg.python))))
    res = subprocess.run(["bash", str(script)], env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert f"CONDA_PREFIX={env}" in res.stdout
    assert f"python={agent}" in res.stdout

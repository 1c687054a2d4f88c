"""The command lines each container runtime renders (golden files), and what reaches them."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.agent.container import (
    NodeContainer,
    gpu_ids,
    python_mounts,
    slurm_mounts,
)
from ray_slurm_provider.config import ContainerConfig
from ray_slurm_provider.runtimes import RUNTIMES, RunContext, get_runtime

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "runtimes"
RAY = ["ray", "start", "--address=127.0.0.2:25000", "--block"]


def ctx(runtime: str, **cfg: object) -> RunContext:
    defaults: dict[str, object] = {
        "image": {"apptainer": "/shared/ray.sif", "enroot": "/shared/ray.sqsh",
                  "pyxis": "/shared/ray.sqsh"}.get(runtime, "registry.example/ray:2.60"),
        "mounts": ["/scratch:/scratch"], "environment": {"NCCL_DEBUG": "WARN"},
        "ulimits": {"memlock": "-1:-1"}, "devices": ["/dev/infiniband/uverbs0"],
        "shm_size": "16g", "run_options": ["--cap-add=IPC_LOCK"],
        "run_as_user": False,  # golden files must not depend on who runs the tests
    }
    defaults.update(cfg)
    return RunContext("c1", "4242", ContainerConfig(runtime=runtime, **defaults),  # type: ignore[arg-type]
                      "/tmp/rsp-4242", "/home/u/.ray_slurm/c1", gpu_ids=("2", "3"),
                      drain_timeout_s=5, owner=1000)


def render(runtime: str) -> str:
    rt, c = get_runtime(runtime), ctx(runtime)
    out = {
        "prepare": rt.prepare(c),
        "run": rt.run(c, RAY, {"RAY_AUTH_MODE": "token"}),
        "exec": rt.exec(c, ["bash", "-c", "ray status"]),
        "exec_tty": rt.exec(c, ["bash"], interactive=True),
        "exec_host_python": rt.exec(replace(c, path="/venv/bin:/usr/bin:/bin"), ["true"]),
        "stop": rt.stop(c),
        "remove": rt.remove(c),
        "step_options": rt.step_options(c),
    }
    return json.dumps(out, indent=1) + "\n"


@pytest.mark.parametrize("runtime", sorted(set(RUNTIMES) - {"none"}))
def test_golden(runtime: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Enroot's second `start` passes what the caller has of these (hpc.EXEC_ENV).
    for name in ("PATH", "PYTHONPATH", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")
    path = GOLDEN / f"{runtime}.json"
    text = render(runtime)
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text()


def test_docker_binds_job_life_and_only_allocated_gpus() -> None:
    argv = get_runtime("docker").run(ctx("docker", run_as_user=True), RAY,
                                     {"RAY_AUTH_MODE": "token"})
    assert argv[:5] == ["docker", "run", "--rm", "--init", "--name"]
    assert "rsp-c1-4242" in argv and "slurm.job_id=4242" in argv
    assert "-d" not in argv and "--detach" not in argv  # foreground: the job owns it
    assert argv[argv.index("--gpus") + 1] == '"device=2,3"'
    assert argv[argv.index("--user") + 1] == f"{os.getuid()}:{os.getgid()}"
    assert "--privileged" not in argv  # opt-in only
    assert "token" not in " ".join(argv)  # env values never on the command line
    assert ["-e", "RAY_AUTH_MODE"] == argv[argv.index("RAY_AUTH_MODE") - 1:][:2]


def test_privileged_and_devices_are_opt_in() -> None:
    plain = get_runtime("docker").run(ctx("docker", devices=[]), RAY, {})
    assert "--privileged" not in plain and "--device" not in plain
    priv = get_runtime("docker").run(ctx("docker", privileged=True), RAY, {})
    assert "--privileged" in priv


def test_tar_image_needs_a_tag() -> None:
    with pytest.raises(ValueError, match="image_tag"):
        get_runtime("docker").run(ctx("docker", image="/shared/ray.tar"), RAY, {})
    c = ctx("docker", image="/shared/ray.tar.gz", image_tag="ray:site")
    assert get_runtime("docker").prepare(c) == [["docker", "load", "--input",
                                                "/shared/ray.tar.gz"]]
    assert "ray:site" in get_runtime("docker").run(c, RAY, {})


def test_gpu_ids_come_from_slurm() -> None:
    assert gpu_ids({"SLURM_JOB_GPUS": "4,5"}) == ("4", "5")
    assert gpu_ids({}) == ()


def test_slurm_mounts_follow_the_config(tmp_path: Path) -> None:
    conf = tmp_path / "etc" / "slurm.conf"
    conf.parent.mkdir()
    conf.write_text(f"AuthType=auth/munge\nAuthInfo=socket={tmp_path}/munge/munge.socket\n")
    assert slurm_mounts({"SLURM_CONF": str(conf)}) == (
        f"{conf.parent}:{conf.parent}:ro", f"{tmp_path}/munge:{tmp_path}/munge")


def test_container_env_passes_ray_settings_by_name(tmp_path: Path) -> None:
    nc = NodeContainer(ContainerConfig(runtime="docker", image="x", gpus=True,
                                       environment={"A": "1"}),
                       cluster_name="c1", job_id="7", temp_dir=str(tmp_path / "t"),
                       cluster_dir=str(tmp_path), env={"SLURM_JOB_GPUS": "0"},
                       drain_timeout_s=5, head=False, env_names=["MY_VAR"], log=print)
    env = {"RAY_AUTH_MODE": "token", "CUDA_VISIBLE_DEVICES": "0", "MY_VAR": "x",
           "UNRELATED": "y", "DOCKER_HOST": "unix:///d.sock"}
    argv, full = nc.wrap(["/venv/bin/ray", "start", "--block"], env)
    passed = {argv[i + 1] for i, a in enumerate(argv) if a == "-e"}
    assert passed == {"RAY_AUTH_MODE", "MY_VAR", "A", "DOCKER_HOST"}
    assert full["A"] == "1"
    assert argv[-3:] == ["ray", "start", "--block"]  # the image's ray, not the host path


def test_the_agent_records_its_containers_binds_and_gpus(tmp_path: Path) -> None:
    """What `ray exec` needs to enter an apptainer node alike (test_runner.py uses it)."""
    import sys

    from ray_slurm_provider.state import AgentInfo

    conf = tmp_path / "slurm.conf"
    conf.write_text("AuthInfo=socket=/run/m/munge.socket\n")
    nc = NodeContainer(ContainerConfig(runtime="apptainer", image="/i.sif", host_python=True),
                       cluster_name="c1", job_id="7", temp_dir=str(tmp_path / "t"),
                       cluster_dir=str(tmp_path), env={"SLURM_JOB_GPUS": "2,3",
                                                       "SLURM_CONF": str(conf)},
                       drain_timeout_s=5, head=True, env_names=[], log=print)
    info = nc.recorded(AgentInfo(host="n1", pid=1, kind="head", job_id="7"))
    assert info.container_gpus == ["2", "3"] and info.job_id == "7"
    assert info.container_path.startswith(f"{os.path.dirname(sys.executable)}:")
    assert info.container_mounts[:2] == [f"{tmp_path}:{tmp_path}:ro", "/run/m:/run/m"]
    assert info.container_mounts[2:] == list(python_mounts())


def test_a_bound_debian_python_brings_its_interpreter_and_library(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With Debian's Python (base prefix /usr, never bound whole) the interpreter and its
    standard library are bound: an image's own /usr, or a Slurm root's, has neither."""
    import sys

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to("/usr/bin/python3.11")
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setattr(sys, "executable", str(venv / "bin" / "python"))
    monkeypatch.setattr(sys, "version_info", (3, 11, 2))
    mounts = python_mounts()
    assert "/usr/bin/python3.11:/usr/bin/python3.11:ro" in mounts
    assert "/usr/lib/python3.11:/usr/lib/python3.11:ro" in mounts
    assert f"{venv}:{venv}:ro" in mounts
    assert not any(m.startswith("/usr:") for m in mounts)


def test_the_container_docs_say_what_the_code_does_about_the_user() -> None:
    """Issue 13.7: docs/containers.md said the provider never adds `--user`; it does, by
    default (`container.run_as_user`)."""
    from pathlib import Path

    from ray_slurm_provider.config import ContainerConfig

    text = (Path(__file__).resolve().parents[2] / "docs" / "containers.md").read_text()
    assert ContainerConfig().run_as_user is True
    assert "does not add `--user`" not in text
    assert "`container.run_as_user: true`, the default" in text


@pytest.mark.parametrize("runtime", ["docker", "podman"])
def test_containers_carry_their_owner_and_the_sweep_lists_only_the_callers(runtime: str) -> None:
    """Issue 13.1: the sweep listed containers by cluster name alone, so user A's job removed
    user B's live worker of a cluster with the same name on a shared daemon."""
    c = ctx(runtime)
    assert c.owner == 1000
    run = get_runtime(runtime).run(c, RAY, {})
    assert run[run.index("ray-slurm.uid=1000") - 1] == "--label"
    argv = get_runtime(runtime).list_cluster(c)
    assert argv is not None
    filters = [argv[i + 1] for i, a in enumerate(argv) if a == "--filter"]
    assert filters == ["label=ray-slurm.cluster=c1", "label=ray-slurm.uid=1000"]


def test_enroot_roots_of_ended_jobs_are_swept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 13.6: every job runs `enroot create`; a SIGKILLed job left its root filesystem
    behind forever. The next job of the cluster on the node removes those of the user's
    (enroot keeps them per user) ended jobs, never a live or completing one's."""
    from ray_slurm_provider import proc
    from ray_slurm_provider.agent.container import NodeContainer

    c = NodeContainer.from_spec({"runtime": "enroot", "image": "/shared/ray.sqsh"},
                                cluster_name="c1", job_id="900", temp_dir="/tmp/t",
                                cluster_dir="/tmp/c", env={}, drain_timeout_s=5, head=False,
                                env_names=[], log=lambda m: None)
    assert c is not None
    calls: list[list[str]] = []

    def run(argv: list[str], **kw: object) -> proc.Result:
        calls.append(list(argv))
        listing = "rsp-c1-900\nrsp-c1-777\nrsp-c1-778\nrsp-other-555\nmy-own-image\n"
        return proc.Result(argv, 0, listing if argv[-1] == "list" else "", "")

    monkeypatch.setattr(proc, "run", run)
    c.sweep(lambda: {"778"})  # 778 still runs (or completes); 900 is this job
    assert calls == [["enroot", "list"], ["enroot", "remove", "--force", "rsp-c1-777"]]


@pytest.mark.parametrize("runtime", ["docker", "podman"])
def test_two_members_of_a_gang_on_one_daemon_never_collide(runtime: str) -> None:
    """Issue 16: the members of a gang job share its job id; where they share a container
    daemon (the sandbox's nodes do) each has its own container name, both carry the job's
    id as label, and the sweep of one never takes the other's (its job is alive)."""
    cfg = ContainerConfig(runtime=runtime, image="img")
    a, b = (RunContext("c1", "1000", cfg, f"/t/1000.{k}", "/s", member=str(k)) for k in (0, 1))
    assert (a.name, b.name) == ("rsp-c1-1000.0", "rsp-c1-1000.1")
    rt = get_runtime(runtime)
    argv = rt.run(a, ["ray", "start"], {})
    assert argv[argv.index("--name") + 1] == "rsp-c1-1000.0"
    assert "slurm.job_id=1000" in argv
    nc = NodeContainer(cfg, cluster_name="c1", job_id="1000", member="0", temp_dir="/t/1000.0",
                       cluster_dir="/s", env={}, drain_timeout_s=5, head=False, env_names=[],
                       log=print)
    removed: list[list[str]] = []

    def run(argv: list[str], timeout: float = 600) -> proc.Result:
        if "ps" in argv:
            return proc.Result(argv, 0, "rsp-c1-1000.0 1000\nrsp-c1-1000.1 1000\n", "")
        removed.append(argv)
        return proc.Result(argv, 0, "", "")

    nc._run = run  # type: ignore[method-assign]
    nc.sweep(lambda: {"1000"})
    assert nc.ctx.name == "rsp-c1-1000.0" and removed == []


def test_the_spank_plugins_slurm_loads_are_bound_into_a_slurm_head(tmp_path: Path) -> None:
    """On a Pyxis site sbatch loads plugstack.conf's plugins; inside the head's container a
    `required` one it cannot open stops it (seen live on the sandbox: `plugin_load_from_file:
    dlopen(.../spank_pyxis.so): No such file or directory`, no worker started)."""
    etc, lib, opt = tmp_path / "etc", tmp_path / "lib", tmp_path / "opt"
    for d in (etc / "plugstack.conf.d", lib, opt):
        d.mkdir(parents=True)
    pyxis, other = lib / "spank_pyxis.so", opt / "spank_other.so"
    pyxis.write_bytes(b"\x7fELF")
    other.write_bytes(b"\x7fELF")
    conf = etc / "slurm.conf"
    conf.write_text("AuthType=auth/munge\n")
    (etc / "plugstack.conf").write_text("include plugstack.conf.d/*.conf\n")
    (etc / "plugstack.conf.d" / "pyxis.conf").write_text(
        f"required {pyxis} runtime_path=/run/pyxis  # NVIDIA's\n"
        "optional relative.so  # in PluginDir, the image's\n"
        f"optional {lib}/gone.so\n")
    (opt / "stack.conf").write_text(f"include {etc}/plugstack.conf\noptional {other}\n"
                                    f"include {opt}/stack.conf  # a loop\n")
    assert slurm_mounts({"SLURM_CONF": str(conf)}) == (
        f"{etc}:{etc}:ro", "/run/munge:/run/munge", f"{pyxis}:{pyxis}:ro")
    conf.write_text(f"PlugStackConfig={opt}/stack.conf\n")  # a stack outside the conf dir
    assert slurm_mounts({"SLURM_CONF": str(conf)}) == (
        f"{etc}:{etc}:ro", "/run/munge:/run/munge", f"{opt}/stack.conf:{opt}/stack.conf:ro",
        f"{pyxis}:{pyxis}:ro", f"{other}:{other}:ro")
    conf.write_text("")
    (etc / "plugstack.conf").unlink()  # no stack at all: nothing more
    assert slurm_mounts({"SLURM_CONF": str(conf)}) == (
        f"{etc}:{etc}:ro", "/run/munge:/run/munge")


def test_pyxis_gives_the_container_the_nodes_path() -> None:
    """Measured on the sandbox: the image's PATH wins over the step's (`ray: command not
    found` in `ray exec`), so the step names PATH and `ray exec` sets it."""
    c = replace(ctx("pyxis"), path="/venv/bin:/usr/bin:/bin")
    rt = get_runtime("pyxis")
    assert "--container-env=PATH" in rt.run(c, RAY, {})
    assert "--container-env=PATH" not in rt.run(ctx("pyxis"), RAY, {})
    assert rt.exec(c, ["ray", "status"]) == ["env", "PATH=/venv/bin:/usr/bin:/bin", "ray",
                                             "status"]

"""Enroot and Pyxis live on the sandbox (``ray-slurm sandbox up --pyxis``): `srun
--container-image` as root and as a sandbox user, `enroot list` after sourcing env.sh, a
named container kept across two steps of one job, one name on two nodes of one job (enroot's
storage is node-local), the sandbox's own `.sqsh` image, `enroot import dockerd://`, and
nothing of a container left once its job ended."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ray_slurm_provider.sandbox import Sandbox, image
from ray_slurm_provider.sandbox.users import SandboxUser

pytestmark = [pytest.mark.integration, pytest.mark.pyxis]
#: How long a job's epilog (pyxis removes the job's named containers there) may take.
CLEANUP_WAIT_S = 60.0
OS_RELEASE = 'NAME="rsp-busybox"\nID=rsp-busybox\n'
BUSYBOX = ("/bin/busybox", "/usr/bin/busybox")


@pytest.fixture(scope="module")
def pyxis_sandbox(sandbox: Sandbox) -> Sandbox:
    if not sandbox.spec.pyxis:
        pytest.fail("the sandbox runs without pyxis: start it with `ray-slurm sandbox up "
                    "--pyxis`")
    if not sandbox.users():
        pytest.fail("the sandbox has no users: start it with `--users 1` or more")
    return sandbox


@pytest.fixture(scope="module")
def busybox_sqsh(pyxis_sandbox: Sandbox) -> Iterator[str]:
    """A 1 MB image every user can read: busybox-static, its applets, an os-release."""
    shared = Path(pyxis_sandbox.layout.shared_dir)
    root = shared / "rsp-busybox"
    sqsh = shared / "rsp-busybox.sqsh"
    shutil.rmtree(root, ignore_errors=True)
    for d in ("bin", "etc", "tmp", "proc", "sys", "dev", "root", "home", "run"):
        (root / d).mkdir(parents=True)
    busybox = next(p for p in BUSYBOX if os.path.exists(p))
    shutil.copy(busybox, root / "bin" / "busybox")
    for applet in ("sh", "cat", "id", "ls", "echo", "touch"):
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc" / "os-release").write_text(OS_RELEASE)
    run(["mksquashfs", str(root), str(sqsh), "-all-root", "-noappend", "-no-progress"])
    sqsh.chmod(0o644)
    yield str(sqsh)
    shutil.rmtree(root, ignore_errors=True)
    sqsh.unlink(missing_ok=True)


def run(argv: list[str], user: SandboxUser | None = None, sandbox: Sandbox | None = None,
        timeout: float = 180) -> str:
    """`argv` as root (the suite's environment) or as `user` (a login-like one)."""
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL, check=False, **as_user(user, sandbox))
    assert res.returncode == 0, f"{argv} as {user.name if user else 'root'}: " \
                                f"rc={res.returncode}\n{res.stdout}\n{res.stderr}"
    return res.stdout


def as_user(user: SandboxUser | None, sandbox: Sandbox | None) -> dict[str, object]:
    if user is None or sandbox is None:
        return {}
    env = {"HOME": user.home, "USER": user.name, "LOGNAME": user.name, "LANG": "C.UTF-8",
           "PATH": "/usr/local/bin:/usr/bin:/bin",
           "SLURM_CONF": sandbox.env()["SLURM_CONF"]}
    return {"env": env, "cwd": user.home, "user": user.uid, "group": user.gid,
            "extra_groups": os.getgrouplist(user.name, user.gid)}


def sourced(sandbox: Sandbox, command: str) -> list[str]:
    """A bash command line run after sourcing the sandbox's env.sh."""
    return ["bash", "-c", f'source "$1" && {command}', "bash", sandbox.layout.env_file]


def enroot_list(sandbox: Sandbox, user: SandboxUser | None) -> list[str]:
    return run(sourced(sandbox, "enroot list"), user, sandbox).split()


def leftovers(sandbox: Sandbox, user: SandboxUser | None) -> list[str]:
    """What a user's enroot keeps after its jobs: containers, unpacked roots, mounts."""
    name = user.name if user else "root"
    local = sandbox.layout.enroot_local_dir
    nodes = Path(sandbox.layout.enroot_dir, "nodes")
    left = []
    for data in [Path(local, "data", name), *(n / "data" / name for n in nodes.iterdir())]:
        left += [str(p) for p in data.iterdir()] if data.is_dir() else []
    status = sandbox.status()
    # Jobs mount in their slurmd's namespace (--pyxis gives each slurmd its own).
    pids = ["self", *(str(p) for n, p in status.daemons.items() if n.startswith("slurmd:"))]
    for pid in pids:
        with open(f"/proc/{pid}/mounts") as f:
            for line in f:
                target = line.split()[1]
                if target != local and target.startswith((sandbox.layout.enroot_dir,
                                                          sandbox.layout.pyxis_runtime_dir)):
                    left.append(f"mount {target} (in {pid})")
    # A failed epilog (pyxis's, when it cannot run enroot) drains the node.
    left += [f"node {n} {s}" for n, s in status.nodes.items() if "drain" in s]
    return left + [f"container {c}" for c in enroot_list(sandbox, user)]


def wait_clean(sandbox: Sandbox, user: SandboxUser | None) -> None:
    deadline = time.monotonic() + CLEANUP_WAIT_S
    left = leftovers(sandbox, user)
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left = leftovers(sandbox, user)
    assert not left, f"left behind after the job: {left}"


def srun_in(sandbox: Sandbox, sqsh: str, user: SandboxUser | None, *extra: str,
            command: str = "cat /etc/os-release; id") -> str:
    return run(["srun", "-N1", "-p", "cpu", "-t", "5", f"--container-image={sqsh}", *extra,
                "sh", "-c", command], user, sandbox)


def test_srun_help_lists_the_container_options(pyxis_sandbox: Sandbox) -> None:
    out = run(["srun", "--help"])
    for option in ("--container-image", "--container-name", "--container-mounts"):
        assert option in out


def test_enroot_list_works_after_sourcing_env_sh(pyxis_sandbox: Sandbox) -> None:
    for user in (None, pyxis_sandbox.users()[0]):
        run(sourced(pyxis_sandbox, "enroot version"), user, pyxis_sandbox)
        assert enroot_list(pyxis_sandbox, user) == []


def test_container_image_as_root(pyxis_sandbox: Sandbox, busybox_sqsh: str) -> None:
    out = srun_in(pyxis_sandbox, busybox_sqsh, None)
    assert 'NAME="rsp-busybox"' in out and "uid=0(root)" in out
    wait_clean(pyxis_sandbox, None)


def test_container_image_as_a_sandbox_user(pyxis_sandbox: Sandbox, busybox_sqsh: str) -> None:
    user = pyxis_sandbox.users()[0]
    out = srun_in(pyxis_sandbox, busybox_sqsh, user)
    assert 'NAME="rsp-busybox"' in out and f"uid={user.uid}" in out
    wait_clean(pyxis_sandbox, user)


@pytest.mark.parametrize("who", ["root", "user"])
def test_named_container_is_kept_across_steps_then_removed(
        pyxis_sandbox: Sandbox, busybox_sqsh: str, who: str, tmp_path: Path) -> None:
    user = pyxis_sandbox.users()[-1] if who == "user" else None
    out_dir = Path(user.home) if user else tmp_path
    out = out_dir / "pyxis-named.out"
    script = out_dir / "pyxis-named.sh"
    script.write_text(f"""#!/bin/sh
srun --container-image={busybox_sqsh} --container-name=keep --container-writable \\
    sh -c 'echo kept-by-step-one > /marker'
srun --container-name=keep --container-writable cat /marker
enroot list
""")
    if user:
        os.chown(script, user.uid, user.gid)
    path = f"{pyxis_sandbox.layout.enroot_bin_dir}:/usr/local/bin:/usr/bin:/bin"
    run(["sbatch", "--wait", "-N1", "-p", "cpu", "-t", "5", "-o", str(out),
         f"--export=ALL,PATH={path}", str(script)], user, pyxis_sandbox)
    text = out.read_text()
    assert "kept-by-step-one" in text, text
    assert any(line.startswith("pyxis_") and line.endswith("_keep")
               for line in text.split()), text
    out.unlink()
    script.unlink()
    wait_clean(pyxis_sandbox, user)


def test_one_name_on_two_nodes_of_a_job(pyxis_sandbox: Sandbox, busybox_sqsh: str,
                                         tmp_path: Path) -> None:
    """Pyxis names the container `pyxis_<job>_<name>` on every node: each node keeps its
    own, in its own storage."""
    out = tmp_path / "two-nodes.out"
    script = tmp_path / "two-nodes.sh"
    script.write_text(f"""#!/bin/sh
srun -N2 --ntasks-per-node=1 --container-image={busybox_sqsh} --container-name=both \\
    --container-writable sh -c 'echo "made on $SLURMD_NODENAME" > /node'
srun -N2 --ntasks-per-node=1 --container-name=both --container-writable \\
    sh -c 'echo "$SLURMD_NODENAME: $(cat /node)"'
""")
    run(["sbatch", "--wait", "-N2", "-p", "cpu", "-t", "5", "-o", str(out), str(script)])
    lines = sorted(ln for ln in out.read_text().splitlines() if ": made on" in ln)
    assert len(lines) == 2, out.read_text()
    for line in lines:
        node, made = line.split(": made on ")
        assert node == made.strip(), lines
    wait_clean(pyxis_sandbox, None)


def test_the_sandbox_image_runs_under_pyxis(pyxis_sandbox: Sandbox, tmp_path: Path) -> None:
    """`sandbox image --runtime enroot`'s .sqsh, with the host's /usr bound (as the Ray
    node configs bind it)."""
    sqsh = image.build(os.path.join(pyxis_sandbox.layout.shared_dir, "rsp-bind-test.sqsh"),
                       "enroot")
    try:
        user = pyxis_sandbox.users()[0]
        out = srun_in(pyxis_sandbox, sqsh, user, "--container-mounts=/usr:/usr:ro",
                      command="cat /usr/lib/os-release; id")
        assert "Debian" in out and f"uid={user.uid}" in out
        wait_clean(pyxis_sandbox, user)
    finally:
        os.unlink(sqsh)


def test_enroot_imports_from_the_sandbox_dockerd(pyxis_sandbox: Sandbox,
                                                 tmp_path: Path) -> None:
    if not pyxis_sandbox.spec.docker:
        pytest.fail("the sandbox runs no dockerd: start it with `--docker --pyxis`")
    tag = "rsp-enroot-import:1"
    tar = tmp_path / "rootfs.tar"
    image.rootfs_tar(tar)
    # enroot runs `docker create IMAGE`, which refuses an image without a command ("Error
    # response from daemon: No command specified"), as `docker import` makes them.
    run(["docker", "import", "--change", 'CMD ["/bin/sh"]', str(tar), tag])
    out = tmp_path / "imported.sqsh"
    try:
        run(sourced(pyxis_sandbox, f"enroot import -o {out} dockerd://{tag}"))
        assert out.read_bytes()[:4] == b"hsqs"
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=60,
                       check=False)

"""`sandbox up --pyxis` without building or running anything real: where the tarballs are
looked for, the cached build (make recorded by a fake, under the lock, marked only when done),
the enroot wrapper (run for real over a fake enroot), plugstack.conf, slurm.conf, slurmd's
PATH, env.sh, the packages and the `.sqsh` image."""

from __future__ import annotations

import fcntl
import io
import os
import stat
import subprocess
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.sandbox import daemons, files, image, prereq, pyxis
from ray_slurm_provider.sandbox.config import SandboxSpec, render_env_sh, render_slurm_conf
from ray_slurm_provider.sandbox.core import Sandbox
from ray_slurm_provider.sandbox.layout import Layout
from ray_slurm_provider.sandbox.procs import SandboxError

LAYOUT = Layout("/tmp/rsp-unit")


def _tarball(path: Path, top: str, members: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture()
def vendor(tmp_path: Path) -> Path:
    d = tmp_path / "vendor"
    d.mkdir()
    _tarball(d / f"enroot-{pyxis.ENROOT_VERSION}.tar.gz", f"enroot-{pyxis.ENROOT_VERSION}",
             {"Makefile": "all:\n", "enroot.in": "#!/bin/sh\n"})
    _tarball(d / f"pyxis-{pyxis.PYXIS_VERSION}.tar.gz", f"pyxis-{pyxis.PYXIS_VERSION}",
             {"Makefile": "all:\n"})
    return d


class FakeMake:
    """Records each build step; `make` in pyxis's tree leaves the plugin, as the real one."""

    def __init__(self, build: pyxis.Build, fail: str = "") -> None:
        self.build = build
        self.fail = fail
        self.calls: list[tuple[list[str], str]] = []
        self.lock_held: list[bool] = []

    def __call__(self, argv: Sequence[str], *, cwd: str | None = None,
                 env: Mapping[str, str] | None = None, timeout: float = 0,
                 **_: object) -> proc.Result:
        assert cwd is not None and timeout > 0 and env is not None
        self.calls.append((list(argv), cwd))
        self.lock_held.append(_locked_elsewhere(self.build.lock))
        if self.fail and self.fail in cwd:
            raise proc.CommandFailed(list(argv), "make: *** [all] Error 1", 2, "", "cc: error")
        if os.path.basename(cwd).startswith("pyxis"):
            Path(cwd, "spank_pyxis.so").write_bytes(b"\x7fELF")
        else:  # make install: the prefix with the script
            _install(argv)
        return proc.Result(list(argv), 0, "built\n", "")


def _install(argv: Sequence[str]) -> None:
    prefix = Path(argv[-1].removeprefix("prefix="))
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "enroot").write_text("#!/bin/sh\n")


def _locked_elsewhere(path: str) -> bool:
    """Whether another open file description holds the lock on `path`."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> pyxis.Build:
    monkeypatch.setattr(pyxis.shutil, "which", lambda name: f"/usr/bin/{name}")
    return pyxis.Build(str(tmp_path / "cache"))


def test_missing_tarballs_are_named_with_the_variable(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pyxis.VENDOR_ENV, str(tmp_path))
    with pytest.raises(SandboxError) as e:
        pyxis.tarballs()
    msg = str(e.value)
    assert f"{tmp_path}/enroot-4.1.2.tar.gz" in msg and f"{tmp_path}/pyxis-0.24.0.tar.gz" in msg
    assert pyxis.VENDOR_ENV in msg


def test_vendor_dir_defaults_beside_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pyxis.VENDOR_ENV, raising=False)
    project = Path(proc.__file__).resolve().parents[1]
    assert pyxis.vendor_dir() == str(project.parent / "shared" / "vendor")
    monkeypatch.setenv(pyxis.VENDOR_ENV, "/srv/tarballs")
    assert pyxis.vendor_dir() == "/srv/tarballs"


def test_first_build_makes_both_under_the_lock_then_the_cache_answers(
        cache: pyxis.Build, vendor: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeMake(cache)
    monkeypatch.setattr(pyxis.proc, "run", fake)
    assert pyxis.ensure_built(cache, str(vendor)) is cache
    (enroot_argv, _), (pyxis_argv, _) = fake.calls
    assert enroot_argv[0] == "make" and "FORCE_GLIBC=y" in enroot_argv
    assert enroot_argv[-2:] == ["install", f"prefix={cache.enroot_prefix}"]
    assert ["-o", "deps"] == enroot_argv[enroot_argv.index("-o"):enroot_argv.index("-o") + 2]
    assert pyxis_argv == ["make"]
    assert all(fake.lock_held), "a build step ran without the build lock"
    assert cache.built() and Path(cache.plugin).read_bytes() == b"\x7fELF"
    assert not [p for p in Path(cache.cache).iterdir() if p.name.startswith("rsp-")]
    fake.calls.clear()
    pyxis.ensure_built(cache, "/nonexistent")  # cached: not even the tarballs are needed
    assert fake.calls == []


def test_enroot_deps_are_made_by_hand(cache: pyxis.Build, vendor: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def run(argv: Sequence[str], *, cwd: str | None = None, **kw: object) -> proc.Result:
        assert cwd is not None
        if "FORCE_GLIBC=y" in argv:
            dist = Path(cwd, "deps", "dist")
            seen.append(os.readlink(dist / "makeself" / "bin" / "enroot-makeself"))
            assert (dist / "libbsd").is_dir() and (dist / "linux" / "include").is_dir()
            _install(argv)
        else:
            Path(cwd, "spank_pyxis.so").write_bytes(b"so")
        return proc.Result(list(argv), 0, "", "")

    monkeypatch.setattr(pyxis.proc, "run", run)
    pyxis.ensure_built(cache, str(vendor))
    assert seen == ["/usr/bin/makeself"]


def test_a_failed_build_says_where_its_log_is_and_marks_nothing(
        cache: pyxis.Build, vendor: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pyxis.proc, "run", FakeMake(cache, fail="pyxis"))
    with pytest.raises(SandboxError, match=r"make failed: .*Error 1.*\nlog: .*enroot-pyxis\.log"):
        pyxis.ensure_built(cache, str(vendor))
    assert os.path.exists(os.path.join(cache.enroot_prefix, pyxis.MARKER))
    assert not cache.built()
    assert "cc: error" in Path(cache.log).read_text()
    fake = FakeMake(cache)
    monkeypatch.setattr(pyxis.proc, "run", fake)
    pyxis.ensure_built(cache, str(vendor))  # only what failed is built again
    assert [argv for argv, _ in fake.calls] == [["make"]] and cache.built()


def test_pyxis_is_for_the_hosts_release_only() -> None:
    with pytest.raises(ValueError, match=r"--pyxis runs only with the host's Slurm 22\.05"):
        SandboxSpec(slurm="24.11", pyxis=True)
    with pytest.raises(ValueError, match=r"spank\.h"):
        pyxis.build_for("26.05")
    spec = SandboxSpec(pyxis=True, docker=True, users=2)
    assert SandboxSpec.from_json(spec.to_json()) == spec


def test_slurm_conf_loads_pyxis_only_with_pyxis() -> None:
    line = f"PlugStackConfig={LAYOUT.plugstack_conf}"
    assert line in render_slurm_conf(LAYOUT, SandboxSpec(pyxis=True)).splitlines()
    assert "PlugStackConfig" not in render_slurm_conf(LAYOUT, SandboxSpec())


def test_plugstack_names_the_state_dirs_plugin_and_the_runtime_dir() -> None:
    """The copy in etc/, which the Ray nodes' containers see (their sbatch loads it)."""
    text = pyxis.render_plugstack(LAYOUT)
    assert text.splitlines()[-1] == (
        "required /tmp/rsp-unit/lib/spank_pyxis.so "
        "runtime_path=/tmp/rsp-unit/pyxis container_scope=job")


def _fake_enroot(tmp_path: Path) -> pyxis.Build:
    build = pyxis.Build(str(tmp_path / "cache"))
    Path(build.enroot).parent.mkdir(parents=True)
    Path(build.enroot).write_text('#!/bin/sh\necho "$ENROOT_RUNTIME_PATH|$ENROOT_CACHE_PATH|'
                                  '$ENROOT_DATA_PATH|${PATH%%:*}|$*"\n')
    os.chmod(build.enroot, 0o755)
    return build


def test_the_wrapper_gives_cleared_environments_per_user_paths(tmp_path: Path) -> None:
    """As under pyxis: nothing but PATH in the environment."""
    layout = Layout("/tmp/it's a \"state\" $(dir)")
    build = _fake_enroot(tmp_path)
    wrapper = tmp_path / "enroot"
    wrapper.write_text(pyxis.render_wrapper(layout, build))
    me = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
    out = subprocess.run(["/bin/sh", str(wrapper), "list", "-f"], capture_output=True,
                         text=True, check=True, env={"PATH": "/usr/bin:/bin"}).stdout.strip()
    d = layout.enroot_local_dir
    # The wrapper's own dir first, never the cache's: PATH reaches the containers, and a
    # worker job submitted from the head's must find this wrapper, not the bare enroot
    # (which kept its roots elsewhere: "No such file or directory: <data>/rsp-...").
    assert out == f"{d}/run/{me}|{d}/cache/{me}|{d}/data/{me}|{layout.enroot_bin_dir}|list -f"
    mine = {"PATH": "/usr/bin:/bin", "ENROOT_DATA_PATH": "/scratch/mine"}
    out = subprocess.run(["/bin/sh", str(wrapper)], capture_output=True, text=True,
                         check=True, env=mine).stdout
    assert out.split("|")[2] == "/scratch/mine"


def test_prepare_makes_open_per_user_dirs_and_an_executable_wrapper(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("RAY_SLURM_SANDBOX_CACHE", str(cache))
    plugin = Path(pyxis.build_for("22.05").plugin)
    plugin.parent.mkdir(parents=True)
    plugin.write_bytes(b"\x7fELF plugin")
    helper = Path(pyxis.build_for("22.05").enroot).with_name("enroot-mount")
    helper.parent.mkdir(parents=True)
    helper.write_text("#!/bin/sh\n")
    layout = Layout(str(tmp_path / "state"))
    os.makedirs(layout.etc_dir)
    files._prepare_pyxis(layout, SandboxSpec(pyxis=True, nodes=2))
    files._prepare_pyxis(layout, SandboxSpec(pyxis=True, nodes=2))  # again: idempotent
    assert os.readlink(os.path.join(layout.enroot_bin_dir, "enroot-mount")) == str(helper)
    dirs = [layout.enroot_local_dir, layout.enroot_node_dir("n1"), layout.enroot_node_dir("n2")]
    for d in dirs:
        for sub in ("run", "cache", "data"):
            assert stat.S_IMODE(os.stat(os.path.join(d, sub)).st_mode) == 0o1777
    assert sorted(os.listdir(os.path.join(layout.enroot_dir, "nodes"))) == ["n1", "n2"]
    assert stat.S_IMODE(os.stat(layout.pyxis_runtime_dir).st_mode) == 0o1777
    assert os.access(os.path.join(layout.enroot_bin_dir, "enroot"), os.X_OK)
    assert layout.pyxis_plugin in Path(layout.plugstack_conf).read_text()
    assert Path(layout.pyxis_plugin).read_bytes() == b"\x7fELF plugin"


def test_slurmd_finds_enroot_first_on_its_path(tmp_path: Path) -> None:
    layout = Layout(str(tmp_path / "state"))
    assert not daemons.daemon_env("slurmd:n1", layout)["PATH"].startswith(
        layout.enroot_bin_dir)
    assert daemons.daemon_env("slurmd:n1", layout, pyxis=True)["PATH"].startswith(
        layout.enroot_bin_dir + ":")
    assert layout.enroot_bin_dir not in daemons.daemon_env("slurmctld", layout,
                                                           pyxis=True)["PATH"]


def test_env_sh_puts_the_sandbox_enroot_first() -> None:
    sb = Sandbox("/tmp/rsp-unit", pyxis=True)
    env = sb.env()
    assert env["PATH"].startswith("/tmp/rsp-unit/enroot/bin:")
    assert "export PATH='/tmp/rsp-unit/enroot/bin':\"$PATH\"" in render_env_sh(env)
    assert "PATH" not in Sandbox("/tmp/rsp-unit").env()


def test_pyxis_packages_are_asked_for_only_with_pyxis(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prereq, "_present", lambda probe: "spank" not in probe)
    assert prereq.missing_packages(prereq.Needs(pyxis=True)) == ["libslurm-dev"]
    assert prereq.missing_packages(prereq.Needs()) == []
    cmd = prereq.apt_command(prereq.Needs(pyxis=True))
    for pkg in ("libslurm-dev", "squashfs-tools", "squashfuse", "fuse-overlayfs", "jq",
                "parallel", "pigz", "zstd", "makeself", "libbsd-dev", "busybox-static"):
        assert pkg in cmd


def test_sqsh_image_is_squashed_from_the_rootfs_and_renamed_into_place(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def run(argv: Sequence[str], **_: object) -> proc.Result:
        calls.append(list(argv))
        assert os.path.isdir(os.path.join(argv[1], "etc"))
        Path(argv[2]).write_bytes(b"hsqs")
        return proc.Result(list(argv), 0, "", "")

    monkeypatch.setattr(image.proc, "run", run)
    dest = tmp_path / "shared" / "rsp-bind.sqsh"
    assert image.build(str(dest), "enroot") == str(dest)
    assert calls[0][0] == "mksquashfs" and "-all-root" in calls[0]
    assert dest.read_bytes() == b"hsqs" and stat.S_IMODE(dest.stat().st_mode) == 0o644
    assert os.listdir(dest.parent) == ["rsp-bind.sqsh"]  # no temporary left beside it


def test_slurmd_enters_a_namespace_where_the_epilog_finds_enroot(tmp_path: Path) -> None:
    """Pyxis's job epilog looks in /usr/local/bin only: an overlay there, in slurmd's own
    mount namespace."""
    layout = Layout("/tmp/rsp-unit")
    script = pyxis.render_node_entry(layout)
    assert ("mount -t overlay rsp-enroot -o lowerdir=/tmp/rsp-unit/enroot/bin:/usr/local/bin"
            " /usr/local/bin") in script
    assert """mount --bind /tmp/rsp-unit/enroot/nodes/"$node" /tmp/rsp-unit/enroot/local""" \
        in script
    path = tmp_path / "enroot-ns.sh"
    path.write_text(script)
    subprocess.run(["sh", "-n", str(path)], check=True)
    spec = SandboxSpec(pyxis=True)
    argv = daemons.argv_for("slurmd:n1", layout, spec)
    spawn = daemons.spawn_argv("slurmd:n1", layout, spec, argv)
    assert spawn == ["unshare", "--mount", "--propagation", "private", "/bin/sh",
                     layout.node_entry_script, "n1", *argv]
    ctld = daemons.argv_for("slurmctld", layout, spec)
    assert daemons.spawn_argv("slurmctld", layout, spec, ctld) is ctld
    plain = SandboxSpec()
    assert daemons.spawn_argv("slurmd:n1", layout, plain, argv) is argv
    with pytest.raises(SandboxError, match="without ':' or ','"):
        pyxis.render_node_entry(Layout("/tmp/a,b"))

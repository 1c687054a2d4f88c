"""Slurm releases in cached roots and the accounting sandbox, as rendered (no Slurm, no root
build needed): release checks, entry script and client wrappers (quoted, syntax-checked),
binds, a failed root build, slurmdbd/slurm.conf/gres.conf with accounting, sacctmgr steps."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from ray_slurm_provider.sandbox import accounting, daemons, roots
from ray_slurm_provider.sandbox.config import (
    SandboxSpec,
    node_gpus,
    render_env_sh,
    render_gres_conf,
    render_slurm_conf,
)
from ray_slurm_provider.sandbox.layout import Layout
from ray_slurm_provider.sandbox.procs import SandboxError

LAYOUT = Layout("/tmp/rsp-unit")
NASTY = "/tmp/it's a \"dir\" $(touch /tmp/pwned) `x`\n; echo owned"


def test_release_names_are_checked_with_the_choices_named() -> None:
    choices = r"unsupported Slurm release '23\.02'.*22\.05, 24\.11, 25\.11, 26\.05"
    with pytest.raises(ValueError, match=choices):
        SandboxSpec(slurm="23.02")
    assert not SandboxSpec().in_root and SandboxSpec(slurm="24.11").in_root
    assert roots.rest_version("22.05") == "v0.0.38" and roots.rest_version("26.05") == "v0.0.44"


@pytest.mark.parametrize("kw", [{"docker": True}, {"accounting": True}])
def test_root_releases_refuse_docker_and_accounting(kw: dict[str, bool]) -> None:
    with pytest.raises(ValueError, match=r"only with the host's Slurm 22\.05"):
        SandboxSpec(slurm="26.05", **kw)  # type: ignore[arg-type]


def test_root_releases_take_throwaway_users() -> None:
    """Their wrappers enter the root in a user namespace (apptainer runs as a user)."""
    assert SandboxSpec(slurm="26.05", users=2).users == 2


def test_spec_round_trips_release_and_accounting() -> None:
    spec = SandboxSpec(slurm="24.11", nodes=2)
    assert SandboxSpec.from_json(spec.to_json()) == spec
    acct = SandboxSpec(accounting=True)
    assert SandboxSpec.from_json(acct.to_json()) == acct
    old = '{"nodes": 3, "gpus_per_node": 2, "cpus_per_node": 2, "memory_mb_per_node": 4000,' \
          ' "docker": false}'
    assert SandboxSpec.from_json(old) == SandboxSpec()  # a state dir from before


def test_parse_release_and_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert roots.parse_release("slurm-wlm 24.11.5\n") == "24.11"
    assert roots.parse_release("slurm 26.05.5") == "26.05"
    with pytest.raises(SandboxError, match="no Slurm version"):
        roots.parse_release("command not found")
    sources = tmp_path / "debian.sources"
    sources.write_text("Types: deb\nURIs: http://mirror.example.org/debian\nSuites: bookworm\n")
    monkeypatch.delenv(roots.MIRROR_ENV, raising=False)
    assert roots.mirror((str(sources),)) == "http://mirror.example.org/debian"
    assert roots.mirror((str(tmp_path / "none"),)) == roots.DEFAULT_MIRROR
    monkeypatch.setenv(roots.MIRROR_ENV, "http://local/debian")
    assert roots.mirror((str(sources),)) == "http://local/debian"


def test_binds_keep_system_dirs_out_and_drop_nested(tmp_path: Path) -> None:
    binds = roots.host_binds(str(tmp_path / "state"))
    assert "/tmp" in binds
    assert not any(b in ("/", "/usr", "/etc", "/var", "/lib", "/bin") for b in binds)
    for b in binds:  # nothing bound twice through a parent
        assert not any(b != o and b.startswith(o.rstrip("/") + "/") for o in binds), b
    assert {"/etc/passwd", "/etc/group"} <= set(binds)


def test_binds_carry_debians_python_for_the_users_venv(tmp_path: Path) -> None:
    """The sandbox users' venv runs Debian's python3.X (root's may live under a 0700 home)."""
    import sys

    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    binds = roots.host_binds(str(tmp_path / "state"))
    for path in (f"/usr/bin/{ver}", f"/usr/lib/{ver}"):
        assert (path in binds) == os.path.exists(path), path


def test_entry_script_quotes_every_path(tmp_path: Path) -> None:
    """The mounts the script makes, run with `mount` and friends recording their argv."""
    script = roots.render_enter(NASTY + "/root", ["/tmp", NASTY, "/etc/passwd"])
    subprocess.run(["sh", "-n", "-c", script], check=True)
    assert "pivot_root . .oldroot" in script and "exec /usr/sbin/chroot" in script
    setup = script.split('if [ "$mode" = daemon ]; then\n    cd', 1)[0]
    stubs = "".join(f"{c}() {{ printf '%s|' {c} \"$@\" >>\"$LOG\"; echo >>\"$LOG\"; }}\n"
                    for c in ("mount", "mkdir", "touch"))
    log = tmp_path / "calls"
    subprocess.run(["sh", "-c", stubs + setup, "sh", "client", "/"], check=True,
                   env={"LOG": str(log), "PATH": os.environ["PATH"]})
    calls = log.read_text().split("|\n")
    root = NASTY + "/root"
    assert f"mount|--bind|{root}|{root}" in calls
    assert f"mount|--bind|{NASTY}|{root}{NASTY}" in calls
    assert f"mount|--bind|/etc/passwd|{root}/etc/passwd" in calls
    assert not os.path.exists("/tmp/pwned")


def test_client_wrapper_runs_the_roots_command_inside_a_root(tmp_path: Path) -> None:
    wrapper = roots.render_client(NASTY + "/enter.sh", "squeue")
    subprocess.run(["sh", "-n", "-c", wrapper], check=True)
    assert roots._q(NASTY + "/enter.sh") in wrapper
    assert f"if [ -e {roots.MARKER} ]; then exec /usr/bin/squeue \"$@\"; fi" in wrapper
    assert wrapper.count('"$@"') == 3


@pytest.mark.parametrize("uid", ["0", "1500"])
def test_client_wrapper_enters_as_root_or_in_a_user_namespace(tmp_path: Path, uid: str) -> None:
    """Root enters with a plain mount namespace; any other user in a user namespace that maps
    it to itself, with the namespace's capabilities kept for the mounts and the chroot."""
    wrapper = tmp_path / "squeue"
    wrapper.write_text(roots.render_client(NASTY + "/enter.sh", "squeue"))
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "id").write_text(f"#!/bin/sh\n[ \"$1\" = -u ] && echo {uid} || echo 77\n")
    (fake / "unshare").write_text("#!/bin/sh\nfor a in \"$@\"; do printf '%s|' \"$a\"; done\n")
    for f in (fake / "id", fake / "unshare"):
        f.chmod(0o755)
    out = subprocess.run(["sh", str(wrapper), "-h", "it's"], capture_output=True, text=True,
                         check=True, cwd=tmp_path,
                         env={"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}).stdout
    tail = ["--mount", "--propagation", "private", "/bin/sh", NASTY + "/enter.sh", "client",
            str(tmp_path), "/usr/bin/squeue", "-h", "it's", ""]
    if uid == "0":
        assert out.split("|") == tail
    else:
        assert out.split("|") == [f"--map-user={uid}", "--map-group=77", "--keep-caps", *tail]


def test_env_sh_puts_the_wrappers_first_and_keeps_the_callers_path() -> None:
    text = render_env_sh({"PATH": f"/tmp/x/bin{os.pathsep}/usr/bin", "A": "b"})
    assert "export PATH='/tmp/x/bin':\"$PATH\"" in text and "/usr/bin" not in text


def test_a_failed_root_build_says_where_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    deb = fake / "debootstrap"
    deb.write_text("#!/bin/sh\necho 'E: Failed getting release file http://x/dists/trixie'"
                   " >&2\nmkdir -p \"$4/usr\"\nexit 1\n")
    deb.chmod(deb.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv(roots.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(roots.MIRROR_ENV, "http://x")
    with pytest.raises(SandboxError) as ei:
        roots.ensure_root("24.11")
    msg = str(ei.value)
    assert "building the Slurm 24.11 root (debootstrap trixie from http://x) failed" in msg
    log = tmp_path / "cache" / "root-24.11.log"
    assert f"log: {log}" in msg and "Failed getting release file" in log.read_text()
    assert os.listdir(tmp_path / "cache" / "roots") == []  # no half-built root


def test_daemons_of_a_root_release_are_the_roots_binaries(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(roots.CACHE_ENV, str(tmp_path))
    spec = SandboxSpec(slurm="24.11")
    with pytest.raises(SandboxError, match=r"slurmctld: not in the Slurm 24\.11 root"):
        daemons.argv_for("slurmctld", LAYOUT, spec)
    (tmp_path / "roots" / "24.11" / "usr" / "sbin").mkdir(parents=True)
    for d in ("slurmctld", "slurmrestd"):
        (tmp_path / "roots" / "24.11" / "usr" / "sbin" / d).touch()
    assert daemons.argv_for("slurmctld", LAYOUT, spec)[0] == "/usr/sbin/slurmctld"
    rest = daemons.argv_for("slurmrestd", LAYOUT, spec)
    assert rest[rest.index("-s") + 1] == "openapi/slurmctld"


def _conf(spec: SandboxSpec) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in render_slurm_conf(LAYOUT, spec).splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_accounting_slurm_conf_and_typed_gpus() -> None:
    spec = SandboxSpec(accounting=True, port_offset=100)
    c = _conf(spec)
    assert c["AccountingStorageType"] == ["accounting_storage/slurmdbd"]
    assert c["AccountingStoragePort"] == ["6919"]
    assert c["AccountingStoragePass"] == [LAYOUT.munge_socket]  # else munge's default socket
    assert c["AccountingStorageEnforce"] == ["associations,limits,qos"]
    assert c["PreemptType"] == ["preempt/qos"] and c["PreemptMode"] == ["CANCEL"]
    assert [n.split(" Gres=")[1].split()[0] for n in c["NodeName"]] == \
        ["gpu:h100:2", "gpu:h100:2", "gpu:a100:1"]
    gres = render_gres_conf(LAYOUT, spec)
    assert f"NodeName=n3 Name=gpu Type=a100 File={LAYOUT.fake_gpu_dir('n3')}/nvidia0" in gres
    assert "AccountingStorageType" not in _conf(SandboxSpec())  # none without it
    assert node_gpus(SandboxSpec(), 3) == ("", 2)


def test_slurmdbd_conf_and_daemon_order() -> None:
    conf = accounting.render_dbd_conf(LAYOUT, 5, "s3cret")
    assert "DbdPort=6824\n" in conf and "StoragePort=3312\n" in conf
    assert "StoragePass=s3cret\n" in conf and f"AuthInfo=socket={LAYOUT.munge_socket}" in conf
    names = daemons.daemon_names(SandboxSpec(accounting=True))
    assert names[:4] == ["munged", "mariadb", "slurmdbd", "slurmctld"]
    assert "mariadb" not in daemons.daemon_names(SandboxSpec())


def test_sacctmgr_steps_make_the_tree_qos_and_associations() -> None:
    steps = [" ".join(s) for s in accounting.sacctmgr_steps("sandbox", ["rsp-u1", "rsp-u2"])]
    assert steps[0] == "add cluster sandbox"
    assert "modify qos limited set MaxSubmitJobsPerUser=2" in steps
    assert "modify qos high set Priority=1000 Preempt=scavenger" in steps
    assert "modify qos scavenger set Priority=0 PreemptMode=cancel" in steps
    users = {s.split()[2]: s for s in steps if s.startswith("add user")}
    assert "Account=team-a,team-b DefaultAccount=team-a" in users["root"]
    assert "Account=team-a " in users["rsp-u1"] and "Account=team-b " in users["rsp-u2"]
    assert all("QOS=normal,high,scavenger,limited DefaultQOS=normal" in s
               for s in users.values())


def test_the_apptainer_image_is_a_directory_replaced_whole(tmp_path: Path) -> None:
    """`sandbox image --runtime apptainer`: the bind image's root filesystem as a directory
    (readable by the sandbox's users); a rebuild replaces it and leaves nothing beside."""
    from ray_slurm_provider.sandbox import image

    dest = tmp_path / "shared" / "rsp-bind"
    assert image.build(str(dest), "apptainer") == str(dest)
    (dest / "etc" / "stale").write_text("from the old image")
    image.build(str(dest), "apptainer")
    assert (dest / "usr").is_dir() and (dest / "tmp").stat().st_mode & 0o7777 == 0o1777
    assert os.readlink(dest / "bin") == "usr/bin" and stat.S_IMODE(dest.stat().st_mode) == 0o755
    assert not (dest / "etc" / "stale").exists()
    assert sorted(os.listdir(dest.parent)) == ["rsp-bind"]

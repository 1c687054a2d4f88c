"""Creating and removing the state directory: directories, keys, rendered configs, fake GPUs,
the token file, ``env.sh`` and the lock that serialises `up`/`down`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator

from ray_slurm_provider import proc
from ray_slurm_provider.sandbox import accounting, config, pyxis, roots, source
from ray_slurm_provider.sandbox.config import SandboxSpec
from ray_slurm_provider.sandbox.layout import Layout
from ray_slurm_provider.sandbox.procs import SandboxError


def _write(path: str, text: str | bytes, mode: int) -> None:
    """Write atomically with `mode` (the file never exists with wider permissions)."""
    tmp = path + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _write_if_changed(path: str, content: str | bytes, mode: int) -> None:
    data = content.encode() if isinstance(content, str) else content
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                os.chmod(path, mode)
                return
    except FileNotFoundError:
        pass
    _write(path, content, mode)


def _mkdir(path: str, mode: int) -> None:
    os.makedirs(path, exist_ok=True)
    os.chmod(path, mode)


def looks_like_sandbox(layout: Layout) -> bool:
    """True for a state dir `up` made (it writes sandbox.json first) or one holding only the
    lock; `down` deletes nothing else."""
    try:
        entries = set(os.listdir(layout.root))
    except FileNotFoundError:
        return False
    return os.path.basename(layout.spec_file) in entries or entries <= {"lock"}


def read_spec(layout: Layout) -> SandboxSpec | None:
    """The spec saved by the last `up`, or None if there is none."""
    try:
        with open(layout.spec_file) as f:
            return SandboxSpec.from_json(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError) as e:
        raise SandboxError(f"unreadable {layout.spec_file}: {e}") from e


def prepare(layout: Layout, spec: SandboxSpec) -> None:
    """Create the state directory and everything the daemons read.

    Keys are created once and then kept (restarted daemons and issued tokens stay valid);
    configs are rewritten when they differ. slurmrestd runs as ``nobody``, so the state dir
    and ``etc/`` are world-readable; keys are 0600.
    """
    _check_reachable(layout.root)
    _mkdir(layout.root, 0o755)
    _write_if_changed(layout.spec_file, spec.to_json(), 0o644)
    for d in (layout.etc_dir, layout.munge_dir, layout.spool_dir, layout.run_dir,
              layout.log_dir, layout.fakegpu_dir):
        _mkdir(d, 0o755)
    _mkdir(layout.ctld_dir, 0o700)
    if not os.path.exists(layout.munge_key):
        _write(layout.munge_key, os.urandom(128), 0o600)  # 1024 bits, as mungekey makes
    if not os.path.exists(layout.jwt_key):
        _write(layout.jwt_key, os.urandom(32), 0o600)
    for k in range(1, spec.nodes + 1):
        _mkdir(os.path.join(layout.spool_dir, config.node_name(k)), 0o755)
        _make_fake_gpus(layout, spec, k)
    _write_if_changed(layout.slurm_conf, config.render_slurm_conf(layout, spec), 0o644)
    _write_if_changed(layout.gres_conf, config.render_gres_conf(layout, spec), 0o644)
    if spec.docker:
        _mkdir(layout.docker_dir, 0o711)
        _write_if_changed(layout.epilog, config.render_epilog(layout), 0o755)
    if spec.pyxis:
        _prepare_pyxis(layout, spec)
    if spec.in_root:
        _prepare_root_entry(layout, spec)
    elif spec.from_source:
        _prepare_source_clients(layout, spec)
    else:  # wrappers of another release, left by an earlier `up` at this state dir
        shutil.rmtree(layout.bin_dir, ignore_errors=True)
        if spec.cgroups:
            _write_if_changed(layout.cgroup_conf, config.render_cgroup_conf(True), 0o644)
        elif os.path.exists(layout.cgroup_conf):  # an earlier `up --cgroups` here
            os.unlink(layout.cgroup_conf)
    if spec.accounting:
        _mkdir(accounting.db_dir(layout), 0o700)
        conf = accounting.render_dbd_conf(layout, spec.port_offset, accounting.password(layout))
        _write_if_changed(accounting.dbd_conf(layout), conf, 0o600)
        accounting.init_db(layout, "mariadb-install-db")


def _prepare_pyxis(layout: Layout, spec: SandboxSpec) -> None:
    """Enroot's wrapper and node-local storage (the login node's and each node's; 1777:
    each user's enroot makes its own dirs, 0700), pyxis's runtime dir, plugstack.conf and
    slurmd's entry script; the builds themselves stay in the cache."""
    build = pyxis.build_for(spec.slurm)
    _mkdir(layout.enroot_dir, 0o755)
    _mkdir(layout.enroot_bin_dir, 0o755)
    local = [layout.enroot_local_dir]
    local += [layout.enroot_node_dir(config.node_name(k)) for k in range(1, spec.nodes + 1)]
    for d in local:
        for sub in ("run", "cache", "data"):
            _mkdir(os.path.join(d, sub), 0o1777)
    _mkdir(layout.pyxis_runtime_dir, 0o1777)
    _write_if_changed(os.path.join(layout.enroot_bin_dir, "enroot"),
                      pyxis.render_wrapper(layout, build), 0o755)
    for helper in pyxis.helpers(build):
        link = os.path.join(layout.enroot_bin_dir, os.path.basename(helper))
        if os.path.islink(link) and os.readlink(link) == helper:
            continue
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(helper, link)
    _mkdir(os.path.dirname(layout.pyxis_plugin), 0o755)
    with open(build.plugin, "rb") as f:
        _write_if_changed(layout.pyxis_plugin, f.read(), 0o755)
    _write_if_changed(layout.plugstack_conf, pyxis.render_plugstack(layout), 0o644)
    _write_if_changed(layout.node_entry_script, pyxis.render_node_entry(layout), 0o755)


def _prepare_root_entry(layout: Layout, spec: SandboxSpec) -> None:
    """The entry script and client wrappers of a release that lives in a root."""
    _write_if_changed(layout.cgroup_conf, config.render_cgroup_conf(), 0o644)
    enter = roots.render_enter(roots.root_dir(spec.slurm), roots.host_binds(layout.root))
    _write_if_changed(layout.enter_script, enter, 0o755)
    _mkdir(layout.bin_dir, 0o755)
    for command in roots.CLIENTS:
        _write_if_changed(os.path.join(layout.bin_dir, command),
                          roots.render_client(layout.enter_script, command), 0o755)


def _prepare_source_clients(layout: Layout, spec: SandboxSpec) -> None:
    """Links to every client command of a release built from source, first on PATH (as a
    root's wrappers are), and no cgroup plugin, as with a root."""
    _write_if_changed(layout.cgroup_conf, config.render_cgroup_conf(), 0o644)
    bin_dir = source.install_for(spec.slurm).bin_dir
    shutil.rmtree(layout.bin_dir, ignore_errors=True)  # a root's wrappers, or another build's
    _mkdir(layout.bin_dir, 0o755)
    for command in sorted(os.listdir(bin_dir)):
        os.symlink(os.path.join(bin_dir, command), os.path.join(layout.bin_dir, command))


def _check_reachable(root: str) -> None:
    """slurmrestd runs as nobody and must read etc/slurm.conf: every existing ancestor of
    the state dir must let others through (``o+x``)."""
    parent = os.path.dirname(root.rstrip("/"))
    while parent and parent != "/":
        try:
            mode = os.stat(parent).st_mode
        except FileNotFoundError:
            parent = os.path.dirname(parent)
            continue
        if not mode & 0o001:
            raise SandboxError(
                f"state dir {root} is not reachable by user nobody (slurmrestd runs as "
                f"nobody): {parent} has mode {oct(mode & 0o777)}; choose a state dir under "
                "/tmp or make the parents o+x")
        parent = os.path.dirname(parent)


def _make_fake_gpus(layout: Layout, spec: SandboxSpec, k: int) -> None:
    paths = config.fake_gpu_files(layout, spec, k)
    if not paths:
        return
    _mkdir(os.path.dirname(paths[0]), 0o755)
    for path in paths:
        if os.path.islink(path) and os.readlink(path) == "/dev/null":
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.symlink("/dev/null", path)


def write_token(layout: Layout, token: str) -> None:
    """The JWT, alone on one line without newline, 0600 (``RAY_SLURM_JWT_FILE``)."""
    _write(layout.token_file, token.strip(), 0o600)


def read_token(layout: Layout) -> str | None:
    try:
        with open(layout.token_file) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def write_env_sh(layout: Layout, env: dict[str, str]) -> None:
    _write_if_changed(layout.env_file, config.render_env_sh(env), 0o644)


@contextlib.contextmanager
def locked(layout: Layout, create: bool = True) -> Iterator[bool]:
    """Hold the sandbox lock; yields False (no lock) if the state dir does not exist and
    `create` is off. Re-opens if `down` removed the lock file while we waited."""
    while True:
        if create:
            os.makedirs(layout.root, mode=0o755, exist_ok=True)
        try:
            fd = os.open(layout.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            if create:
                continue
            yield False
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.fstat(fd).st_ino == os.stat(layout.lock_file).st_ino
            except FileNotFoundError:
                same = False
            if same:
                yield True
                return
        finally:
            os.close(fd)


def _mounts_under(root: str) -> list[str]:
    prefix = root.rstrip("/") + "/"
    found = []
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                target = line.split()[1].replace("\\040", " ")
                if target.startswith(prefix):
                    found.append(target)
    except OSError:
        pass
    return sorted(found, key=len, reverse=True)


def remove_state_dir(layout: Layout) -> None:
    """Unmount anything dockerd left mounted below the state dir, then delete it."""
    for target in _mounts_under(layout.root):
        with contextlib.suppress(proc.CommandError):
            proc.run(["umount", "-l", target], timeout=30)
    try:
        shutil.rmtree(layout.root)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise SandboxError(f"could not remove {layout.root}: {e}") from e

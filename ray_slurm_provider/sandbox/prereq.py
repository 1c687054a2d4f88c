"""What the sandbox needs from the machine: root, and the Debian packages with the daemons."""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil

from ray_slurm_provider import proc
from ray_slurm_provider.sandbox.procs import SandboxError

#: Package -> files that prove it is installed: commands (on PATH or in /usr/sbin) or absolute
#: globs; "a|b" means either will do.
SLURM_PACKAGES: dict[str, tuple[str, ...]] = {
    "slurm-wlm": ("slurmctld", "slurmd", "sinfo", "scontrol", "squeue", "scancel", "sbatch",
                  "srun"),
    "slurmrestd": ("slurmrestd",),
    "slurm-wlm-jwt-plugin": ("/usr/lib/*/slurm-wlm/auth_jwt.so|/usr/lib*/slurm*/auth_jwt.so",),
    "munge": ("munged",),
}
#: With a Slurm release in a cached root: the host only builds and enters it.
ROOT_PACKAGES: dict[str, tuple[str, ...]] = {
    "debootstrap": ("debootstrap",),
    "util-linux": ("unshare", "pivot_root"),
}
#: With a Slurm release built from source (sandbox/source.py): its build and the libraries it
#: links (slurmrestd with JWT needs json-c, yaml, jwt, http-parser; slurmdbd's MySQL plugin
#: needs mariadb), and munge, whose daemon the sandbox runs.
BUILD_PACKAGES: dict[str, tuple[str, ...]] = {
    "munge": ("munged",),
    "libmunge-dev": ("/usr/include/munge.h",),
    "libjson-c-dev": ("/usr/include/json-c/json.h",),
    "libyaml-dev": ("/usr/include/yaml.h",),
    "libjwt-dev": ("/usr/include/jwt.h",),
    "libhttp-parser-dev": ("/usr/include/http_parser.h",),
    "libmariadb-dev": ("/usr/include/mariadb/mysql.h",),
    "make": ("make",),
    "gcc": ("gcc",),
}
#: With --accounting: slurmdbd and the database it stores into.
ACCOUNTING_PACKAGES: dict[str, tuple[str, ...]] = {
    "slurmdbd": ("slurmdbd",),
    "mariadb-server": ("mariadbd", "mariadb-install-db", "mariadb"),
}
#: With --docker: the container runtimes the container suites run over (docker and podman).
DOCKER_PACKAGES: dict[str, tuple[str, ...]] = {
    "docker.io": ("dockerd", "docker"),
    "podman": ("podman",),
    "catatonit": ("catatonit",),
}

#: With --pyxis: pyxis's build (spank.h), enroot's build and runtime, a tiny test image.
PYXIS_PACKAGES: dict[str, tuple[str, ...]] = {
    "libslurm-dev": ("/usr/include/slurm/spank.h",),
    "squashfs-tools": ("mksquashfs", "unsquashfs"),
    "squashfuse": ("squashfuse",),
    "fuse-overlayfs": ("fuse-overlayfs",),
    "jq": ("jq",),
    "parallel": ("parallel",),
    "pigz": ("pigz",),
    "zstd": ("zstd",),
    "makeself": ("makeself",),
    "libbsd-dev": ("/usr/include/bsd/string.h", "/usr/lib/*/libbsd.a"),
    "busybox-static": ("/bin/busybox|/usr/bin/busybox",),
    "make": ("make",),
    "gcc": ("gcc",),
}

#: With --login: the login node's sshd and the keys.
LOGIN_PACKAGES: dict[str, tuple[str, ...]] = {
    "openssh-server": ("sshd",),
    "openssh-client": ("ssh", "ssh-keygen"),
}


def _present(probe: str) -> bool:
    if probe.startswith("/"):
        return bool(glob.glob(probe))
    return shutil.which(probe) is not None or any(
        os.access(os.path.join(d, probe), os.X_OK) for d in ("/usr/sbin", "/sbin")
    )


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a sandbox asks of the machine, one flag per option that brings packages."""

    docker: bool = False
    root: bool = False  # a Slurm release in a cached root
    build: bool = False  # a Slurm release built from source
    accounting: bool = False
    pyxis: bool = False
    login: bool = False


def _table(needs: Needs) -> dict[str, tuple[str, ...]]:
    if needs.build:
        table = dict(BUILD_PACKAGES)
    elif needs.root:
        table = dict(ROOT_PACKAGES)
    else:
        table = dict(SLURM_PACKAGES)
    if needs.docker:
        table.update(DOCKER_PACKAGES)
    if needs.accounting:
        table.update(ACCOUNTING_PACKAGES)
        if needs.build:  # the build brings its own slurmdbd
            del table["slurmdbd"]
    if needs.pyxis:
        table.update(PYXIS_PACKAGES)
    if needs.login:
        table.update(LOGIN_PACKAGES)
    return table


def required_packages(needs: Needs) -> list[str]:
    return list(_table(needs))


def missing_packages(needs: Needs) -> list[str]:
    """Packages (of those the sandbox needs) that look uninstalled."""
    return [pkg for pkg, probes in _table(needs).items()
            if not all(any(_present(alt) for alt in probe.split("|")) for probe in probes)]


def apt_command(needs: Needs) -> list[str]:
    return ["apt-get", "install", "-y", *required_packages(needs)]


def check_root() -> None:
    if os.geteuid() != 0:
        raise SandboxError(
            "the Slurm sandbox must run as root (it starts munged, slurmctld and slurmd "
            "as root); run `sudo ray-slurm sandbox up` or use a root shell"
        )


def ensure_packages(needs: Needs, install: bool) -> None:
    """Fail with the exact apt-get command when packages are missing, or run it if `install`.
    The sandbox never uses a package's system service (its sshd is its own process, on
    its own port); whether apt starts that service is the machine's policy-rc.d's call."""
    missing = missing_packages(needs)
    if not missing:
        return
    cmd = apt_command(needs)
    if not install:
        raise SandboxError(
            f"missing packages for the Slurm sandbox: {' '.join(missing)}\n"
            f"install them with:  {' '.join(cmd)}\n"
            "(or run `ray-slurm sandbox up --install`)"
        )
    env = proc.clean_env(extra={"DEBIAN_FRONTEND": "noninteractive"})
    try:
        proc.run(["apt-get", "update", "-q"], env=env, timeout=600)
        proc.run(cmd, env=env, timeout=1200)
    except proc.CommandError as e:
        raise SandboxError(f"installing packages failed: {e}\n{e.stderr[-2000:]}") from e
    still = missing_packages(needs)
    if still:
        raise SandboxError(f"still missing after apt-get install: {' '.join(still)}")

"""A Ray node image without a registry: `ray-slurm sandbox image`.

The machine has no image registry, so the sandbox's image is built from what is here. It is a
tiny root filesystem (directories, `bin -> usr/bin`-style links, a real `/sbin` for Docker's
`--init`, passwd/group, the loader cache, CA certificates) imported with `docker import`.
At run time the host's `/usr` is bound read-only and the container setting `host_python:
true` binds the node agent's own Python environment, so Python and Ray inside the container
are exactly the host's (see testbed.md: 1-2 s to build instead of ~90 s for a full rootfs).

Apptainer takes the same root filesystem as a directory ("sandbox" image): no build tool, no
registry, and ordinary users run it in a user namespace. Enroot and Pyxis take it as a
squashfs file (``mksquashfs -all-root`` of that directory), which every node reads from the
shared dir.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

from ray_slurm_provider import proc

DEFAULT_TAG = "rsp-bind:latest"
#: The image's file name in the sandbox's shared dir, for the runtimes that take a path.
FILE_NAMES = {"apptainer": "rsp-bind", "enroot": "rsp-bind.sqsh"}
_LINKS = {"bin": "usr/bin", "lib": "usr/lib", "lib64": "usr/lib64"}
_DIRS = ("sbin", "etc", "tmp", "root", "home", "proc", "sys", "dev", "run", "var/tmp", "usr",
         "opt", "mnt")
_COPY = ("/etc/passwd", "/etc/group", "/etc/ld.so.cache", "/etc/nsswitch.conf",
         "/etc/ssl/certs/ca-certificates.crt")


def _add_dir(tar: tarfile.TarFile, name: str, mode: int = 0o755) -> None:
    if name in tar.getnames():
        return  # docker import refuses duplicate paths
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, int(time.time())
    tar.addfile(info)


def rootfs_tar(path: Path) -> None:
    """Write the image's root filesystem as a tar file."""
    with tarfile.open(path, "w") as tar:
        for d in _DIRS:
            _add_dir(tar, d, 0o1777 if d in ("tmp", "var/tmp") else 0o755)
        for name, target in _LINKS.items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        for src in _COPY:
            if os.path.exists(src):
                data = Path(src).read_bytes()
                info = tarfile.TarInfo(src.lstrip("/"))
                info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
                parts = Path(src.lstrip("/")).parent.parts
                for i in range(1, len(parts) + 1):
                    _add_dir(tar, str(Path(*parts[:i])))
                tar.addfile(info, io.BytesIO(data))


#: Podman flags that work on this kind of machine (cgroup v1 + cgroup2 "hybrid", no systemd,
#: root): vfs storage, cgroupfs, file events. Containers also need `--runtime runc` (crun
#: refuses hybrid cgroups) and explicit nofile/nproc ulimits (see sandbox-podman.yaml).
PODMAN_ARGS = ("--storage-driver", "vfs", "--cgroup-manager", "cgroupfs",
               "--events-backend", "file")


def build_dir(dest: str) -> str:
    """Write the image as a directory for apptainer (readable by every user), beside `dest`,
    then move it into place (an older one is moved aside first and then removed), so a job
    never sees half an image."""
    dest = os.path.abspath(dest)
    os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".rsp-image-", dir=os.path.dirname(dest))
    try:
        tar_path = Path(tmp) / "rootfs.tar"
        rootfs_tar(tar_path)
        root = Path(tmp) / "root"
        with tarfile.open(tar_path) as tar:
            # Our own tar (rootfs_tar), which keeps /tmp's sticky bit: the "tar" filter would not.
            tar.extractall(root, filter="fully_trusted")
        os.chmod(root, 0o755)
        if os.path.exists(dest):
            os.rename(dest, Path(tmp) / "old")
        os.rename(root, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def build_sqsh(dest: str) -> str:
    """Write the image as a squashfs file for enroot and pyxis (readable by every user),
    built beside `dest` and then renamed into place, so a job never reads half a file."""
    dest = os.path.abspath(dest)
    os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".rsp-image-", dir=os.path.dirname(dest)) as tmp:
        root = build_dir(os.path.join(tmp, "root"))
        out = os.path.join(tmp, "image.sqsh")
        proc.run(["mksquashfs", root, out, "-all-root", "-noappend", "-no-progress"],
                 timeout=300)
        os.chmod(out, 0o644)
        os.replace(out, dest)
    return dest


def build(tag: str = DEFAULT_TAG, runtime: str = "docker") -> str:
    """Build and import the image into docker or podman; return its tag. For apptainer,
    `tag` is the directory to write; for enroot, the .sqsh file."""
    if runtime == "apptainer":
        return build_dir(tag)
    if runtime == "enroot":
        return build_sqsh(tag)
    cli = ["podman", *PODMAN_ARGS] if runtime == "podman" else [runtime]
    with tempfile.TemporaryDirectory(prefix="rsp-image-") as d:
        tar = Path(d) / "rootfs.tar"
        rootfs_tar(tar)
        proc.run([*cli, "import", str(tar), tag], timeout=300)
    return tag

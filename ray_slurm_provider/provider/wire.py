"""What crosses the SSH connection of `provider.ssh` between a laptop (laptop.py) and the
login node (serve.py): the request's config, the reply line, errors, files. Imports neither
side, so both import it."""

from __future__ import annotations

import base64
import copy
import io
import os
import stat
import tarfile
from typing import Any

import click

#: The reply's line starts with this (an ASCII record separator, which no command prints).
MARKER = "\x1erayslurm-reply "
MODULE = "ray_slurm_provider.provider.SlurmNodeProvider"


def login_config(provider_config: dict[str, Any]) -> dict[str, Any]:
    """The provider section as the login node (and the head) runs it: no `ssh`, the
    provider's own module."""
    out = copy.deepcopy(provider_config)
    out.pop("ssh", None)
    out["module"] = MODULE
    return out


def unpack(data: str, into: str) -> None:
    """A laptop's files (a gzipped tar, base64) into `into`: plain files and directories
    only; a member that would land outside `into` is refused. (Debian 12's Python 3.11.2
    has no tarfile filters.)"""
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(data)), mode="r:gz") as tar:
        members = tar.getmembers()
        for m in members:
            parts = m.name.split("/")
            if m.name.startswith("/") or ".." in parts or not (m.isfile() or m.isdir()):
                raise ValueError(f"refused archive member {m.name!r}")
        for m in members:
            m.mode &= 0o755  # no set-id bits from a laptop
            tar.extract(m, into, set_attrs=m.isfile())


def pack(source: str) -> tuple[str, str]:
    """`source` (a file, or a directory whose contents `dir/` means) as a base64 gzipped
    tar, and the name the other side gives to its rsync (with the trailing `/`): a
    laptop's file mounts (run_rsync_up), the login node's copy of `ray rsync-down`. Symbolic
    links are followed, as `ray up` does from a machine that shares the cluster's
    filesystem: a link to this laptop's path would point nowhere on the cluster. A link
    that points nowhere, or to a directory that holds it, stops with its name."""
    path = os.path.expanduser(source)
    name = os.path.basename(path.rstrip("/")) or "files"
    buf = io.BytesIO()
    try:
        with tarfile.open(fileobj=buf, mode="w:gz", dereference=True) as tar:
            _add(tar, path, name, frozenset())
    except OSError as e:
        where = e.filename or path
        raise click.ClickException(f"file_mounts: cannot copy {where} to the cluster: "
                                   f"{e.strerror or e}") from e
    return base64.b64encode(buf.getvalue()).decode(), name + ("/" if source.endswith("/") else "")


def _add(tar: tarfile.TarFile, path: str, arcname: str,
         above: frozenset[tuple[int, int]]) -> None:
    """`path` into `tar`, links followed; `above`: the directories it is in, by (device,
    inode), so that a link to one of them stops at once rather than after 40 copies."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        tar.add(path, arcname=arcname, recursive=False)
        return
    key = (st.st_dev, st.st_ino)
    if key in above:
        raise click.ClickException(f"file_mounts: {path} links to a directory that holds it")
    tar.add(path, arcname=arcname, recursive=False)
    for entry in sorted(os.listdir(path)):
        _add(tar, os.path.join(path, entry), f"{arcname}/{entry}", above | {key})


def error_reply(e: BaseException) -> dict[str, Any]:
    """An exception as the laptop re-raises it (laptop.raise_reply)."""
    import click

    if isinstance(e, click.ClickException):
        return {"kind": "click", "message": e.format_message()}
    if type(e).__name__ == "ProcessRunnerError":  # Ray's, from rayapi.runner_error
        code = getattr(e, "code", None)
        return {"kind": "runner", "message": str(e),
                "code": code if isinstance(code, int) else None,
                "cmd": str(getattr(e, "command", "") or "")}
    return {"kind": type(e).__name__, "message": str(e)}

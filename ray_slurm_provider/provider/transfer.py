"""`ray rsync-up/down` and Ray's file mounts: copies on the shared filesystem.

The login node and the compute nodes see the same user and home (every Slurm site has one
shared filesystem), so a transfer is a local copy; nothing goes through the job.
"""

from __future__ import annotations

import copy as copy_module
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from ray_slurm_provider.cluster import AUTO_PYTHON_KEY
from ray_slurm_provider.state import ClusterDir

BOOTSTRAP_FILES = ("~/ray_bootstrap_config.yaml",)


def remote_path(cdir: ClusterDir, path: str) -> str:
    """Where `path` on a node is. The head's autoscaler config is per cluster, not per
    user's home: two clusters of one user must not overwrite each other's."""
    if path.rstrip("/") in BOOTSTRAP_FILES:
        return str(cdir.bootstrap_config)
    return os.path.expanduser(path)


def copy_bootstrap_config(src: str, dst: str) -> None:
    """The head's autoscaler config, as `ray up` syncs it."""
    write_bootstrap_config(json.loads(Path(os.path.expanduser(src)).read_text()), dst)


def write_bootstrap_config(config: dict[str, Any], dst: str) -> None:
    """Write the head's autoscaler config: a `provider.python` that is only bootstrap's
    default becomes this process's Python (Ray's config cache may have kept another
    checkout's)."""
    config = copy_module.deepcopy(config)
    provider = config.get("provider") or {}
    if provider.get(AUTO_PYTHON_KEY):
        provider["python"] = sys.executable
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    Path(dst).write_text(json.dumps(config))


def copy(src: str, dst: str) -> None:
    """rsync-like copy (`dir/` copies the contents). On the shared filesystem the source is
    often the target itself (`ray submit` from the home directory, a file mount at its own
    path): that is a no-op, as rsync makes it."""
    s = Path(os.path.expanduser(src))
    if s.is_dir():
        if _same(s, Path(dst)):
            return
        shutil.copytree(s, dst, dirs_exist_ok=True)
        return
    d = Path(dst)
    if dst.endswith("/") or d.is_dir():
        d = d / s.name
    if _same(s, d):
        return
    d.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(s, d)


def _same(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False

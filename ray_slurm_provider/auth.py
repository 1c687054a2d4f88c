"""Ray token authentication: one token per cluster, handed around by path only.

Ray >= 2.52 reads `RAY_AUTH_MODE` and `RAY_AUTH_TOKEN_PATH`. The token value never appears in
the YAML, the job script, the Slurm job environment or a command line: those are readable by
others (Ray's config cache in /tmp is world-readable, slurmctld stores job environments).
The mode is always set explicitly, because Ray turns token mode on by itself for a head when
`~/.ray/auth_token` exists, and a worker without the mode then cannot join.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TOKEN_FILE = "auth_token"


def ensure_token(cluster_dir: Path) -> Path:
    """Create the cluster's 0600 token file if missing; return its path."""
    cluster_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = cluster_dir / TOKEN_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)  # never leave a readable token behind
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def auth_env(mode: str, token_path: Path | None) -> dict[str, str]:
    """Environment that every Ray process of the cluster (and its clients) needs."""
    if mode == "disabled":
        return {"RAY_AUTH_MODE": "disabled"}
    if token_path is None:
        raise ValueError("token auth needs a token path")
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}

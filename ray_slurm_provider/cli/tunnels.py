"""`ray-slurm env CFG` with `provider.ssh`: tunnels from this machine to the head, over the
one connection to the login node.

The head's address, ports and the Ray token are read from the cluster directory on the login
node (head.json, auth_token: file reads, their text on stdout). Two forwards go on the
master of the cluster's own (SshLink.forward: it persists until closed), each bound to
127.0.0.1: the dashboard (jobs API) and the Ray client port. Their local ports are chosen once
per cluster and recorded in ``~/.ray_slurm/<cluster>/tunnels.json`` on this machine, so a
tunnel reopened after it died keeps its port and exported addresses stay valid; running `env`
again reopens a dead tunnel, and one to a head that moved. The token is copied to
``~/.ray_slurm/<cluster>/laptop_auth_token`` (0600); `env --close` ends this cluster's
tunnels and removes that copy. The names differ from the cluster directory's own files: where
this machine's home is the login node's (a notebook on the cluster), that directory is this
one, and `--close` must not remove the cluster's token.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import shlex
import socket
import sys
import tempfile
from pathlib import Path

from ray_slurm_provider import auth, proc
from ray_slurm_provider.cli.common import CliError, Cluster
from ray_slurm_provider.cli.sshcheck import local_version
from ray_slurm_provider.slurm.ssh import SshError, SshLink
from ray_slurm_provider.state import HeadInfo, parse_head

TUNNELS_FILE = "tunnels.json"
#: What the open tunnels forward (to close and reopen them when the head moved).
FORWARDS_FILE = "tunnels_open.json"
#: The token copy (never the cluster directory's own `auth_token`: see above).
TOKEN_COPY = "laptop_auth_token"
#: The forwards, by name: which port of head.json each carries.
FORWARDS = ("dashboard", "client")
LOCAL_DIR = "~/.ray_slurm"


def local_dir(cluster: Cluster) -> Path:
    """This machine's files of the cluster (0700): the recorded ports, the token copy."""
    d = Path(os.path.expanduser(LOCAL_DIR)) / cluster.name
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    return d


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def local_ports(d: Path) -> dict[str, int]:
    """The recorded local ports, each chosen once (a free one) and kept."""
    path = d / TUNNELS_FILE
    try:
        ports = {k: int(v) for k, v in json.loads(path.read_text()).items() if k in FORWARDS}
    except (OSError, ValueError, AttributeError):
        ports = {}
    missing = [name for name in FORWARDS if name not in ports]
    if missing:
        for name in missing:
            ports[name] = _free_port()
        _write_json(path, ports)
    return ports


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: object) -> None:
    """Atomically, through a temp file of this process's own (two `env` at once)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _remote_head(cluster: Cluster, link: SshLink) -> HeadInfo:
    root = f"{cluster.pcfg.state_dir.rstrip('/')}/{cluster.name}"
    text = link.read_file(f"{root}/head.json")
    head = parse_head(text, f"{root}/head.json on {link.cfg.host}") if text else None
    if head is None:
        raise CliError(f"cluster {cluster.name!r} has no running head on {link.cfg.host} "
                       f"({root}/head.json missing): run `ray up` first")
    return head


def _copy_token(cluster: Cluster, link: SshLink, d: Path) -> Path:
    root = f"{cluster.pcfg.state_dir.rstrip('/')}/{cluster.name}"
    token = link.read_file(f"{root}/{auth.TOKEN_FILE}")
    if not token:
        raise CliError(f"no Ray token at {root}/{auth.TOKEN_FILE} on {link.cfg.host}")
    path = d / TOKEN_COPY
    fd, tmp = tempfile.mkstemp(dir=d, prefix=TOKEN_COPY + ".")  # 0600, this process's own
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.replace(tmp, path)
    return path


#: Prints the cluster Python's Ray version and Python minor version.
_RAY_VERSIONS = "import sys, ray; print(ray.__version__, '%d.%d' % sys.version_info[:2])"


def local_ray_versions() -> str:
    try:
        ray = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        ray = "none"
    return f"{ray} {sys.version_info[0]}.{sys.version_info[1]}"


def version_warnings(cluster: Cluster, link: SshLink) -> list[str]:
    """What differs between this machine and the login node's provider.python: the package
    (the two sides must match), Ray and the Python minor version (Ray Client needs both)."""
    python = cluster.pcfg.python or "python3"
    out = []
    theirs = link.package_version(python)
    mine = local_version()
    if theirs is None:
        out.append(f"{python} on {link.cfg.host} has no ray-slurm-provider (set "
                   "provider.python)")
    elif theirs != mine:
        out.append(f"ray-slurm-provider {mine} here, {theirs} on {link.cfg.host}")
    res = link.run([python, "-c", _RAY_VERSIONS], timeout=120, check=False)
    there = res.stdout.strip()
    here = local_ray_versions()
    if res.returncode == 0 and there != here:
        out.append(f"Ray Client (RAY_ADDRESS=ray://...) needs the same Ray and Python minor "
                   f"version on both sides: here Ray/Python {here.replace(' ', '/')}, on the "
                   f"cluster {there.replace(' ', '/')}; `ray job submit` works across them")
    return out


def tunnel_env(cluster: Cluster) -> tuple[HeadInfo, dict[str, str], dict[str, int]]:
    """Open (or reopen) the forwards: the head, the exports that point Ray's client tools
    at them, and the local ports."""
    link = cluster.remote
    assert link is not None
    try:
        for warning in version_warnings(cluster, link):
            print(f"# warning: {warning}", file=sys.stderr)
        head = _remote_head(cluster, link)
        d = local_dir(cluster)
        ports = local_ports(d)
        remote = {"dashboard": head.dashboard_port, "client": head.client_port}
        wanted = {name: f"{head.ip}:{remote[name]}" for name in FORWARDS}
        if _read_json(d / FORWARDS_FILE) != wanted:  # a head that moved, or none recorded
            link.close_tunnels(cluster.name)
        for name in FORWARDS:
            link.forward(cluster.name, ports[name], head.ip, remote[name])
        _write_json(d / FORWARDS_FILE, wanted)
        env = {
            "RAY_ADDRESS": f"ray://127.0.0.1:{ports['client']}",
            "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{ports['dashboard']}",
            "RAY_DASHBOARD_URL": f"http://127.0.0.1:{ports['dashboard']}",
        }
        if cluster.pcfg.auth.mode == "token":
            env.update(auth.auth_env("token", _copy_token(cluster, link, d)))
        else:
            env.update(auth.auth_env("disabled", None))
            print("# warning: auth.mode is disabled: anyone who can connect to 127.0.0.1 on "
                  "this machine can run jobs as you through these tunnels", file=sys.stderr)
    except SshError as e:
        raise CliError(str(e)) from e
    except proc.CommandError as e:  # ssh itself hung, or a command there failed
        raise CliError(f"over ssh to {link.cfg.host}: {e}") from e
    return head, env, ports


def open_tunnels(cluster: Cluster) -> list[str]:
    """Open (or reopen) the forwards; the export lines and how to close them."""
    link = cluster.remote
    assert link is not None
    head, env, ports = tunnel_env(cluster)
    lines = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines.append(f"# tunnels over ssh to {link.cfg.host}: 127.0.0.1:{ports['dashboard']} -> "
                 f"dashboard {head.ip}:{head.dashboard_port}, 127.0.0.1:{ports['client']} -> "
                 f"Ray client {head.ip}:{head.client_port}; close them with "
                 f"`ray-slurm env --close {cluster.path}`")
    return lines


def close_tunnels(cluster: Cluster) -> list[str]:
    """End this cluster's tunnels (their master); remove the token copy. The ports stay
    recorded for the next `env`; the main connection and other clusters' tunnels stay."""
    link = cluster.remote
    assert link is not None
    d = local_dir(cluster)
    link.close_tunnels(cluster.name)
    for name in (TOKEN_COPY, FORWARDS_FILE):
        with contextlib.suppress(FileNotFoundError):
            (d / name).unlink()
    return [f"# tunnels to {link.cfg.host} closed"]

"""`ray-slurm doctor CONFIG`: can this login node run the cluster? Each check says how to fix.

Checks, in order: the config model; Slurm access through the configured transport (CLI: the
commands and munge; REST: URL, token file mode and expiry, an answer; pyslurm: it loads and
matches); the cluster directory and the Ray token file (0600); the node agent's Python; the
Ray temp dir length; the cluster's port block on the head's node (or, while no head runs, on
every node of the head's partition: a port something else listens on makes Ray's start fail).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import stat
import sys
import time
from typing import Any

from ray.autoscaler.tags import NODE_KIND_HEAD, TAG_RAY_NODE_KIND

from ray_slurm_provider import auth, proc
from ray_slurm_provider.cli import sshcheck
from ray_slurm_provider.cli.common import (
    Cluster,
    Finding,
    Level,
    config_command,
    load_cluster,
    report,
    run_command,
)
from ray_slurm_provider.config import ConfigError
from ray_slurm_provider.jobs import SOCKET_PATH_MAX, decode_tags, longest_socket_below_root
from ray_slurm_provider.ports import port_block
from ray_slurm_provider.provider.bootstrap import validate
from ray_slurm_provider.slurm.client import ClusterInfo, SlurmError
from ray_slurm_provider.slurm.rest import http as rest_http

PORT_NAMES = ("GCS", "dashboard", "Ray client", "autoscaler metrics", "dashboard metrics")


def slurm_findings(cluster: Cluster) -> tuple[list[Finding], ClusterInfo | None]:
    api, out = cluster.pcfg.slurm_api, []
    if api == "cli":
        missing = [c for c in ("sbatch", "squeue", "scancel", "scontrol", "srun")
                   if shutil.which(c) is None]
        if missing:
            out.append(Finding("fail", "Slurm commands", f"not on PATH: {', '.join(missing)}",
                               "load your site's Slurm module, or set provider.slurm_api: rest"))
        out.append(_munge())
    elif api == "rest":
        out += _token(cluster)
    try:
        info = cluster.ask("asking Slurm for its partitions", cluster.client.cluster_info)
    except SlurmError as e:
        fix = {"cli": "check SLURM_CONF and that slurmctld runs (`scontrol ping`)",
               "rest": "check provider.rest.url and the token (`scontrol token` for a new one)",
               "pyslurm": "install the pyslurm release matching your Slurm, or use cli/rest"}[api]
        if api == "rest" and shutil.which("scontrol"):
            ping = proc.run(["scontrol", "ping"], timeout=30, check=False).stdout
            if "UP" in ping:
                fix = "slurmctld is UP (scontrol ping), so slurmrestd or the token is the " \
                      "problem: get a fresh token with `scontrol token lifespan=86400`"
        return [*out, Finding("fail", f"Slurm via {api}", str(e), fix)], None
    out.append(Finding("ok", f"Slurm via {api}", f"Slurm {info.version} answers "
                       f"({len(info.partitions)} partitions)"))
    return out, info


def _auth_config() -> dict[str, str]:
    """AuthType and AuthInfo from `scontrol show config` (empty when it cannot be read)."""
    try:
        text = proc.run(["scontrol", "show", "config"], timeout=30).stdout
    except proc.CommandError:
        return {}
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs if k.strip() in ("AuthType", "AuthInfo")}


def _munge() -> Finding:
    conf = _auth_config()
    if conf.get("AuthType", "auth/munge") != "auth/munge":
        return Finding("info", "munge", f"not used: Slurm authenticates with "
                       f"{conf['AuthType']}")
    if shutil.which("munge") is None or shutil.which("unmunge") is None:
        return Finding("info", "munge", "munge/unmunge not found here: cannot check")
    sock = [a.split("=", 1)[1] for a in conf.get("AuthInfo", "").split(",")
            if a.startswith("socket=")]
    opt = ["-S", sock[0]] if sock else []
    try:
        cred = proc.run(["munge", "-n", *opt], timeout=15).stdout
        proc.run(["unmunge", *opt], input=cred, timeout=15)
    except proc.CommandError as e:
        return Finding("fail", "munge", f"a credential does not round-trip: {e}",
                       "is munged running (`systemctl status munge`), is its socket "
                       f"({sock[0] if sock else '/run/munge'}) readable?")
    return Finding("ok", "munge", f"munge -n | unmunge works{' via ' + sock[0] if sock else ''}")


def _token(cluster: Cluster) -> list[Finding]:
    r = cluster.pcfg.rest
    url = r.url or os.environ.get("RAY_SLURM_REST_URL")
    out = [Finding("ok" if url else "fail", "slurmrestd URL", url or "not set",
                   "set provider.rest.url (or RAY_SLURM_REST_URL)")]
    jwt_file = r.jwt_file or os.environ.get("RAY_SLURM_JWT_FILE")
    try:
        token = rest_http.read_token(jwt_file, r.jwt_env, os.environ)
    except SlurmError as e:
        return [*out, Finding("fail", "Slurm JWT", str(e), rest_http.TOKEN_HINT)]
    exp = rest_http.jwt_claims(token).get("exp")
    where = f"file {jwt_file}" if jwt_file else f"${r.jwt_env}"
    if isinstance(exp, (int, float)):
        left = exp - time.time()
        level: Level = "warn" if left < 86400 else "ok"
        out.append(Finding(level, "Slurm JWT", f"from {where}, expires in {left / 3600:.1f} h",
                           "get a longer-lived token: `scontrol token lifespan=<seconds>`"))
    else:
        out.append(Finding("ok", "Slurm JWT", f"from {where} (no expiry claim)"))
    return out


def files_findings(cluster: Cluster) -> list[Finding]:
    out, root = [], cluster.cdir.root
    if not root.exists():
        parent = root.parent
        ok = os.access(parent if parent.exists() else parent.parent, os.W_OK)
        out.append(Finding("ok" if ok else "fail", "cluster directory",
                           f"{root} does not exist yet (created by `ray up`)",
                           f"make {parent} writable, or set provider.state_dir"))
    else:
        mode = stat.S_IMODE(root.stat().st_mode)
        out.append(Finding("warn" if mode & 0o077 else "ok", "cluster directory",
                           f"{root} (mode {mode:o})", f"chmod 700 {root}"))
    token = root / auth.TOKEN_FILE
    if cluster.pcfg.auth.mode == "token" and token.exists():
        mode = stat.S_IMODE(token.stat().st_mode)
        out.append(Finding("fail" if mode & 0o077 else "ok", "Ray auth token",
                           f"{token} (mode {mode:o})",
                           f"chmod 600 {token}: anyone who reads it can run code on your "
                           "cluster"))
    elif cluster.pcfg.auth.mode == "disabled":
        out.append(Finding("warn", "Ray auth", "token authentication is disabled: anyone "
                           "who can reach the head's ports can run code as you",
                           "remove `auth: {mode: disabled}`"))
    python = cluster.pcfg.python or sys.executable
    try:
        proc.run([python, "-c", "import ray, ray_slurm_provider"], timeout=120)
        out.append(Finding("ok", "node agent Python", f"{python} imports ray and "
                           "ray_slurm_provider (here; the nodes must see the same path)"))
    except proc.CommandError as e:
        out.append(Finding("fail", "node agent Python", f"{python}: {e}",
                           "set provider.python to a Python with both installed"))
    longest = len(cluster.pcfg.temp_dir_root.rstrip("/")) + longest_socket_below_root()
    out.append(Finding("warn" if longest > SOCKET_PATH_MAX else "ok", "Ray temp dir",
                       f"socket paths up to {longest} bytes (limit {SOCKET_PATH_MAX})",
                       "set provider.temp_dir_root to a shorter path, e.g. /tmp"))
    return out


def _listening(addr: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return True
    except OSError:
        return False


def ports_findings(cluster: Cluster, info: ClusterInfo) -> list[Finding]:
    block = port_block(cluster.name, cluster.pcfg.ports.base)
    ports = [block.base + i for i in range(len(PORT_NAMES))]
    what = f"ports {ports[0]}-{ports[-1]}"
    try:
        jobs = cluster.ask("listing the cluster's jobs",
                           lambda: cluster.client.list_jobs(cluster.job_name))
    except SlurmError as e:
        return [Finding("fail", what, f"cannot list the cluster's jobs: {e}", "see above")]
    heads = [j for j in jobs if j.running and
             (decode_tags(j.comment) or {}).get(TAG_RAY_NODE_KIND) == NODE_KIND_HEAD]
    if heads:
        h = heads[0]
        up = _listening(h.node_addr, block.gcs)
        return [Finding("ok" if up else "warn", what, f"head job {h.job_id} runs on "
                        f"{h.batch_host}; its GCS port {block.gcs} "
                        f"{'answers' if up else 'does not answer (yet)'}",
                        f"`ray-slurm logs {cluster.path} head` shows why Ray is not up")]
    try:
        head = cluster.parsed.node_type(cluster.parsed.head_type)
        part = info.partition(head.node_config.partition)
    except ConfigError:
        part = None
    nodes = list(part.nodes) if part else []
    busy = [f"{n.name}:{p} ({PORT_NAMES[p - block.base]})" for n in nodes[:32] for p in ports
            if _listening(n.addr, p, 0.5)]
    if busy:
        return [Finding("warn", what, f"already in use on {', '.join(busy)}: a head placed "
                        "there cannot start Ray", "set provider.ports.base to another block "
                        "(a multiple of 10 in 24000-31990)")]
    return [Finding("ok", what, f"free on the {len(nodes)} nodes of the head's partition")]


def doctor_findings(cluster: Cluster) -> list[Finding]:
    try:
        validate(cluster.config, live=False)
        out = [Finding("ok", "config", "matches the config model")]
    except ConfigError as e:
        out = [Finding("fail", "config", str(e), f"`ray-slurm validate {cluster.path}`")]
    if cluster.pcfg.ssh is not None:  # from a laptop: the login node's side, over SSH
        return out + sshcheck.ssh_findings(cluster.pcfg, sleep=cluster.sleep)
    slurm, info = slurm_findings(cluster)
    out += slurm + files_findings(cluster)
    if info is not None:
        out += ports_findings(cluster, info)
    out.append(Finding("info", "containers", "runtime checks are not part of doctor yet "
                       "(see issue: containers)"))
    return out


def cmd_doctor(args: argparse.Namespace) -> int:
    return run_command(lambda: report(doctor_findings(load_cluster(args.config))))


def register(sub: Any) -> None:
    config_command(sub, "doctor", "check Slurm access, token, files and ports; say how to "
                   "fix each problem", cmd_doctor)

"""`ray-slurm` commands that work on a cluster config (env, ...)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Any

import yaml

from ray_slurm_provider import auth
from ray_slurm_provider.config import parse_provider
from ray_slurm_provider.state import ClusterDir


def load_cluster(path: str) -> tuple[dict[str, Any], ClusterDir]:
    cfg = yaml.safe_load(Path(path).read_text())
    pcfg = parse_provider(cfg.get("provider") or {})
    return cfg, ClusterDir(pcfg.state_dir, str(cfg["cluster_name"]))


def env_lines(path: str) -> list[str]:
    """Shell lines that point Ray's client tools at the cluster (with its auth token)."""
    cfg, cdir = load_cluster(path)
    pcfg = parse_provider(cfg.get("provider") or {})
    head = cdir.read_head()
    if not head:
        raise SystemExit(f"cluster {cfg['cluster_name']!r} has no running head "
                         f"({cdir.head_file} missing): run `ray up {path}` first")
    dash = f"http://{head.ip}:{head.dashboard_port}"
    env = {
        "RAY_ADDRESS": dash,
        "RAY_DASHBOARD_URL": dash,
        "RAY_GCS_ADDRESS": f"{head.ip}:{head.gcs_port}",
        **auth.auth_env(pcfg.auth.mode, cdir.root / auth.TOKEN_FILE),
    }
    lines = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines.append(f"# From a laptop: ssh -L 8265:{head.ip}:{head.dashboard_port} "
                 "<login node>, then open http://localhost:8265")
    return lines


def cmd_env(args: argparse.Namespace) -> int:
    print("\n".join(env_lines(args.config)))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("env", help="print the exports that point Ray's tools at a cluster")
    p.add_argument("config", help="cluster YAML")
    p.set_defaults(func=cmd_env)

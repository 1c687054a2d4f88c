"""The cluster directory: state shared by the login node, the head and the workers.

Slurm itself holds each node's immutable identity (job name `ray-<cluster>`, creation tags in
the job comment). What changes over a node's life lives here, on a filesystem that the login
node and the compute nodes share (the user's home on any HPC site):

    <state_dir>/<cluster>/
        auth_token                 0600 Ray token
        ray_bootstrap_config.yaml  the head's autoscaler config (per cluster, not per user)
        head.json                  written by the head agent once Ray is up: ip, ports, job id
        teardown                   the head's job was cancelled: workers skip Ray's drain
        logs/<job id>.out          every job's output (an array task's id: <array>_<task>)
        nodes/<job id>/tags.json   tags Ray set after creation (ray-node-status, ...)
        tags.gen                   rewritten with every tags.json: readers skip unchanged ones
        nodes/<job id>/agent.json  the node agent is alive (host, address)
        nodes/<job id>/ray.json    Ray is up on that node
        nodes/<job id>/start.json  `ray up` -> head agent: the start program (handoff)
        nodes/<job id>/result.json head agent -> `ray up`: how the start went
        nodes/<job id>/stop        `ray stop` on the head: stop this job's Ray, nothing else
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


def write_json(path: Path, data: Any, mode: int = 0o644) -> None:
    """Atomic write: readers on other nodes never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, sort_keys=True)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> Any:
    """The file's JSON, or None when it does not exist (yet)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


class ClusterDir:
    """Paths of one cluster's shared state."""

    def __init__(self, state_dir: str, cluster_name: str) -> None:
        self.root = Path(os.path.expanduser(state_dir)) / cluster_name
        # `tags` and `ray_up` run for every node on every autoscaler tick: plain strings
        # there, pathlib costs more than the system calls (bench/p4_listing_cpu.py).
        self._nodes_dir = os.path.join(self.root, "nodes")
        self._tags_gen = os.path.join(self.root, "tags.gen")

    def create(self) -> None:
        for d in (self.root, self.logs, self.root / "nodes"):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def bootstrap_config(self) -> Path:
        return self.root / "ray_bootstrap_config.yaml"

    @property
    def head_info(self) -> Path:
        return self.root / "head.json"

    @property
    def teardown(self) -> Path:
        """Written when the head's job is cancelled (`ray down`): workers that get SIGTERM
        then stop Ray at once instead of draining towards a GCS that is going away."""
        return self.root / "teardown"

    def mark_teardown(self) -> None:
        try:
            self.teardown.touch()
        except OSError:
            pass  # best effort: workers also see head.json go

    def log(self, job_id: str) -> Path:
        return self.logs / f"{job_id}.out"

    def node(self, job_id: str) -> Path:
        return self.root / "nodes" / job_id

    def tags(self, job_id: str) -> dict[str, str]:
        try:
            with open(f"{self._nodes_dir}/{job_id}/tags.json") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        return dict(data) if isinstance(data, dict) else {}

    def set_tags(self, job_id: str, tags: dict[str, str]) -> None:
        merged = {**self.tags(job_id), **tags}
        write_json(self.node(job_id) / "tags.json", merged)
        # Readers in other processes re-read the tags files only when this changed.
        write_json(self.root / "tags.gen", os.urandom(8).hex())

    def tags_generation(self) -> str:
        """Changes whenever any node's tags.json is written (one small read per tick)."""
        try:
            with open(self._tags_gen) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def ray_up(self, job_id: str) -> bool:
        return os.path.exists(f"{self._nodes_dir}/{job_id}/ray.json")

    def forget(self, job_ids: list[str]) -> None:
        """Drop the state of nodes that are gone for good."""
        for j in job_ids:
            shutil.rmtree(self.node(j), ignore_errors=True)

    def known_nodes(self) -> list[str]:
        d = self.root / "nodes"
        return sorted(p.name for p in d.iterdir()) if d.is_dir() else []

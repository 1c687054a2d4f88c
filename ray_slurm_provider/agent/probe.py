"""`python -m ray_slurm_provider.agent.probe CLUSTER_DIR CLUSTER`: can this process's
environment (e.g. the inside of the head's container) list the cluster's jobs?

Uses the transport the cluster is configured with, read from its bootstrap config.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from ray_slurm_provider.config import ProviderConfig, parse_provider
from ray_slurm_provider.jobs import job_name
from ray_slurm_provider.retry import exponential
from ray_slurm_provider.slurm.client import SlurmClient, SlurmError, ask
from ray_slurm_provider.slurm.factory import make_client

#: Tries of the listing: a controller that answers slowly (rate-limited, issue 29) is no
#: container without Slurm. Three 30 s tries and their waits fit the head's 120 s for it.
ATTEMPTS = 3
DELAY = exponential(2.0, cap_s=10.0, jitter=0.2)


def client_for(cluster_dir: Path) -> SlurmClient:
    pcfg = ProviderConfig()
    boot = cluster_dir / "ray_bootstrap_config.yaml"
    if boot.exists():
        pcfg = parse_provider(json.loads(boot.read_text()).get("provider", {}))
    return make_client(pcfg)


def main(argv: list[str] | None = None, sleep: Callable[[float], None] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m ray_slurm_provider.agent.probe CLUSTER_DIR CLUSTER")
        return 2
    try:
        client = client_for(Path(args[0]))
        jobs = ask("listing the cluster's jobs", lambda: client.list_jobs(job_name(args[1])),
                   say=lambda line: print(line, file=sys.stderr), sleep=sleep,
                   attempts=ATTEMPTS, delay=DELAY)
    except SlurmError as e:
        print(f"Slurm said: {e.slurm_message}")
        return 1
    except Exception as e:
        print(f"{type(e).__name__}: {e}")
        return 1
    print(f"ok: {len(jobs)} job(s) of cluster {args[1]} visible")
    return 0


if __name__ == "__main__":
    sys.exit(main())

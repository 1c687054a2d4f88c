"""`python -m ray_slurm_provider.agent --spec '<json>'`: the last line of every job script."""

from __future__ import annotations

import argparse
import os
import sys

from ray_slurm_provider.agent.agent import Agent
from ray_slurm_provider.agent.head import HeadAgent
from ray_slurm_provider.agent.worker import WorkerAgent
from ray_slurm_provider.nodespec import NodeSpec


def agent_for(spec: NodeSpec, env: dict[str, str]) -> Agent:
    """The agent of the spec's role."""
    return (HeadAgent if spec.kind == "head" else WorkerAgent)(spec, env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ray_slurm_provider.agent")
    ap.add_argument("--spec", required=True, help="NodeSpec as JSON")
    args = ap.parse_args(argv)
    return agent_for(NodeSpec.from_json(args.spec), dict(os.environ)).main()


if __name__ == "__main__":
    sys.exit(main())

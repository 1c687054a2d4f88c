"""`ray-slurm validate CONFIG` and `ray-slurm render CONFIG`.

validate: the validation pipeline (provider/validation.py, the one `ray up` runs), against
the live cluster unless `--offline`, reported per node type (cli/findings.py).

render: every batch script the cluster would submit (the head's and one per worker type),
built by the same code as the provider (Ray's merge of the setup commands,
`bootstrap_config`, `fillout_resources`, `jobs.build_job`, `slurm.script.render`), each
followed by the commands its job runs in their order: the head's, which `ray up` hands in,
and a worker's start commands, which its node agent runs. Nothing is submitted.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Any

import click

from ray_slurm_provider import rayapi
from ray_slurm_provider.cli.common import (
    CliError,
    Cluster,
    Finding,
    config_command,
    load_cluster,
    report,
    run_command,
)
from ray_slurm_provider.cli.findings import accounting_findings, node_type_findings, shown
from ray_slurm_provider.cluster import ClusterConfig, parse_provider_section
from ray_slurm_provider.config import ConfigError
from ray_slurm_provider.jobs import build_job
from ray_slurm_provider.provider import defaults, validation
from ray_slurm_provider.provider.bootstrap import bootstrap_config, fillout_resources
from ray_slurm_provider.slurm.client import SlurmError
from ray_slurm_provider.slurm.sacct import Accounting
from ray_slurm_provider.slurm.script import ScriptError, render


def validate_findings(cluster: Cluster, live: bool = True) -> list[Finding]:
    """The validation pipeline's verdict (provider/validation.py, as `ray up` runs it), then
    (live) each node type against Slurm, with what passed."""
    info, unreachable = None, None
    if live:
        try:
            info = cluster.ask("asking Slurm for its partitions",
                               cluster.slurm_client.cluster_info)
        except SlurmError as e:
            unreachable = Finding("fail", f"Slurm ({cluster.pcfg.slurm_api})",
                                  f"cannot check against the cluster: {e}",
                                  "run `ray-slurm doctor CONFIG`, or --offline to skip")
    acct = Accounting(remote=cluster.remote)
    parsed, found = validation.run(cluster.config, info=info, env=os.environ,
                                   associations=(lambda: cluster.ask(
                                       "asking accounting for your associations",
                                       acct.associations)) if info else None)
    mine = [f for f in found if f.rule not in validation.LIVE_RULES]
    if parsed is None or any(f.level == "error" for f in mine):
        return [shown(f, "fix the key named above") for f in mine]
    types = parsed.node_types
    out = [Finding("ok", "config", f"cluster {cluster.name!r}: provider section and "
                   f"{len(types)} node types match the config model")]
    out += [Finding("info", "defaults", line)
            for line in defaults.describe(cluster.from_defaults, cluster.config)]
    speed = validation.gang_speed(cluster.config, parsed)
    if speed is not None:
        out.append(Finding("info", "upscaling_speed", speed[1].removeprefix("upscaling_speed: ")))
    out += [shown(f, "see the message") for f in mine]
    if unreachable is not None:
        return [*out, unreachable]
    if info is None:
        return out
    out.append(Finding("ok", f"Slurm ({cluster.pcfg.slurm_api})",
                       f"Slurm {info.version}, partitions: "
                       f"{', '.join(p.name for p in info.partitions)}"))
    for t in types:
        out += node_type_findings(parsed, t, info, [
            f for f in found if f.rule in ("partition", "limits")
            and f.key.startswith(f"available_node_types.{t}.")])
    return out + accounting_findings(parsed, found=[f for f in found
                                                    if f.rule == "accounting"])


def resolve(cluster: Cluster) -> tuple[dict[str, Any], ClusterConfig]:
    """The config as `ray up` resolves it (Ray's merge of the setup commands, the partition
    shapes, bootstrap_config) and the cluster as the head's autoscaler parses it then."""
    config: dict[str, Any] = copy.deepcopy(cluster.config)
    rayapi.merge_setup_commands(config)
    try:
        fillout_resources(config)
    except (SlurmError, ConfigError) as e:
        print(f"ray-slurm: node types without `resources` are rendered without them "
              f"(could not ask Slurm for partition sizes: {e})", file=sys.stderr)
    try:
        config = bootstrap_config(config)
    except click.ClickException as e:
        raise CliError(e.message) from e
    # As the head's autoscaler will see it: the provider section bootstrap wrote.
    parsed = parse_provider_section(config["provider"], cluster.name,
                                    str(config.get("head_node_type", "")))
    return config, parsed


def rendered_scripts(cluster: Cluster,
                     resolved: tuple[dict[str, Any], ClusterConfig] | None = None,
                     ) -> list[tuple[str, str, str]]:
    """(node type, kind, script) for the head type, then each worker type."""
    _, parsed = resolved or resolve(cluster)
    types = parsed.node_types
    order = [parsed.head_type, *sorted(t for t in types if t != parsed.head_type)]
    out = []
    for t in order:
        kind = parsed.kind(t)
        spec = build_job(parsed.provider, parsed.name, parsed.node_type(t), kind=kind,
                         python=parsed.provider.python or sys.executable)
        try:
            out.append((t, kind, render(spec)))
        except ScriptError as e:
            raise CliError(f"node type {t}: {e}") from e
    return out


def job_commands(config: dict[str, Any], parsed: ClusterConfig,
                 t: str) -> list[tuple[str, list[str]]]:
    """What a job of node type `t` runs, in the order it runs them: (which commands and who
    runs them, the commands). `config` and `parsed` as `resolve` returns them."""
    ncfg = parsed.node_type(t).node_config
    script = "in the batch script above"
    out = [(f"prologue, {script}", list(ncfg.prologue))]
    if parsed.kind(t) == "head":
        # Ray's updater runs these through the command runner (provider/runner.py).
        step = "handed in by `ray up`, each run as a step of this job"
        return [*out,
                (f"initialization_commands, {step}",
                 [str(c) for c in config.get("initialization_commands") or []]),
                (f"setup_commands + head_setup_commands, {step}",
                 [str(c) for c in config.get("head_setup_commands") or []]),
                ("head_start_ray_commands, handed in by `ray up`: `ray start` is run by the "
                 "node agent in the batch step (with this job's resources, address and ports "
                 "added), any other command as a step",
                 [str(c) for c in config.get("head_start_ray_commands") or []])]
    commands = parsed.node_type(t).commands
    if ncfg.nodes > 1:  # gang_step: on every node of the group, before its agent
        script = "in the batch script's srun line above, on every node of the group"
    return [*out,
            (f"initialization_commands, {script}", commands.initialization),
            (f"setup_commands + worker_setup_commands, {script}", commands.setup),
            ("worker_start_ray_commands, by the node agent: the commands before `ray start` "
             "in a shell, then `ray start` with this job's resources, address and ports "
             "added", commands.start)]


def commands_block(steps: list[tuple[str, list[str]]]) -> list[str]:
    """`job_commands` as comment lines."""
    out = ["# ----- run inside the job, in this order:"]
    for what, cmds in steps:
        out.append(f"#   {what}:")
        lines = [line for c in cmds for line in c.splitlines()] or ["(none)"]
        out += [f"#     {line}" for line in lines]
    return out


def cmd_validate(args: argparse.Namespace) -> int:
    return run_command(lambda: report(validate_findings(load_cluster(args.config, starts=True),
                                                        live=not args.offline)))


def cmd_render(args: argparse.Namespace) -> int:
    def body() -> int:
        cluster = load_cluster(args.config, starts=True)
        config, parsed = resolved = resolve(cluster)
        scripts = rendered_scripts(cluster, resolved)
        if args.node_type:
            scripts = [s for s in scripts if s[0] == args.node_type]
            if not scripts:
                raise CliError(f"no node type {args.node_type!r} in {args.config}")
        for line in defaults.describe(cluster.from_defaults, cluster.config):
            print(f"# from defaults: {line}")
        speed = validation.gang_speed(cluster.config, cluster.parsed)
        if speed is not None:
            print(f"# {speed[1]}")
        for i, (t, kind, script) in enumerate(scripts):
            if i:
                print()
            print(f"# ===== {kind} node type {t!r}: sbatch --parsable --job-name="
                  f"{cluster.job_name} --comment=<creation tags> <<'EOF'")
            print(script, end="")
            print("# ===== EOF")
            print("\n".join(commands_block(job_commands(config, parsed, t))))
        return 0

    return run_command(body)


def register(sub: Any) -> None:
    p = config_command(sub, "validate", "check a cluster config against the model and Slurm",
                       cmd_validate)
    p.add_argument("--offline", action="store_true", help="skip the checks that ask Slurm")
    p = config_command(sub, "render", "print every batch script the cluster would submit",
                       cmd_render)
    p.add_argument("--node-type", help="only this node type")

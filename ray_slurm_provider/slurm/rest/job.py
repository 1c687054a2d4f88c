"""A `JobSpec` -> the job description slurmrestd needs.

slurmrestd does not read `#SBATCH` lines: checked on the sandbox's 22.05, a script with
`#SBATCH --time=7 --output=...` ran UNLIMITED with the default output file. So each field of
the spec is set in the request, in the shape of the negotiated API version (fields.py), and
the script sent is exactly the one the CLI back end hands sbatch (script.render: the spec's
environment as `export` lines, its setup and its command). The user's own options
(`sbatch_options`, `extra_directives`, read as sbatch reads them by script.user_options) are
translated one by one (fields.translate); an option without a translation is an error naming
it, never dropped.

The job's environment is what the request carries and nothing else: slurmrestd has no
`--export=ALL` (a job submitted with an empty one is refused: "environment must be set"), so
the caller passes the environment explicitly (rest/client.py sends the submitting process's,
scrubbed as the CLI back end scrubs sbatch's).

Known gaps, each raised as an error or stated here:
* v0.0.38 (22.05) ignores `requeue: false` (the job shows Requeue=1 in the sandbox, also
  after an update). It refuses the `B:`/`R:` prefixes of --signal ("Invalid SIGNAL
  specification") and without the prefix the signal would reach the job's steps, not the
  batch step where the node agent runs, so `--signal=B:...` (the drain before the time
  limit) is left out: the node then ends at its time limit. Both are returned as notes, which
  rest/client.py logs once. v0.0.38 has no node list or exclude list fields and rejects
  `no_kill`.
* The v0.0.40+ field names come from Slurm's data_parser sources (v0.0.41 JOB_DESC_MSG) and
  recorded responses; they were not run against a live 23.11+ slurmrestd.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray_slurm_provider.slurm.rest import fields
from ray_slurm_provider.slurm.rest.fields import LEGACY, unsupported
from ray_slurm_provider.slurm.script import render, user_options
from ray_slurm_provider.slurm.spec import JobSpec

__all__ = ["job_description"]


def _typed(spec: JobSpec, legacy: bool, notes: list[str]) -> dict[str, Any]:
    """The fields of the spec's typed options, in the order script.render writes them, so the
    error for a spec that cannot be sent names its first such option."""
    desc: dict[str, Any] = {"name": spec.job_name}
    for key, value in (("partition", spec.partition), ("account", spec.account),
                       ("qos", spec.qos)):
        if value is not None:
            desc[key] = value
    if spec.time is not None:
        desc.update(fields.time_limit(spec.time, legacy))
    desc.update({"nodes": [spec.nodes, spec.nodes]} if legacy else
                {"minimum_nodes": spec.nodes, "maximum_nodes": spec.nodes})
    desc["tasks"] = spec.ntasks
    if spec.cpus_per_task is not None:
        desc["cpus_per_task"] = spec.cpus_per_task
    if spec.mem is not None:
        desc["memory_per_node"] = fields.memory("mem", spec.mem, legacy)
    if spec.gres is not None:
        if legacy:
            desc["gres"] = spec.gres
        else:
            for item in fields.gres_items(spec.gres):
                fields.add_tres(desc, "tres_per_node", item)
    if spec.gpus_per_node is not None:
        if legacy:
            desc["gpus_per_node"] = spec.gpus_per_node
        else:
            fields.add_tres(desc, "tres_per_node", f"gres/gpu:{spec.gpus_per_node}")
    if spec.constraint is not None:
        desc["constraints"] = spec.constraint
    if spec.exclusive:
        desc.update({"exclusive": "exclusive"} if legacy else {"shared": ["none"]})
    if spec.reservation is not None:
        desc["reservation"] = spec.reservation
    for key, value, field in (("nodelist", spec.nodelist, "required_nodes"),
                              ("exclude", spec.exclude, "excluded_nodes")):
        if value is not None:
            if legacy:
                raise unsupported(f"--{key}", f"slurmrestd {LEGACY} has no field for it")
            desc[field] = value
    if spec.signal is not None:
        desc.update(fields.signal(spec.signal, legacy))
        if legacy and ":" in spec.signal:  # a valid signal has ':' only after R:/B:
            notes.append(f"slurmrestd {LEGACY} cannot send --signal={spec.signal} to the batch "
                         "step; left out, so nodes are not drained before their time limit "
                         "(set drain_before_limit_s: 0 to silence this)")
    for key, value in (("standard_output", spec.output), ("standard_error", spec.error)):
        if value is not None:
            desc[key] = value
    if spec.open_mode is not None:
        desc["open_mode"] = spec.open_mode if legacy else [spec.open_mode.upper()]
    if spec.requeue is not None:
        desc["requeue"] = spec.requeue
        if legacy and not spec.requeue:
            notes.append(f"slurmrestd {LEGACY} (Slurm 22.05) ignores requeue=false: Slurm may "
                         "requeue these jobs")
    return desc


def job_description(spec: JobSpec, *, api_version: str, environment: Mapping[str, str],
                    cwd: str, comment: str = "",
                    notes: list[str] | None = None) -> dict[str, Any]:
    """The request body of POST /slurm/<api_version>/job/submit for `spec`; what the API
    version cannot carry and was left out is appended to `notes`. An invalid spec raises
    ScriptError, as it does on the CLI back end."""
    legacy = api_version == LEGACY
    script = render(spec)  # validates every field before any is translated
    desc: dict[str, Any] = {"current_working_directory": cwd}
    desc.update(_typed(spec, legacy, [] if notes is None else notes))
    for key, value in user_options(spec):
        fields.translate(desc, key, value, legacy)
    if comment:
        desc["comment"] = comment
    env = {k: v for k, v in environment.items() if "=" not in k}
    desc["environment"] = dict(env) if legacy else [f"{k}={v}" for k, v in sorted(env.items())]
    if legacy or api_version == "v0.0.40":
        return {"script": script, "job": desc}
    desc["script"] = script  # 24.05+: the top-level script is deprecated
    return {"job": desc}


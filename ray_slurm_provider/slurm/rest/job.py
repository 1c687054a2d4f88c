"""A rendered batch script -> the job description slurmrestd needs.

slurmrestd does not read `#SBATCH` lines: checked on the sandbox's 22.05, a script with
`#SBATCH --time=7 --output=...` ran UNLIMITED with the default output file. So the directives
are read here with sbatch's rules (the same scan script.py documents: after the shebang,
blank lines and `#` comments are skipped, `#SBATCH` lines are split into words, the first other
line ends the block) and each option is translated into its field of the negotiated API
version. An option without a translation is an error naming it, never dropped.

The job's environment is what the request carries and nothing else: slurmrestd has no
`--export=ALL` (a job submitted with an empty one is refused: "environment must be set"), so
the caller passes the environment explicitly (rest.py sends the submitting process's, scrubbed
as the CLI back end scrubs sbatch's).

Known gaps, each raised as an error or stated here:
* v0.0.38 (22.05) ignores `requeue: false` (the job shows Requeue=1 in the sandbox, also
  after an update). It refuses the `B:`/`R:` prefixes of --signal ("Invalid SIGNAL
  specification") and without the prefix the signal would reach the job's steps, not the
  batch step where the node agent runs, so `--signal=B:...` (the drain before the time
  limit) is left out: the node then ends at its time limit. Both are returned as notes, which
  rest.py logs once. v0.0.38 has no node list or exclude list fields and rejects `no_kill`.
* The v0.0.40+ field names come from Slurm's data_parser sources (v0.0.41 JOB_DESC_MSG) and
  recorded responses; they were not run against a live 23.11+ slurmrestd.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Callable, Mapping
from typing import Any

from ray_slurm_provider.slurm.client import PermanentSlurmError
from ray_slurm_provider.units import mem_mb, parse_duration

LEGACY = "v0.0.38"
_SHORT = {"A": "account", "C": "constraint", "D": "chdir", "G": "gpus", "H": "hold",
          "J": "job-name", "L": "licenses", "N": "nodes", "c": "cpus-per-task", "d": "dependency",
          "e": "error", "i": "input", "n": "ntasks", "o": "output", "p": "partition",
          "q": "qos", "t": "time", "w": "nodelist", "x": "exclude"}
_FLAGS = frozenset({"exclusive", "hold", "requeue", "no-requeue", "H"})
_SIGNAL = re.compile(r"^(?:(R|B|RB|BR):)?([A-Za-z0-9]+)(?:@(\d+))?$")


def directives(script: str) -> list[tuple[str, str | None]]:
    """The `#SBATCH` options of `script` as (long option, value or None), in order."""
    words: list[str] = []
    for line in script.split("\n")[1:]:
        stripped = line.strip()
        if line.startswith("#SBATCH"):
            words += shlex.split(line[len("#SBATCH"):], comments=True)
        elif stripped and not stripped.startswith("#"):
            break
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(words):
        w = words[i]
        if w.startswith("--"):
            key, eq, val = w[2:].partition("=")
            value: str | None = val if eq else None
        elif w.startswith("-") and len(w) >= 2 and w[1] in _SHORT:
            key, value = _SHORT[w[1]], (w[2:] or None)
        else:
            raise _unsupported(w, "not an sbatch option")
        if value is None and key not in _FLAGS and i + 1 < len(words):
            i, value = i + 1, words[i + 1]
        out.append((key, value))
        i += 1
    return out


def _unsupported(option: str, why: str) -> PermanentSlurmError:
    return PermanentSlurmError(
        f"#SBATCH {option}: {why}; slurmrestd does not read #SBATCH lines, so the REST transport "
        "translates each option and this one has no translation. Drop it from the node config "
        "or use provider.slurm_api: cli", command="slurmrestd")


def _num(value: int | None, legacy: bool, infinite: bool = False) -> Any:
    if legacy:
        return value
    return {"set": value is not None or infinite, "infinite": infinite, "number": value or 0}


def _need(key: str, value: str | None) -> str:
    if value is None or value == "":
        raise _unsupported(f"--{key}", "needs a value")
    return value


def _minutes(value: str) -> int | None:
    try:
        s = parse_duration(value)
    except ValueError:
        raise _unsupported(f"--time={value}", "not a Slurm time") from None
    return None if s is None else math.ceil(s / 60)


def _mem_mb(key: str, value: str) -> int:
    try:
        return mem_mb(value)
    except ValueError:
        raise _unsupported(f"--{key}={value}", "not a memory size") from None


def _tres(desc: dict[str, Any], field: str, item: str) -> None:
    desc[field] = f"{desc[field]},{item}" if desc.get(field) else item


def _gres_items(value: str) -> list[str]:
    return [i if i.startswith("gres/") else f"gres/{i}" for i in value.split(",") if i]


def _nodes(value: str, legacy: bool) -> dict[str, Any]:
    lo, _, hi = value.partition("-")
    if not lo.isdigit() or (hi and not hi.isdigit()):
        raise _unsupported(f"--nodes={value}", "only N or MIN-MAX node counts are translated")
    n_min, n_max = int(lo), int(hi or lo)
    return {"nodes": [n_min, n_max]} if legacy else {"minimum_nodes": n_min,
                                                      "maximum_nodes": n_max}


def _signal(value: str, legacy: bool) -> dict[str, Any]:
    m = _SIGNAL.match(value)
    if not m:
        raise _unsupported(f"--signal={value}", "not a signal specification")
    where, sig, delay = m.groups()
    if legacy:
        if where:
            return {}  # job_description notes it
        return {"signal": f"{sig}@{delay}" if delay else sig}
    out: dict[str, Any] = {"kill_warning_signal": sig,
                           "kill_warning_delay": _num(int(delay or 60), False)}
    if where and "B" in where:
        out["kill_warning_flags"] = ["BATCH_JOB"]
    return out


# option -> (legacy, value) -> fields; strings map one option onto one field verbatim.
_Handler = Callable[[str, str | None, bool], dict[str, Any]]
_VERBATIM: dict[str, str] = {
    "job-name": "name", "partition": "partition", "account": "account", "qos": "qos",
    "reservation": "reservation", "comment": "comment", "wckey": "wckey",
    "mail-user": "mail_user", "constraint": "constraints", "dependency": "dependency",
    "chdir": "current_working_directory", "output": "standard_output",
    "error": "standard_error", "input": "standard_input", "licenses": "licenses",
}
_INTS: dict[str, str] = {"ntasks": "tasks", "cpus-per-task": "cpus_per_task",
                         "ntasks-per-node": "tasks_per_node"}


def _handlers() -> dict[str, _Handler]:
    h: dict[str, _Handler] = {}
    h["time"] = lambda k, v, legacy: _time(_need(k, v), legacy)
    h["nodes"] = lambda k, v, legacy: _nodes(_need(k, v), legacy)
    h["mem"] = lambda k, v, legacy: {"memory_per_node": _num(_mem_mb(k, _need(k, v)), legacy)}
    h["mem-per-cpu"] = lambda k, v, legacy: {
        "memory_per_cpu": _num(_mem_mb(k, _need(k, v)), legacy)}
    h["signal"] = lambda k, v, legacy: _signal(_need(k, v), legacy)
    h["hold"] = lambda k, v, legacy: {"hold": True}
    h["requeue"] = lambda k, v, legacy: {"requeue": True}
    h["no-requeue"] = lambda k, v, legacy: {"requeue": False}
    h["exclusive"] = lambda k, v, legacy: (
        {"exclusive": v or "exclusive"} if legacy else
        {"shared": ["none" if v in (None, "exclusive") else v]})
    h["open-mode"] = lambda k, v, legacy: {
        "open_mode": _need(k, v) if legacy else [_need(k, v).upper()]}
    h["mail-type"] = lambda k, v, legacy: {
        "mail_type": _need(k, v) if legacy else [t.upper() for t in _need(k, v).split(",")]}
    return h


_HANDLERS = _handlers()


def _time(value: str, legacy: bool) -> dict[str, Any]:
    minutes = _minutes(value)
    if minutes is None:
        if legacy:
            raise _unsupported(f"--time={value}", f"slurmrestd {LEGACY} cannot say UNLIMITED "
                               "(leave `time` unset to get the partition's limit)")
        return {"time_limit": _num(None, False, infinite=True)}
    return {"time_limit": _num(minutes, legacy)}


def job_description(script: str, *, api_version: str, environment: Mapping[str, str],
                    cwd: str, job_name: str = "", comment: str = "",
                    notes: list[str] | None = None) -> dict[str, Any]:
    """The request body of POST /slurm/<api_version>/job/submit for `script`; what the API
    version cannot carry and was left out is appended to `notes`."""
    legacy = api_version == LEGACY
    desc: dict[str, Any] = {"current_working_directory": cwd}
    for key, value in directives(script):
        if legacy and key == "signal" and value and re.match(r"^(R|B|RB|BR):", value):
            _signal(value, legacy)  # still refuses a malformed one
            if notes is not None:
                notes.append(f"slurmrestd {LEGACY} cannot send --signal={value} to the batch "
                             "step; left out, so nodes are not drained before their time limit "
                             "(set drain_before_limit_s: 0 to silence this)")
            continue
        if legacy and key == "no-requeue" and notes is not None:
            notes.append(f"slurmrestd {LEGACY} (Slurm 22.05) ignores requeue=false: Slurm may "
                         "requeue these jobs")
        if key in _VERBATIM:
            desc[_VERBATIM[key]] = _need(key, value)
        elif key in _INTS:
            v = _need(key, value)
            if not v.isdigit():
                raise _unsupported(f"--{key}={v}", "not a whole number")
            desc[_INTS[key]] = int(v)
        elif key in ("gres", "gpus-per-node", "gpus"):
            v = _need(key, value)
            if legacy:
                desc[key.replace("-", "_")] = v
            elif key == "gres":
                for item in _gres_items(v):
                    _tres(desc, "tres_per_node", item)
            else:
                _tres(desc, "tres_per_node" if key == "gpus-per-node" else "tres_per_job",
                      f"gres/gpu:{v}")
        elif key in ("nodelist", "exclude"):
            if legacy:
                raise _unsupported(f"--{key}", f"slurmrestd {LEGACY} has no field for it")
            desc["required_nodes" if key == "nodelist" else "excluded_nodes"] = _need(key, value)
        elif key in _HANDLERS:
            desc.update(_HANDLERS[key](key, value, legacy))
        else:
            raise _unsupported(f"--{key}", "no translation")
    if job_name:
        desc["name"] = job_name
    if comment:
        desc["comment"] = comment
    env = {k: v for k, v in environment.items() if "=" not in k}
    desc["environment"] = dict(env) if legacy else [f"{k}={v}" for k, v in sorted(env.items())]
    if legacy or api_version == "v0.0.40":
        return {"script": script, "job": desc}
    desc["script"] = script  # 24.05+: the top-level script is deprecated
    return {"job": desc}

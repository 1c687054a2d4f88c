"""Reading the shell commands Ray hands to a command runner.

Ray's NodeUpdater sends start commands as one shell string, e.g.
`export RAY_CLOUD_INSTANCE_ID=42; export RAY_NODE_TYPE_NAME=head; ray start --head ...`.
On Slurm, `ray start` must not run in a job step (it would be orphaned or killed with the
step) and `ray stop` must not run at all (it kills every Ray process of the user on the node,
including other clusters'). This module splits such a string at its top-level `;`, `&&` and
`||` (quotes respected) and classifies each part, so the runner can hand `ray start` to the
node agent in the batch step, turn `ray stop` into "stop this job's Ray", and run the rest.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

_EXPORT = re.compile(r"^export\s+([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)


def split_top_level(cmd: str) -> list[str]:
    """Split at `;`, `&&`, `||` and newlines outside quotes; keep each part's raw text."""
    parts: list[str] = []
    buf: list[str] = []
    quote = ""
    i = 0
    while i < len(cmd):
        c = cmd[i]
        if quote:
            buf.append(c)
            if c == "\\" and quote == '"' and i + 1 < len(cmd):
                buf.append(cmd[i + 1])
                i += 1
            elif c == quote:
                quote = ""
        elif c == "\\" and i + 1 < len(cmd):
            buf.append(c + cmd[i + 1])
            i += 1
        elif c in "'\"":
            quote = c
            buf.append(c)
        elif c in ";\n" or cmd.startswith("&&", i) or cmd.startswith("||", i):
            parts.append("".join(buf))
            buf = []
            if c in "&|":
                i += 1
        else:
            buf.append(c)
        i += 1
    parts.append("".join(buf))
    return [p.strip() for p in parts if p.strip()]


def _words(segment: str) -> list[str]:
    try:
        return shlex.split(segment)
    except ValueError:
        return []


def is_ray(words: list[str], sub: str) -> bool:
    return len(words) >= 2 and words[0].rsplit("/", 1)[-1] == "ray" and words[1] == sub


@dataclass
class Program:
    """A parsed command string."""

    exports: dict[str, str] = field(default_factory=dict)  # raw, still to be expanded
    before: list[str] = field(default_factory=list)  # shell parts before `ray start`
    ray_start: list[str] | None = None  # argv of `ray start ...`
    ray_stop: bool = False
    shutdown: bool = False  # `sudo shutdown ...` from `ray exec --stop`
    rest: list[str] = field(default_factory=list)  # shell parts after, or all when no start


def parse(cmd: str) -> Program:
    return parse_commands([cmd])


def parse_commands(cmds: list[str]) -> Program:
    """`parse("; ".join(cmds))` without the join: each command is split on its own, as Ray
    runs each on its own (a quote left open in one cannot swallow the next)."""
    prog = Program()
    for seg in (s for c in cmds for s in split_top_level(c)):
        m = _EXPORT.match(seg)
        words = _words(seg)
        if m and len(words) == 2:
            prog.exports[m.group(1)] = words[1].split("=", 1)[1]
        elif is_ray(words, "start"):
            prog.ray_start = words
        elif is_ray(words, "stop"):
            prog.ray_stop = True
        elif (words[:1] == ["sudo"] and "shutdown" in words[1:2]) or words[:1] == ["shutdown"]:
            prog.shutdown = True
        elif prog.ray_start is None:
            prog.before.append(seg)
        else:
            prog.rest.append(seg)
    if prog.ray_start is None:
        prog.rest = prog.before + prog.rest
        prog.before = []
    return prog


def has_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def get_flag(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
    return None


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """Replace (or add) `flag` with `value`."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == flag and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            skip = True
            continue
        if a.startswith(flag + "="):
            continue
        out.append(a)
    return [*out, f"{flag}={value}"]

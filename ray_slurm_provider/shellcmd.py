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

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_EXPORT = re.compile(r"^export\s+([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.DOTALL)


def _spans(cmd: str) -> list[tuple[int, int]]:
    """(start, end) of each part between top-level `;`, `&&`, `||` and newlines."""
    spans: list[tuple[int, int]] = []
    start, quote, i = 0, "", 0
    while i < len(cmd):
        c = cmd[i]
        if quote:
            if c == "\\" and quote == '"' and i + 1 < len(cmd):
                i += 1
            elif c == quote:
                quote = ""
        elif c == "\\" and i + 1 < len(cmd):
            i += 1
        elif c in "'\"":
            quote = c
        elif c in ";\n" or cmd.startswith("&&", i) or cmd.startswith("||", i):
            spans.append((start, i))
            if c in "&|":
                i += 1
            start = i + 1
        i += 1
    spans.append((start, len(cmd)))
    return [(a, b) for a, b in spans if cmd[a:b].strip()]


def split_top_level(cmd: str) -> list[str]:
    """Split at `;`, `&&`, `||` and newlines outside quotes; keep each part's raw text."""
    return [cmd[a:b].strip() for a, b in _spans(cmd)]


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
    before: list[str] = field(default_factory=list)  # earlier commands, each its own shell
    #: What precedes `ray start` in its own command (`ulimit -n 65536; cd /x &&`), raw: it
    #: must run in the shell that becomes Ray, or it has no effect on Ray.
    prefix: str = ""
    ray_start: list[str] | None = None  # argv of `ray start ...`
    ray_stop: bool = False
    shutdown: bool = False  # `sudo shutdown ...` from `ray exec --stop`
    rest: list[str] = field(default_factory=list)  # shell parts after, or all when no start


def parse(cmd: str) -> Program:
    return parse_commands([cmd])


def parse_commands(cmds: list[str]) -> Program:
    """The program of a command list, each command split on its own as Ray runs each on its
    own (a quote left open in one cannot swallow the next). Plain shell that precedes
    `ray start` in its own command is kept raw in `prefix`, to run in Ray's own shell."""
    prog = Program()
    for c in cmds:
        spans = _spans(c)
        first = next((a for a, b in spans if is_ray(_words(c[a:b]), "start")), None)
        pieces: list[str] = []  # the prefix: each part with the operator that follows it
        plain = False
        for i, (a, b) in enumerate(spans):
            seg = c[a:b].strip()
            is_shell = _classify(prog, seg)
            if first is not None and a < first:
                # `ray stop` and shutdowns never run bare, not even here (scoped instead).
                if is_shell or is_export(seg):
                    pieces.append(c[a:spans[i + 1][0]])
                plain = plain or is_shell
            elif not is_shell:
                continue
            elif prog.ray_start is None:
                prog.before.append(seg)
            else:
                prog.rest.append(seg)
        if plain:
            prog.prefix = "".join(pieces).strip()
    if prog.ray_start is None:
        prog.rest = prog.before + prog.rest
        prog.before = []
    return prog


def is_export(seg: str) -> bool:
    """`export NAME=value` (one word after `export`)."""
    return bool(_EXPORT.match(seg)) and len(_words(seg)) == 2


def _classify(prog: Program, seg: str) -> bool:
    """Record an export, `ray start`/`stop` or a shutdown in `prog`; True for plain shell."""
    words = _words(seg)
    if is_export(seg):
        prog.exports[seg.split("=", 1)[0].split()[-1]] = words[1].split("=", 1)[1]
    elif is_ray(words, "start"):
        prog.ray_start = words
    elif is_ray(words, "stop"):
        prog.ray_stop = True
    elif (words[:1] == ["sudo"] and "shutdown" in words[1:2]) or words[:1] == ["shutdown"]:
        prog.shutdown = True
    else:
        return True
    return False


def in_shell(prefix: str, argv: list[str]) -> list[str]:
    """`argv` run by the shell that first runs `prefix` (`ulimit -n 65536; cd /x &&`), so
    what the prefix sets reaches the process; `exec` keeps it the caller's own child."""
    if not prefix:
        return argv
    return ["bash", "-c", f'{prefix}\nexec "$@"', "ray-slurm-start", *argv]


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


def env_exports(env: Mapping[str, Any] | None) -> str:
    """`export K=V;` for each variable, values quoted (as Ray's runners do); non-strings as
    compact JSON."""
    out = []
    for k, v in (env or {}).items():
        val = v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
        out.append(f"export {k}={shlex.quote(val)};")
    return " ".join(out) + (" " if out else "")

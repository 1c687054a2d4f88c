"""Multi-tenant safety, read from the package source: nothing runs a bare `ray stop`, kills
processes by name, or runs a command other than through `proc` (argv, timeout, no shell).

On a shared node a bare `ray stop` kills every Ray of the user (other clusters included), and
`pkill`/`killall` hit other users' and other clusters' processes. The e2e test
`test_second_cluster_runs_beside_the_first` (test_ray_up.py) shows the effect on the sandbox:
`ray down` of one cluster leaves the other running.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import ray_slurm_provider

PKG = Path(ray_slurm_provider.__file__).parent
SOURCES = sorted(PKG.rglob("*.py"))
BY_NAME = {"pkill", "killall", "pgrep", "skill", "snice", "kill"}
#: Where a signal may be sent by pid: the sandbox's own daemons, from its pid registry.
#: proc.py: `kill_tree`, the node agent's own `ray start` and the processes below it.
OS_KILL_ALLOWED = {"sandbox/procs.py", "proc.py"}
#: The only module that may start processes.
SUBPROCESS_ALLOWED = {"proc.py"}


def _words(node: ast.AST) -> list[str] | None:
    """The string words of a list/tuple literal (None if it has a non-string part)."""
    if not isinstance(node, ast.List | ast.Tuple):
        return None
    out = []
    for elt in node.elts:
        if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
            out.append(elt.value)
        elif isinstance(elt, ast.Starred):
            continue  # e.g. [*self.cli(ctx), "stop", ...]: judged by its literal words
        else:
            out.append("\0")
    return out


def _rel(path: Path) -> str:
    return path.relative_to(PKG).as_posix()


def test_sources_found() -> None:
    assert len(SOURCES) > 30 and any(p.name == "runner.py" for p in SOURCES)


def test_no_bare_ray_stop_and_no_kill_by_name() -> None:
    bad = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            words = _words(node)
            if words:
                base = words[0].rsplit("/", 1)[-1]
                if base in BY_NAME:
                    bad.append(f"{_rel(path)}:{node.lineno}: runs {words[0]}")
                if any(a.rsplit("/", 1)[-1] == "ray" and b == "stop"
                       for a, b in itertools.pairwise(words)):
                    bad.append(f"{_rel(path)}:{node.lineno}: runs `ray stop`")
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value.strip()
                if text.startswith(("ray stop", "pkill ", "killall ")) or "; ray stop" in text:
                    bad.append(f"{_rel(path)}:{node.lineno}: shell text {text[:40]!r}")
    assert bad == []


def test_commands_only_through_proc() -> None:
    bad = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names]
                mod = node.module if isinstance(node, ast.ImportFrom) else None
                if ("subprocess" in names or mod == "subprocess") \
                        and _rel(path) not in SUBPROCESS_ALLOWED:
                    bad.append(f"{_rel(path)}:{node.lineno}: imports subprocess")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "os":
                if node.attr in ("system", "popen", "execv", "execvp", "spawnv"):
                    bad.append(f"{_rel(path)}:{node.lineno}: os.{node.attr}")
                if node.attr in ("kill", "killpg") and _rel(path) not in OS_KILL_ALLOWED:
                    bad.append(f"{_rel(path)}:{node.lineno}: os.{node.attr}")
            if isinstance(node, ast.keyword) and node.arg == "shell" \
                    and not (isinstance(node.value, ast.Constant) and node.value.value is False):
                bad.append(f"{_rel(path)}:{node.value.lineno}: shell=")
    assert bad == []


def test_ray_stop_from_ray_is_scoped_to_one_job() -> None:
    """`ray stop` in a command Ray runs (ray down, ray exec --stop) becomes "stop this job's
    Ray" in the runner, never the real command."""
    from ray_slurm_provider import shellcmd

    prog = shellcmd.parse("ray stop; echo done")
    assert prog.ray_stop and prog.rest == ["echo done"]
    # The YAML's usual head start commands (`ray stop` first) and what `ray down` sends.
    prog = shellcmd.parse("ray stop; ray start --head --autoscaling-config=~/x.yaml")
    assert prog.ray_stop and prog.ray_start is not None and prog.rest == []
    prog = shellcmd.parse("/opt/venv/bin/ray stop --force")
    assert prog.ray_stop and prog.rest == []

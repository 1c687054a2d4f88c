"""The house rules of the package's layout (issue 12), read from the source with `ast`.

Nothing of the package is imported: the rules hold for the files as they are written.

1. No module over MAX_LINES lines. Modules are split by responsibility, never to meet a count;
   a module of one responsibility may run to 500 lines (issue 25, item 9: the 300-line budget
   is withdrawn). The limit only catches a module that has grown several jobs.
2. At most MAX_TOP_MODULES modules at the top of the package (`ray_slurm_provider/*.py` but
   `__init__.py`; packages do not count).
3. No import cycle between the package's modules.
4. No import upward between the rooms of ROOMS (lowest first), nor from an unknown module.
5. docs/layout.md (its "Layout" section) names only paths that exist, and every package; the
   README's "Layout" section points there.

One exception to 3 and 4: the package's `__init__` re-exports the Python API lazily, in its
`__getattr__` (LAZY_EXPORTS): imported only when asked for, so `import ray_slurm_provider`
loads nothing above the ground (tests/unit/test_api.py checks that by importing).

What counts as an import (rules 3 and 4): every `import`/`from ... import` of the package
anywhere in a module (top level, inside functions, under `if TYPE_CHECKING:`), relative ones
resolved; `from pkg import name` imports the submodule `pkg.name` where there is one, else
`pkg`; importing `a.b.c` is not counted as importing the packages `a` and `a.b` (the usual
re-export from a package's `__init__` would be a cycle otherwise). In a module that calls
`importlib.import_module`, every string that is exactly a module's dotted name counts too
(`cli/main.py`'s table of command modules); elsewhere such a string is a command line for
another process (`python -m ray_slurm_provider.agent`), not an import.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = "ray_slurm_provider"
PKG_DIR = ROOT / PKG
README = ROOT / "README.md"
LAYOUT = ROOT / "docs" / "layout.md"
MAX_LINES = 500
MAX_TOP_MODULES = 14
#: What the package's `__init__` may import inside its `__getattr__` (and nowhere else).
LAZY_EXPORTS = frozenset({f"{PKG}.cli.api"})


@dataclass(frozen=True)
class Room:
    what: str
    #: The rooms whose modules this room's modules may import (besides their own room's).
    may_import: frozenset[str]
    #: Single modules it may import beyond those rooms.
    also: frozenset[str] = frozenset()


BELOW_WINGS = frozenset({"ground", "slurm", "runtimes", "jobs"})
#: Lowest first. A module's room is found by its first name below the package (TOP_ROOM).
ROOMS: dict[str, Room] = {
    "ground": Room("the shared ground (and the package's __init__)", frozenset()),
    "slurm": Room("the Slurm seam, slurm/", frozenset({"ground"})),
    "runtimes": Room("the container runtimes, runtimes/", frozenset({"ground"})),
    "jobs": Room("jobs.py", frozenset({"ground", "slurm", "runtimes"})),
    "provider": Room("the head's autoscaler side, provider/", BELOW_WINGS),
    "agent": Room("the node agent in every job, agent/", BELOW_WINGS),
    "cli": Room("the `ray-slurm` command, cli/ (registers `ray-slurm sandbox`)",
                BELOW_WINGS | {"provider", "agent", "sandbox"}),
    # Apart: tools beside the provider.
    "gang": Room("the torch.distributed gang launcher, gang/ (apart)", frozenset({"ground"})),
    "sandbox": Room("the local real Slurm, sandbox/ (apart)", frozenset(),
                    frozenset({f"{PKG}.proc"})),
    "node": Room("node.py, the old entry point's shim", frozenset({"agent"})),
}
GROUND = ("proc", "units", "schema", "ports", "auth", "state", "shellcmd", "nodespec",
          "config", "cluster", "rayapi", "retry")
TOP_ROOM: dict[str, str] = {
    **{name: "ground" for name in GROUND},
    "slurm": "slurm", "runtimes": "runtimes", "jobs": "jobs",
    "provider": "provider", "agent": "agent", "cli": "cli", "gang": "gang",
    "sandbox": "sandbox", "node": "node",
}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@cache
def modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is its __init__.py)."""
    out = {}
    for path in sorted(PKG_DIR.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _ours(name: str) -> bool:
    return name == PKG or name.startswith(PKG + ".")


def _known(name: str, mods: Mapping[str, Path]) -> str:
    """`name`, or the longest prefix of it that is a module."""
    while name not in mods and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


_DYNAMIC = ("import_module", "__import__")


def _imports_by_name(tree: ast.AST) -> bool:
    """Whether the module calls `importlib.import_module` (or `__import__`)."""
    return any((isinstance(n, ast.Attribute) and n.attr in _DYNAMIC)
               or (isinstance(n, ast.Name) and n.id in _DYNAMIC) for n in ast.walk(tree))


def imports_of(name: str, source: str, is_package: bool,
               mods: Mapping[str, Path]) -> list[Import]:
    """The imports of the package's modules that module `name` makes (see the docstring)."""
    tree = ast.parse(source)
    here = name.split(".") if is_package else name.split(".")[:-1]
    out: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [Import(name, _known(a.name, mods), node.lineno)
                    for a in node.names if _ours(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            if not _ours(mod):
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append(Import(name, sub if sub in mods else _known(mod, mods),
                                  node.lineno))
    if _imports_by_name(tree):
        out += [Import(name, node.value, node.lineno) for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and isinstance(node.value, str)
                and node.value in mods]
    return [i for i in out if i.target != name]


@cache
def all_imports() -> tuple[Import, ...]:
    mods = modules()
    out: list[Import] = []
    for name, path in mods.items():
        out += imports_of(name, path.read_text(), path.name == "__init__.py", mods)
    return tuple(sorted(set(out), key=lambda i: (i.importer, i.line, i.target)))


def lazy_exports() -> set[Import]:
    """The imports inside the package `__init__`'s `__getattr__` of LAZY_EXPORTS' modules."""
    tree = ast.parse((PKG_DIR / "__init__.py").read_text())
    lines = {n.lineno for f in ast.walk(tree)
             if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return {i for i in all_imports()
            if i.importer == PKG and i.line in lines and i.target in LAZY_EXPORTS}


def checked_imports() -> tuple[Import, ...]:
    """The imports rules 3 and 4 hold for: all but the lazy re-exports."""
    lazy = lazy_exports()
    return tuple(i for i in all_imports() if i not in lazy)


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return "ground" if len(parts) == 1 else TOP_ROOM.get(parts[1])


def where(i: Import) -> str:
    path = modules().get(i.importer)
    return f"{rel(path) if path else i.importer}:{i.line} imports {i.target}"


# --- 1, 2: sizes ------------------------------------------------------------------------------

def test_no_module_over_the_line_limit() -> None:
    over = {rel(p): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not over, (
        f"modules over {MAX_LINES} lines (split them by responsibility): "
        + ", ".join(f"{p} ({n})" for p, n in sorted(over.items(), key=lambda x: -x[1])))


def test_few_modules_at_the_top_of_the_package() -> None:
    top = sorted(p.name for p in PKG_DIR.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_MODULES, (
        f"{len(top)} modules at the top of {PKG}/ (at most {MAX_TOP_MODULES}; move the ones "
        f"that serve one room into it): {', '.join(top)}")


# --- 3: cycles --------------------------------------------------------------------------------

def _cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _graph(imports: Iterable[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for i in imports:
        edges.setdefault(i.importer, set()).add(i.target)
    return edges


def test_no_import_cycles() -> None:
    imports = checked_imports()
    problems = []
    for comp in _cycles(_graph(imports)):
        inside = set(comp)
        lines = [f"    {where(i)}" for i in imports
                 if i.importer in inside and i.target in inside]
        problems.append(f"  cycle between {', '.join(comp)}:\n" + "\n".join(lines))
    assert not problems, (
        "import cycles (hand over what one side needs as an argument or a small Protocol, "
        "or move the shared part down):\n" + "\n".join(problems))


# --- 4: layers --------------------------------------------------------------------------------

def test_no_unknown_top_level_modules() -> None:
    unknown = sorted({rel(p) for m, p in modules().items() if room_of(m) is None})
    assert not unknown, (
        f"modules in no room of tests/unit/test_architecture.py: {', '.join(unknown)} "
        f"(give them a room in TOP_ROOM, and a line in docs/layout.md)")


def layer_problems(imports: Iterable[Import]) -> list[str]:
    problems = []
    for i in imports:
        mine, theirs = room_of(i.importer), room_of(i.target)
        if mine is None or theirs is None:
            problems.append(f"  {where(i)}: {i.importer if mine is None else i.target} is in "
                            "no room (see TOP_ROOM)")
            continue
        room = ROOMS[mine]
        if theirs == mine or theirs in room.may_import or i.target in room.also:
            continue
        allowed = sorted(room.may_import) + sorted(room.also)
        problems.append(f"  {where(i)} ({theirs}): {mine} is {room.what} and may import "
                        f"only {', '.join(allowed) or 'nothing of the package'}")
    return problems


def test_no_upward_imports() -> None:
    problems = layer_problems(checked_imports())
    assert not problems, "imports against the layers (lowest first: " + " < ".join(
        ROOMS) + "):\n" + "\n".join(problems)


def test_the_layer_rule_catches_what_it_should() -> None:
    def bad(importer: str, target: str) -> bool:
        return bool(layer_problems([Import(f"{PKG}.{importer}", f"{PKG}.{target}", 1)]))

    assert not any(bad(a, b) for a, b in [
        ("slurm.cli", "proc"), ("slurm.rest.job", "slurm.script"), ("jobs", "slurm.script"),
        ("provider.walltime", "jobs"), ("provider.submit", "jobs"),
        ("agent.agent", "runtimes.base"),
        ("cli.main", "sandbox.cli"), ("cli.status", "provider.validation"), ("gang.gang", "config"),
        ("sandbox.core", "proc"), ("node", "agent.__main__"), ("config", "schema")])
    assert all(bad(a, b) for a, b in [
        ("config", "jobs"), ("proc", "slurm.cli"), ("slurm.cli", "runtimes.base"),
        ("runtimes.base", "slurm.client"), ("jobs", "provider.submit"),
        ("agent.agent", "provider.runner"), ("provider.runner", "agent.raystart"),
        ("provider.provider", "cli.common"), ("agent.agent", "cli.common"),
        ("gang.gang", "slurm.client"), ("sandbox.core", "state"), ("node", "proc"),
        ("cli.main", "gang.gang"), ("provider.provider", "node"), ("launch_guard", "proc"),
        ("proc", "launch_guard")])


def test_the_import_reader_resolves_what_python_would() -> None:
    mods = {f"{PKG}": Path(), f"{PKG}.proc": Path(), f"{PKG}.slurm": Path(),
            f"{PKG}.slurm.cli": Path(), f"{PKG}.slurm.client": Path(),
            f"{PKG}.provider": Path(), f"{PKG}.provider.runner": Path()}
    src = """
from typing import TYPE_CHECKING
import os
from . import client
from .client import Job
from .. import proc
from ray_slurm_provider.provider import runner, SlurmNodeProvider
if TYPE_CHECKING:
    import ray_slurm_provider.provider.runner
def f():
    from ray_slurm_provider import __version__
"""
    got = {(i.target, i.line) for i in imports_of(f"{PKG}.slurm.cli", src, False, mods)}
    assert got == {(f"{PKG}.slurm.client", 4), (f"{PKG}.slurm.client", 5),
                   (f"{PKG}.proc", 6), (f"{PKG}.provider.runner", 7), (f"{PKG}.provider", 7),
                   (f"{PKG}.provider.runner", 9), (PKG, 11)}
    pkg_src = "from . import cli\nfrom .cli import x\n"
    got = {(i.target, i.line) for i in imports_of(f"{PKG}.slurm", pkg_src, True, mods)}
    assert got == {(f"{PKG}.slurm.cli", 1), (f"{PKG}.slurm.cli", 2)}
    dyn = ('import importlib\nM = ("ray_slurm_provider.proc", "not.ours")\n'
           "importlib.import_module(M[0])\n")
    assert [i.target for i in imports_of(f"{PKG}.slurm.cli", dyn, False, mods)] == [
        f"{PKG}.proc"]
    argv = 'CMD = ["python", "-m", "ray_slurm_provider.proc"]\n'
    assert imports_of(f"{PKG}.slurm.cli", argv, False, mods) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    # The real tree: the shim imports the agent, and the command table counts.
    edges = _graph(all_imports())
    assert f"{PKG}.agent.__main__" in edges[f"{PKG}.node"]
    assert f"{PKG}.sandbox.cli" in edges[f"{PKG}.cli.main"]


def test_the_package_imports_the_api_only_lazily() -> None:
    ours = [i for i in all_imports() if i.importer == PKG]
    assert {i.target for i in lazy_exports()} == LAZY_EXPORTS
    assert set(ours) == lazy_exports(), [where(i) for i in ours if i not in lazy_exports()]


# --- 5: the Layout page -----------------------------------------------------------------------

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_PATH = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")
_DOTTED = re.compile(rf"{PKG}(?:\.\w+)+")
#: What may follow a module in a dotted name: a class, a constant or a dunder.
_ATTRIBUTE = re.compile(r"[A-Z_]\w*")
_NEW_BLOCK = re.compile(r"^\s*(?:\||[-*+]\s|\d+[.)]\s|#)|^\s*$")


def layout_section(text: str) -> str | None:
    """The body of a page's "Layout" heading (any level), up to the next heading of the
    same or a higher level."""
    lines = text.splitlines()
    for k, line in enumerate(lines):
        m = _HEADING.match(line)
        if m and m.group(2).strip().lower() == "layout":
            level = len(m.group(1))
            body = []
            for nxt in lines[k + 1:]:
                h = _HEADING.match(nxt)
                if h and len(h.group(1)) <= level:
                    break
                body.append(nxt)
            return "\n".join(body)
    return None


def _dotted(tok: str) -> Path | None:
    """The module or package a dotted name names (a class or constant after it is fine)."""
    name = _known(tok, modules())
    rest = tok[len(name) + 1:]
    if name not in modules() or (rest and not _ATTRIBUTE.fullmatch(rest)):
        return None
    path = modules()[name]
    return path.parent if path.name == "__init__.py" else path


def layout_paths(section: str) -> tuple[set[Path], list[str]]:
    """(the paths the section names that exist, the names that name nothing).

    A name is a backticked path (`ray_slurm_provider/slurm/`, `tests/unit`, `agent.py`) or
    dotted module name (`ray_slurm_provider.agent`; a class after the module is fine).
    A bare name (`client.py`, `rest/`) is looked up in the folders named before it in the same
    table row, list item or paragraph (latest first: `slurm/` then `client.py`), then from
    the repository root, then from the package; a path with a slash from the root, then from
    the package."""
    found: set[Path] = set()
    missing: list[str] = []
    context: list[Path] = []
    for line in section.splitlines():
        if _NEW_BLOCK.match(line):
            context = []
        for tok in re.findall(r"`([^`\n]+)`", line):
            if _DOTTED.fullmatch(tok):
                named = _dotted(tok)
                if named is None:
                    missing.append(tok)
                else:
                    found.add(named.resolve())
                continue
            if not _PATH.fullmatch(tok) or not ("/" in tok or tok.endswith(".py")):
                continue
            bare = "/" not in tok.rstrip("/")
            candidates = [c / tok for c in reversed(context)] if bare else []
            candidates += [ROOT / tok, PKG_DIR / tok]
            hit = next((c.resolve() for c in candidates if c.exists()), None)
            if hit is None:
                missing.append(tok)
                hit = candidates[0] if bare or not tok.startswith(PKG) else ROOT / tok
            else:
                found.add(hit)
            if tok.endswith("/") or hit.is_dir():
                context.append(hit)
            elif not bare:
                context.append(hit.parent)
    return found, missing


def test_layout_reader_finds_paths_beside_their_room() -> None:
    found, missing = layout_paths(
        "| `ray_slurm_provider/slurm/` | `client.py`, `rest/`, `no_such.py` |\n"
        "| `tests/unit` | `ray up` |\n"
        "- `ray_slurm_provider.slurm.client.SlurmClient`, `ray_slurm_provider.nope`\n"
        "- `client.py`\n")
    slurm = PKG_DIR / "slurm"
    assert {slurm, slurm / "client.py", slurm / "rest", ROOT / "tests" / "unit"} <= found
    assert missing == ["no_such.py", f"{PKG}.nope", "client.py"]


def test_layout_page_names_every_package() -> None:
    section = layout_section(LAYOUT.read_text())
    assert section is not None, "docs/layout.md has no \"Layout\" heading (issue 12, item 7)"
    found, missing = layout_paths(section)
    packages = sorted(p.parent for p in PKG_DIR.rglob("__init__.py") if p.parent != PKG_DIR)
    unnamed = [rel(p) + "/" for p in packages if p.resolve() not in found]
    assert not missing and not unnamed, (
        "docs/layout.md is out of date:"
        + (f"\n  names what does not exist: {', '.join(missing)}" if missing else "")
        + (f"\n  does not name the packages: {', '.join(unnamed)}" if unnamed else ""))


def test_the_readme_layout_points_at_the_layout_page() -> None:
    section = layout_section(README.read_text())
    assert section is not None and "(docs/layout.md)" in section, (
        "the README needs a short \"Layout\" section that links docs/layout.md")

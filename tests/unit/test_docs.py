"""docs/config-reference.md is generated from the config model and must not drift."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ray_slurm_provider.cli import docs
from ray_slurm_provider.config import NodeConfig, ProviderConfig

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"


def test_committed_reference_matches_the_model() -> None:
    assert REFERENCE.read_text() == docs.reference(), (
        "docs/config-reference.md is stale: run `ray-slurm docs --output "
        "docs/config-reference.md` (or `python -m ray_slurm_provider.cli.docs -o ...`)")


def _keys(cls: type[object], prefix: str) -> list[str]:
    out = []
    for name, f in cls.__pydantic_fields__.items():  # type: ignore[attr-defined]
        out.append(f"{prefix}.{name}")
        if not f.description:
            raise AssertionError(f"{prefix}.{name} has no doc")
    return out


def test_every_key_is_documented() -> None:
    text = docs.reference()
    for cls, prefix in ((ProviderConfig, "provider"), (NodeConfig, "node_config")):
        for key in _keys(cls, prefix):
            assert f"| `{key.rsplit('.', 1)[1]}` |" in text
    assert "## `provider.rest`" in text and "## `provider.ports`" in text


def test_check_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "ref.md"
    stale.write_text("old\n")
    assert docs.main(["--check", str(stale)]) == 1
    assert docs.main(["--output", str(stale)]) == 0
    assert docs.main(["--check", str(stale)]) == 0
    assert "up to date" in capsys.readouterr().out


def test_type_names() -> None:
    from typing import Literal

    assert docs.type_name(str | None) == "string or null"
    assert docs.type_name(Literal["a", "b"]) == "one of `a`, `b`"
    assert docs.type_name(dict[str, str]) == "mapping of string to string"
    assert docs.type_name(list[str]) == "list of strings"


# --- what the hand-written docs say (issue 26, item 20) ----------------------------------------

ROOT = REFERENCE.parents[1]


def _docs() -> dict[str, str]:
    """The README and every page of docs/, by path; the reference as the model renders it."""
    pages = {"README.md": (ROOT / "README.md").read_text()}
    pages |= {f"docs/{p.name}": p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
    pages["docs/config-reference.md (rendered)"] = docs.reference()
    return pages


def test_no_doc_installs_from_pypi() -> None:
    """The package is not on PyPI: every install is from a clone."""
    wrong = [p for p, text in _docs().items() if "pip install ray-slurm-provider" in text]
    assert not wrong, f"`pip install ray-slurm-provider` (not on PyPI) in: {wrong}"


def test_the_slurm_releases_named_are_the_tested_ones() -> None:
    """Nothing tests Slurm 21.08; the README names the three releases its CI runs."""
    assert not [p for p, text in _docs().items() if "21.08" in text]
    readme = _docs()["README.md"]
    assert all(release in readme for release in ("22.05", "24.11", "26.05"))


def test_no_doc_points_at_an_issue_by_a_bare_word() -> None:
    """"see issue: containers" pointed nowhere: a reference is a link or an issue number."""
    wrong = {p: m.group(0) for p, text in _docs().items()
             if (m := re.search(r"\bissue: [A-Za-z]", text))}
    assert not wrong, wrong


def test_a_doc_naming_the_batch_signal_names_the_gangs_too() -> None:
    """A gang job gets `--signal=TERM@<s>`, not `B:TERM@` (jobs.py; the scripts are tested in
    test_walltime_headwatch.py and test_gang_agent.py): a page that names the one names the
    other."""
    wrong = [p for p, text in _docs().items()
             if "B:TERM@" in text and not re.search(r"(?<!B:)TERM@", text)]
    assert not wrong, f"{wrong} say B:TERM@ without the gang job's TERM@"


BOUND = "the address the node's Ray bound"


def test_the_user_guide_says_status_shows_the_address_each_nodes_ray_bound() -> None:
    """Issue 26.7: `status` shows the address each node's Ray bound (`node_ip_interface`'s
    where set), Slurm's NodeAddr only until its Ray is up (test_cmds.py,
    test_status_shows_the_address_each_nodes_ray_bound): the Node IPs section and the
    command table say so."""
    guide = _docs()["docs/user-guide.md"]
    section = " ".join(guide.split("### Node IPs", 1)[1].split("\n#", 1)[0].split())
    assert BOUND in section and "node_ip_interface" in section and "NodeAddr" in section
    row = next(ln for ln in guide.splitlines() if ln.startswith("| `status CONFIG"))
    assert BOUND in row


def test_status_docs_say_a_gang_members_address_is_blank_until_its_ray_is_up() -> None:
    """Before its Ray is up a gang member shows no address, and a gang job's row never does
    (status's one listing has its batch host's NodeAddr only; test_cmds.py,
    test_status_shows_the_address_each_nodes_ray_bound): the user guide's Node IPs section
    and command table and status.py's docstring say so."""
    from ray_slurm_provider.cli import status

    guide = _docs()["docs/user-guide.md"]
    section = " ".join(guide.split("### Node IPs", 1)[1].split("\n#", 1)[0].split())
    row = next(ln for ln in guide.splitlines() if ln.startswith("| `status CONFIG"))
    said = " ".join((status.__doc__ or "").split())
    assert all("gang member" in text and "NodeAddr" in text for text in (section, row, said))


def test_the_user_guide_says_which_early_ends_count() -> None:
    """It said the CLI back end asks `sacct` (it asks slurmctld first) and that without
    accounting an early end always counts against the type (issue 26 items 8 and 20). What
    counts is provider/ends.py's; tests/unit/test_early_ends.py pins the rest."""
    from ray_slurm_provider.provider.ends import ITS_OWN, RETRY_S, SETTLE_S

    guide = _docs()["docs/user-guide.md"]
    section = guide.split("## Accounting (optional)", 1)[1].split("\n## ", 1)[0]
    assert "always counts" not in section and "it asks `sacct`" not in section
    said = re.search(r"ended of its own doing: Slurm says (.*?)\.", section, re.S)
    assert said and set(re.findall(r"[A-Z_]{4,}", said.group(1))) == ITS_OWN
    flat = " ".join(section.split())
    assert f"no final end {SETTLE_S / 60:.0f} minutes after Slurm stopped listing it" in flat
    assert f"it asks again every {RETRY_S:.0f} s" in flat


# --- links ----------------------------------------------------------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(text: str) -> set[str]:
    """The anchors GitHub makes of a page's headings: lower case, punctuation but `-` and `_`
    dropped, spaces to `-`, a repeated one numbered."""
    out: set[str] = set()
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", _FENCE.sub("", text), re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n, base = 0, slug
        while slug in out:
            n += 1
            slug = f"{base}-{n}"
        out.add(slug)
    return out


def links(text: str) -> list[str]:
    """The relative links of a page (not web addresses), outside code blocks."""
    return [t for t in _LINK.findall(_FENCE.sub("", text))
            if not re.match(r"[a-z]+:", t)]


def test_anchors_are_githubs() -> None:
    assert anchors("# A b\n## `provider.rest`\n### Gang node types: one job of N\n# A b\n") == {
        "a-b", "providerrest", "gang-node-types-one-job-of-n", "a-b-1"}
    assert links("[a](x.md#y) [b](https://e.org) `x`\n```\n[c](nope.md)\n```\n") == ["x.md#y"]


def test_every_relative_link_resolves() -> None:
    """Every relative link of the README, docs/ and the other Markdown pages names a file that
    exists, and its #anchor a heading of that page."""
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted(ROOT.glob("*/README.md")), *sorted(ROOT.glob("bench/*.md")),
             *sorted(ROOT.glob("cluster-configs/*/README.md"))]
    broken = []
    for page in pages:
        for link in links(page.read_text()):
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, "\n".join(broken)


def test_benchmarks_start_with_the_current_results() -> None:
    """BENCHMARKS.md opens with one table of current results, a row for every benchmark it has a
    section for, and links the older rounds."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    headings = re.findall(r"^## (.*)$", _FENCE.sub("", text), re.M)
    assert headings[0] == "Current results"
    table = text.split("## Current results", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| (P\d+b?|M\d+) \|", table, re.M))
    sections = {m for h in headings for m in re.findall(r"\b(P\d+b?|M\d+)\b", h.split(":")[0])}
    assert sections and sections <= rows, f"no current-results row for {sections - rows}"
    assert "(bench/HISTORY.md)" in text


# --- the README ---------------------------------------------------------------------------------

TEST_COMMAND = ("python3 -m venv .venv && .venv/bin/pip install -e '.[dev,megatron-cpu]' && "
                "bash scripts/test.sh")


def test_the_readme_stays_a_newcomers_page() -> None:
    """At most 350 lines (issue 25, item 8): the two commands, verbatim (.ci/run runs the
    second), Tested with, and a link to each page of docs/."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 350, "move a section to docs/ and link it"
    assert "\nbash scripts/demo.sh\n" in text and f"\n{TEST_COMMAND}\n" in text
    assert "exec bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^#+ Tested with$", text, re.M)
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md"))
                if f"(docs/{p.name})" not in text]
    assert not unlinked, f"the README does not link {unlinked}"


def test_tested_with_names_each_ray_that_ci_runs() -> None:
    """Issue 29.4: the README's Tested with names the Ray of the project venv and the lowest
    Ray that pyproject.toml declares, which scripts/test.sh reads from the same line and runs
    the core lifecycle on."""
    import ray

    m = re.search(r'"ray\[default\]>=([0-9.]+),', (ROOT / "pyproject.toml").read_text())
    assert m, "pyproject.toml declares no ray[default]>=X,..."
    floor = m.group(1) + ".0" * (2 - m.group(1).count("."))  # pip's ==2.55 is 2.55.0
    text = (ROOT / "README.md").read_text()
    tested = text.split("### Tested with", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+\.\d+\.\d+)\b", tested, re.M)
    assert floor in rows and ray.__version__ in rows, rows
    assert "floor_ray" in (ROOT / "scripts" / "test.sh").read_text()

"""docs/config-reference.md is generated from the config model and must not drift."""

from __future__ import annotations

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

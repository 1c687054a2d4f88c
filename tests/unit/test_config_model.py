"""The config model's types, key by key (issue 25): a Slurm duration is a string only, since
YAML 1.1 reads an unquoted `4:00:00` as 14400 and `ray up` hands us the parsed number;
unknown keys get the nearest valid one; defaults files go through the same model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ray_slurm_provider.config import (
    ConfigError,
    ContainerConfig,
    parse_node_config,
    parse_provider,
)
from ray_slurm_provider.provider import defaults
from ray_slurm_provider.schema import DURATION_HINT, with_source

NC = "available_node_types.w.node_config"
HINT = r"write it as a string, e\.g\. '60' or '4:00:00' \(YAML 1\.1 reads 4:00:00 as 14400\)"


def node(text: str) -> Any:
    return parse_node_config(yaml.safe_load(text), "w")


def test_yaml_reads_an_unquoted_time_as_a_number() -> None:
    assert yaml.safe_load("time: 4:00:00") == {"time": 14400}


@pytest.mark.parametrize("text", ["time: 4:00:00", "time: 14400", "time: 60",
                                  "sbatch_options: {time-min: 1:00:00}"])
def test_an_unquoted_duration_is_refused_with_the_key_and_the_hint(text: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{NC}\.(time|sbatch_options\.time-min): got the "
                                          rf"number \d+; {HINT}$") as ei:
        node(text)
    assert ei.value.value == yaml.safe_load(text.replace("sbatch_options: ", ""))[
        "time" if "min" not in text else "time-min"]


def test_a_quoted_duration_is_kept_as_written() -> None:
    assert node('time: "4:00:00"').time == "4:00:00"
    assert node("time: '60'").time == "60"
    assert node("sbatch_options: {time-min: '30', nice: 10}").sbatch_options == {
        "time-min": "30", "nice": "10"}


def test_the_unquoted_time_never_reaches_the_batch_script() -> None:
    from ray_slurm_provider.provider.bootstrap import validate

    config = {"cluster_name": "c", "head_node_type": "h", "provider": {"type": "external",
              "module": "x"}, "available_node_types": {"h": {"resources": {"CPU": 1},
                                                             "node_config": {}}}}
    config["available_node_types"]["h"]["node_config"] = yaml.safe_load("time: 4:00:00")
    with pytest.raises(ConfigError, match=rf"available_node_types\.h\.node_config\.time: got "
                                          rf"the number 14400; {HINT}"):
        validate(config, live=False)


def test_the_text_the_user_wrote_is_named_when_the_yaml_is_at_hand() -> None:
    text = "a: 1\nnode_config:\n  time: 4:00:00   # four hours\n"
    with pytest.raises(ConfigError) as ei:
        parse_node_config(yaml.safe_load(text)["node_config"], "w")
    err = with_source(ei.value, text, "c.yaml")
    assert str(err).endswith(f"{DURATION_HINT} (c.yaml line 3: `time: 4:00:00`)")
    flow = "node_config: {partition: cpu, time: 1:30}\n"
    err = with_source(ConfigError("x", key=f"{NC}.time", value=90), flow, "f.yaml")
    assert str(err) == "x (f.yaml line 1: `time: 1:30`)"
    assert str(with_source(ConfigError("x", key="k", value=1), "k: '1'\n", "f")) == "x"


def test_memory_keeps_integers_names_take_whole_numbers() -> None:
    ncfg = node("mem: 0\naccount: 1234\nenvironment: {OMP_NUM_THREADS: 4}")
    assert (ncfg.mem, ncfg.account, ncfg.environment) == ("0", "1234", {"OMP_NUM_THREADS": "4"})
    assert node("mem: 16000").mem == "16000"


@pytest.mark.parametrize("text, match", [
    ("environment: {PY: 3.10}", rf"{NC}\.environment\.PY: expected a string, got 3\.1"),
    ("partition: true", rf"{NC}\.partition: expected a string, got True"),
    ("cpus: '4'", rf"{NC}\.cpus: expected an integer, got '4'"),
    ("exclusive: 'yes'", rf"{NC}\.exclusive: expected true or false, got 'yes'"),
    ("container: {image: 5}", rf"{NC}\.container\.image: expected a string, got 5"),
    ("container: {runtime: dockr}", rf"{NC}\.container\.runtime: 'dockr' is not one of 'none', "
                                    r"'docker', 'podman', 'apptainer', 'enroot', 'pyxis'"),
    ("prologue: [1]", rf"{NC}\.prologue\[0\]: expected a string, got 1"),
])
def test_wrong_types_name_the_key_path(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        node(text)


@pytest.mark.parametrize("data, match", [
    ({"partiton": "x"}, rf"{NC}\.partiton: unknown key; did you mean 'partition'\? valid keys"),
    ({"container": {"imag": "x"}}, rf"{NC}\.container\.imag: unknown key; did you mean 'image'"),
    ({"zzz": 1}, rf"{NC}\.zzz: unknown key; valid keys are: account, "),
])
def test_unknown_keys_get_a_did_you_mean(data: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_node_config(data, "w")


def test_provider_did_you_mean_and_internal_keys() -> None:
    with pytest.raises(ConfigError, match=r"provider\.slurm_apii: unknown key; did you mean "
                                          r"'slurm_api'"):
        parse_provider({"slurm_apii": "rest"})
    assert parse_provider({"_node_types": {}, "state_dir": "/s"}).state_dir == "/s"


def test_models_are_frozen_and_replaceable() -> None:
    import dataclasses

    cfg = ContainerConfig(runtime="docker")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.image = "x"  # type: ignore[misc]
    assert dataclasses.replace(cfg, image="i").image == "i"


def test_defaults_files_go_through_the_same_model(tmp_path: Path) -> None:
    path = tmp_path / "site.yaml"
    path.write_text("node_config:\n  partition: gpu\n  time: 4:00:00\n")
    config = {"cluster_name": "c", "available_node_types": {"w": {"node_config": {}}}}
    with pytest.raises(ConfigError, match=rf"^{path}: node_config\.time: got the number 14400; "
                                          rf"{HINT} \({path} line 3: `time: 4:00:00`\)$"):
        defaults.apply(config, [str(path)])
    path.write_text("provider:\n  ray_logs_max_mb: 1.5\n")
    with pytest.raises(ConfigError, match=r"provider\.ray_logs_max_mb: expected an integer"):
        defaults.apply({"cluster_name": "c"}, [str(path)])


def test_the_cli_names_the_line_of_an_unquoted_time(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """validate, render, run and sbatch all read the file through load_cluster."""
    from ray_slurm_provider.cli.common import CliError, load_cluster
    from ray_slurm_provider.cli.main import main

    monkeypatch.setenv(defaults.ENV, "")
    path = tmp_path / "c.yaml"
    path.write_text("cluster_name: c\nhead_node_type: h\nprovider: {type: external, module: x}\n"
                    "available_node_types:\n  h:\n    resources: {CPU: 1}\n    node_config:\n"
                    "      time: 4:00:00\n")
    with pytest.raises(CliError, match=rf"node_config\.time: got the number 14400; {HINT} "
                                       rf"\({path} line 8: `time: 4:00:00`\)"):
        load_cluster(str(path), starts=True)
    assert load_cluster(str(path)).name == "c"  # status and logs still read it
    for command in ("validate", "render", "run", "sbatch"):
        extra = ["--", "true"] if command in ("run", "sbatch") else []
        assert main([command, str(path), *extra]) == 2
        assert "line 8: `time: 4:00:00`" in capsys.readouterr().err
    path.write_text(path.read_text().replace("4:00:00", "'4:00:00'"))
    assert load_cluster(str(path), starts=True).parsed.node_type("h").node_config.time == (
        "4:00:00")

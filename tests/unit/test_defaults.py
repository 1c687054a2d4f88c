"""Site-wide and personal defaults files (issue 17.4): merged under the cluster YAML, which
always wins; checked with the config model; each supplied value traced to its file."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from ray_slurm_provider.cli.main import main
from ray_slurm_provider.config import ConfigError
from ray_slurm_provider.provider import defaults
from ray_slurm_provider.provider.bootstrap import bootstrap_config
from ray_slurm_provider.slurm.client import SlurmError

SITE = {"provider": {"slurm_api": "rest", "rest": {"url": "https://slurm.site:6820",
                                                  "ca_file": "/etc/ssl/site.pem"}},
        "node_config": {"partition": "gpu", "account": "site-acct", "time": "1:00:00",
                        "container": {"runtime": "apptainer", "image": "/shared/ray.sif",
                                      "mounts": ["/scratch:/scratch"]}}}
USER = {"node_config": {"account": "my-proj", "qos": "high"}}


def write(tmp: Path, name: str, data: Any) -> str:
    p = tmp / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(p)


def cluster_yaml() -> dict[str, Any]:
    return {"cluster_name": "c", "head_node_type": "head",
            "provider": {"type": "external", "module": "ray_slurm_provider.provider."
                         "SlurmNodeProvider", "rest": {"url": "https://mine:6820"}},
            "available_node_types": {
                "head": {"resources": {"CPU": 0}, "node_config": {"partition": "cpu"}},
                "w": {"resources": {"CPU": 1},
                      "node_config": {"container": {"image": "/home/me/my.sif"}}}}}


def test_the_yaml_wins_then_the_users_file_then_the_sites(tmp_path: Path) -> None:
    paths = [write(tmp_path, "site.yaml", SITE), write(tmp_path, "user.yaml", USER)]
    config = cluster_yaml()
    supplied = defaults.apply(config, paths)
    head, w = (config["available_node_types"][t]["node_config"] for t in ("head", "w"))
    assert head["partition"] == "cpu" and w["partition"] == "gpu"
    assert head["account"] == w["account"] == "my-proj" and w["qos"] == "high"
    # Mappings merge key by key; a list is replaced whole (here: not written, so the site's).
    assert w["container"] == {"runtime": "apptainer", "image": "/home/me/my.sif",
                              "mounts": ["/scratch:/scratch"]}
    assert config["provider"]["rest"] == {"url": "https://mine:6820",
                                          "ca_file": "/etc/ssl/site.pem"}
    assert config["provider"]["slurm_api"] == "rest"
    assert supplied["provider.rest.ca_file"] == paths[0]
    assert "provider.rest.url" not in supplied
    assert supplied["available_node_types.w.node_config.partition"] == paths[0]
    assert supplied["available_node_types.w.node_config.account"] == paths[1]
    assert "available_node_types.head.node_config.partition" not in supplied
    assert "available_node_types.w.node_config.container.image" not in supplied
    lines = defaults.describe(supplied, config)
    assert f"node_config.partition = 'gpu' from {paths[0]} (w)" in lines
    assert f"node_config.account = 'my-proj' from {paths[1]} (head, w)" in lines
    assert f"provider.rest.ca_file = '/etc/ssl/site.pem' from {paths[0]}" in lines


def test_a_list_in_the_yaml_replaces_the_defaults_list(tmp_path: Path) -> None:
    config = cluster_yaml()
    config["available_node_types"]["w"]["node_config"]["container"]["mounts"] = ["/a:/a"]
    defaults.apply(config, [write(tmp_path, "site.yaml", SITE)])
    assert config["available_node_types"]["w"]["node_config"]["container"]["mounts"] == \
        ["/a:/a"]


def test_merged_once_so_the_head_never_merges_its_own_nodes_files(tmp_path: Path) -> None:
    config = cluster_yaml()
    defaults.apply(config, [write(tmp_path, "site.yaml", SITE)])
    once = copy.deepcopy(config)
    assert config["provider"][defaults.APPLIED_KEY] == [str(tmp_path / "site.yaml")]
    assert defaults.apply(config, [write(tmp_path, "other.yaml", USER)]) == {}
    assert config == once


@pytest.mark.parametrize(("data", "match"), [
    ({"nodes_config": {}}, r"nodes_config: unknown key; a defaults file has only"),
    ({"node_config": {"partiton": "x"}}, r"node_config\.partiton: unknown key; did you mean "
                                         r"'partition'"),
    ({"node_config": {"container": {"imag": "x"}}}, r"node_config\.container\.imag: unknown"),
    ({"provider": {"slurm_apii": "rest"}}, r"provider\.slurm_apii: unknown key"),
    ({"provider": {"module": "x"}}, r"provider\.module: cannot be a default"),
    ({"node_config": {"cpus": "many"}}, r"node_config\.cpus"),
    ("partition: [", "not valid YAML"),
    ("- a list", "must be a mapping"),
])
def test_bad_defaults_files_are_refused_with_file_and_key(tmp_path: Path, data: Any,
                                                          match: str) -> None:
    path = write(tmp_path, "bad.yaml", data)
    with pytest.raises(ConfigError, match=match) as ei:
        defaults.apply(cluster_yaml(), [path])
    assert str(ei.value).startswith(path)


def test_which_files_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(defaults.ENV, raising=False)
    assert defaults.default_paths() == ["/etc/ray-slurm/defaults.yaml",
                                        f"{tmp_path}/.config/ray-slurm/defaults.yaml"]
    assert defaults.default_paths({defaults.ENV: "/a.yaml::/b.yaml"}) == ["/a.yaml", "/b.yaml"]
    assert defaults.default_paths({defaults.ENV: ""}) == []
    monkeypatch.setattr(defaults, "SITE_FILE", str(tmp_path / "no-site.yaml"))
    assert defaults.apply(cluster_yaml()) == {}  # the default files may be absent


def test_a_named_defaults_file_that_is_missing_is_an_error_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26.13: a typo in RAY_SLURM_DEFAULTS silently dropped the site's partition and
    account; a file it names must exist."""
    site = write(tmp_path, "site.yaml", SITE)
    typo = str(tmp_path / "usr.yaml")
    monkeypatch.setenv(defaults.ENV, f"{site}:{typo}")
    with pytest.raises(ConfigError, match=rf"^{typo}: no such defaults file \(named in "
                                          r"RAY_SLURM_DEFAULTS\)"):
        defaults.apply(cluster_yaml())
    with pytest.raises(ConfigError, match=rf"^{typo}: no such defaults file"):
        defaults.apply(cluster_yaml(), [typo])
    path = write(tmp_path, "c.yaml", cluster_yaml())
    assert main(["validate", path, "--offline"]) == 2
    assert f"{typo}: no such defaults file" in capsys.readouterr().err


def test_a_tilde_in_ray_slurm_defaults_is_the_home_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    write(tmp_path, "site.yaml", SITE)
    monkeypatch.setenv(defaults.ENV, "~/site.yaml")
    assert defaults.default_paths() == [f"{tmp_path}/site.yaml"]
    config = cluster_yaml()
    defaults.apply(config)
    assert config["available_node_types"]["w"]["node_config"]["account"] == "site-acct"


def offline(config: Any = None) -> Any:
    raise SlurmError("offline")


def test_ray_up_hands_the_head_the_merged_node_configs(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(defaults.ENV, write(tmp_path, "site.yaml",
                                           {"node_config": {"partition": "gpu",
                                                            "account": "a1"}}))
    monkeypatch.setattr("ray_slurm_provider.provider.bootstrap._cluster_info", offline)
    config = cluster_yaml()
    config["provider"]["python"] = "/py"
    del config["provider"]["rest"]
    out = bootstrap_config(config)
    section = out["provider"]["_node_types"]
    assert section["w"]["node_config"]["partition"] == "gpu"
    assert section["head"]["node_config"] == {"partition": "cpu", "account": "a1"}


def test_validate_and_render_say_where_values_came_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    site = write(tmp_path, "site.yaml", {"node_config": {"account": "site-acct"}})
    monkeypatch.setenv(defaults.ENV, site)
    config = cluster_yaml()
    config["provider"] = {"type": "external", "module": "ray_slurm_provider.provider."
                          "SlurmNodeProvider", "python": "/py",
                          "state_dir": str(tmp_path / "state")}
    path = write(tmp_path, "c.yaml", config)
    assert main(["validate", path, "--offline"]) == 0
    out = capsys.readouterr().out
    assert f"defaults: node_config.account = 'site-acct' from {site} (head, w)" in out
    monkeypatch.setattr("ray_slurm_provider.provider.bootstrap._cluster_info", offline)
    assert main(["render", path]) == 0
    out = capsys.readouterr().out
    assert f"# from defaults: node_config.account = 'site-acct' from {site} (head, w)" in out
    assert "#SBATCH --account=site-acct" in out
    bad = write(tmp_path, "bad.yaml", "partition: [")
    monkeypatch.setenv(defaults.ENV, bad)
    assert main(["validate", path, "--offline"]) != 0
    assert f"{bad}: not valid YAML" in capsys.readouterr().err

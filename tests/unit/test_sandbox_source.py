"""Slurm built from source for the sandbox (``--slurm 25.11``) and pyslurm against it, with a
fake release tarball (no compiler run): a build once into the cache, nothing left of a
failed one, the missing tarball named, the release's clients first on PATH, and --pyslurm
refused where pyslurm has no matching release."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from ray_slurm_provider.sandbox import daemons, files, prereq, pyslurmwheel, pyxis, roots, source
from ray_slurm_provider.sandbox.config import SandboxSpec
from ray_slurm_provider.sandbox.layout import Layout
from ray_slurm_provider.sandbox.procs import SandboxError

CONFIGURE = """#!/bin/sh
set -e
[ -z "$FAIL" ] || { echo "configure: error: $FAIL" >&2; exit 1; }
for a in "$@"; do case $a in --prefix=*) prefix=${a#--prefix=};; esac; done
printf 'PREFIX=%s\\n' "$prefix" > Makefile.vars
echo configured >> "$COUNT"
"""
MAKEFILE = """include Makefile.vars
all:
\t@echo built
install:
\tmkdir -p $(DESTDIR)$(PREFIX)/sbin $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib
\tfor d in slurmctld slurmd slurmrestd slurmdbd slurmstepd; do \\
\t  printf '#!/bin/sh\\necho slurm 25.11.7\\n' > $(DESTDIR)$(PREFIX)/sbin/$$d; \\
\t  chmod 755 $(DESTDIR)$(PREFIX)/sbin/$$d; done
\tfor c in sbatch squeue scontrol; do touch $(DESTDIR)$(PREFIX)/bin/$$c; done
"""


def _tarball(vendor: Path) -> Path:
    vendor.mkdir(parents=True, exist_ok=True)
    path = vendor / "slurm-25.11.7.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, text, mode in (("configure", CONFIGURE, 0o755), ("Makefile", MAKEFILE, 0o644)):
            data = text.encode()
            info = tarfile.TarInfo(f"slurm-25.11.7/{name}")
            info.size = len(data)
            info.mode = mode
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(roots.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(pyxis.VENDOR_ENV, str(tmp_path / "vendor"))
    monkeypatch.setenv("COUNT", str(tmp_path / "count"))
    return tmp_path / "cache"


def test_25_11_is_built_from_source_and_runs_on_the_host() -> None:
    assert roots.from_source("25.11") and not roots.in_root("25.11")
    spec = SandboxSpec(slurm="25.11", users=2, accounting=True)
    assert spec.from_source and spec.own_clients and not spec.in_root
    assert SandboxSpec.from_json(spec.to_json()) == spec
    assert not SandboxSpec().own_clients and SandboxSpec(slurm="24.11").own_clients
    assert roots.rest_version("25.11") == "v0.0.44"


def test_a_missing_tarball_is_named(cache: Path) -> None:
    with pytest.raises(SandboxError, match=r"missing: .*vendor/slurm-25\.11\.7\.tar\.gz "
                       r"\(set \$RAY_SLURM_VENDOR_DIR"):
        source.ensure_built(source.install_for("25.11"))
    assert not (cache / "slurm" / "25.11.7").exists()


def test_built_once_into_the_cache(cache: Path, tmp_path: Path) -> None:
    _tarball(tmp_path / "vendor")
    install = source.ensure_built(source.install_for("25.11"))
    assert install.prefix == str(cache / "slurm" / "25.11.7")
    assert install.built() and os.access(install.sbin("slurmctld"), os.X_OK)
    assert sorted(os.listdir(cache / "slurm")) == ["25.11.7"]  # no temporary dir left
    source.ensure_built(source.install_for("25.11"))
    assert (tmp_path / "count").read_text() == "configured\n"  # the second found the first
    marker = Path(install.prefix) / source.MARKER
    marker.write_text("25.11.7 --disable-debug\n")  # made with other configure options
    assert not install.built()
    source.ensure_built(source.install_for("25.11"))
    assert (tmp_path / "count").read_text() == "configured\n" * 2


def test_a_failed_build_leaves_nothing(cache: Path, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _tarball(tmp_path / "vendor")
    monkeypatch.setenv("FAIL", "libmunge not found")
    with pytest.raises(SandboxError, match=r"(?s)\./configure.*failed.*libmunge not found.*log: "):
        source.ensure_built(source.install_for("25.11"))
    assert os.listdir(cache / "slurm") == []
    assert "libmunge not found" in (cache / "slurm-25.11.7.log").read_text()


def test_the_release_s_daemons_and_clients(cache: Path, tmp_path: Path) -> None:
    _tarball(tmp_path / "vendor")
    install = source.ensure_built(source.install_for("25.11"))
    layout = Layout(str(tmp_path / "state"))
    spec = SandboxSpec(slurm="25.11")
    os.makedirs(os.path.join(layout.root, "etc"))
    files._prepare_source_clients(layout, spec)
    assert sorted(os.listdir(layout.bin_dir)) == ["sbatch", "scontrol", "squeue"]
    assert os.readlink(os.path.join(layout.bin_dir, "sbatch")) == f"{install.prefix}/bin/sbatch"
    assert "CgroupPlugin=disabled" in Path(layout.cgroup_conf).read_text()
    assert daemons.argv_for("slurmctld", layout, spec)[0] == install.sbin("slurmctld")
    assert daemons.argv_for("slurmd:n1", layout, spec)[0] == install.sbin("slurmd")
    rest = daemons.argv_for("slurmrestd", layout, spec)
    assert rest[0] == install.sbin("slurmrestd") and "openapi/slurmctld" in rest
    assert rest[rest.index("-u") + 1] == "65534"  # 25.11 cannot resolve the name nobody
    assert daemons.argv_for("munged", layout, spec)[0].endswith("munged")  # the host's


def test_the_build_s_packages() -> None:
    table = prereq.required_packages(prereq.Needs(accounting=True, build=True))
    assert {"libmunge-dev", "libjwt-dev", "libhttp-parser-dev", "libmariadb-dev", "munge",
            "mariadb-server"} <= set(table)
    assert "slurmdbd" not in table and "slurm-wlm" not in table  # the build brings its own


def test_pyslurm_only_where_pyslurm_has_the_release(cache: Path) -> None:
    with pytest.raises(ValueError, match=r"pyslurm X\.Y builds only against Slurm X\.Y.*"
                       r"--slurm 25\.11 \(this sandbox runs Slurm 22\.05\)"):
        SandboxSpec(pyslurm=True)
    assert SandboxSpec(slurm="25.11", pyslurm=True).pyslurm
    wheel = pyslurmwheel.Wheel(source.install_for("25.11"))
    other = pyslurmwheel.Wheel(source.Install(str(cache / "elsewhere"), "25.11"))
    assert wheel.version == "25.11.2" and wheel.dir != other.dir  # keyed by the install dir
    assert wheel.dir.startswith(str(cache / "pyslurm" / "25.11.2")) and wheel.path() is None

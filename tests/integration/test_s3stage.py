"""S3 checkpoint staging (launch/s3stage.py) against moto's standalone server on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto")

from ray_slurm_provider.gang.s3stage import S3Stage, split_uri, tracker_last  # noqa: E402
from tests.integration.moto_s3 import moto_s3  # noqa: E402


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with moto_s3(tmp_path_factory.mktemp("moto")) as url:
        boto3.client("s3", endpoint_url=url).create_bucket(Bucket="ckpt")
        yield url


def write_checkpoint(root: Path, iteration: int, payload: bytes = b"x") -> None:
    d = root / f"iter_{iteration:07d}"
    d.mkdir(parents=True, exist_ok=True)
    for r in range(2):
        (d / f"__{r}_0.distcp").write_bytes(payload * (100 + r))
    (d / "metadata.json").write_text(f'{{"iteration": {iteration}}}')
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def test_uri_and_order() -> None:
    assert split_uri("s3://b") == ("b", "")
    assert split_uri("s3://b/a/c/") == ("b", "a/c/")
    with pytest.raises(ValueError):
        split_uri("/local")
    assert tracker_last(["latest_checkpointed_iteration.txt", "iter_1/a", "b"]) == [
        "b", "iter_1/a", "latest_checkpointed_iteration.txt"]


def test_push_then_pull_round_trip(endpoint: str, tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    write_checkpoint(src, 4)
    stage = S3Stage("s3://ckpt/run1", endpoint)
    sent = stage.push(str(src))
    assert len(sent) == 4 and sent[-1] == "latest_checkpointed_iteration.txt"  # tracker last
    assert stage.push(str(src)) == []  # nothing changed: nothing sent
    write_checkpoint(src, 8, b"y")
    sent = stage.push(str(src))
    assert sorted(sent) == sorted(["iter_0000008/__0_0.distcp", "iter_0000008/__1_0.distcp",
                                   "iter_0000008/metadata.json",
                                   "latest_checkpointed_iteration.txt"])
    assert sent[-1] == "latest_checkpointed_iteration.txt"

    fetched = S3Stage("s3://ckpt/run1/", endpoint).pull(str(dst))
    assert len(fetched) == 7 and fetched[-1] == "latest_checkpointed_iteration.txt"
    for f in src.rglob("*"):
        if f.is_file():
            assert (dst / f.relative_to(src)).read_bytes() == f.read_bytes()
    assert stage.pull(str(dst)) == []  # up to date
    (dst / "iter_0000004" / "metadata.json").write_text("changed")
    assert stage.pull(str(dst)) == ["iter_0000004/metadata.json"]  # differs: fetched again
    assert not list(dst.rglob("*.rsp-part-*"))


def test_prefixes_are_separate(endpoint: str, tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "a", 1)
    S3Stage("s3://ckpt/a", endpoint).push(str(tmp_path / "a"))
    assert S3Stage("s3://ckpt/b", endpoint).pull(str(tmp_path / "b")) == []
    assert S3Stage("s3://ckpt/ab", endpoint).remote() == {}


def test_same_size_change_is_detected_by_md5(endpoint: str, tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    f = tmp_path / "s" / "latest"
    f.write_text("1")
    stage = S3Stage("s3://ckpt/md5", endpoint)
    assert stage.push(str(tmp_path / "s")) == ["latest"]
    f.write_text("2")  # same size, new content
    assert stage.push(str(tmp_path / "s")) == ["latest"]


@pytest.mark.parametrize("key", ["run9/{abs}", "run9/../outside", "run9/a/../../up"])
def test_a_key_that_escapes_the_checkpoint_dir_is_refused(endpoint: str, tmp_path: Path,
                                                          key: str) -> None:
    """Issue 13.3: `prefix//home/u/.bashrc` became an absolute path and was written there."""
    import boto3

    from ray_slurm_provider.gang.s3stage import UnsafeKey

    target = tmp_path / "escaped"  # the `//` key names it absolutely
    key = key.format(abs=str(target))
    boto3.client("s3", endpoint_url=endpoint).put_object(Bucket="ckpt", Key=key, Body=b"x")
    dst = tmp_path / "dst"
    with pytest.raises(UnsafeKey, match=r"outside the checkpoint directory .*dst.*prefix"):
        S3Stage("s3://ckpt/run9", endpoint).pull(str(dst))
    assert not target.exists() and not (tmp_path / "outside").exists()
    assert not (tmp_path / "up").exists()

"""Optional S3 staging of a checkpoint directory (boto3).

`pull(local_dir)` before an attempt brings down whatever the bucket has and the directory
lacks; `push(local_dir)` after a checkpoint uploads what the bucket lacks. Files are compared
by size and, for objects uploaded in one part, by MD5 (the ETag); multipart objects by size
only, which is enough for checkpoint shards (they are written once per iteration directory).
Tracker files (`latest_checkpointed_iteration.txt`, `latest`, ...) are uploaded **last**, so a
reader never sees a tracker naming an iteration whose shards are still on their way; they are
also downloaded last. Downloads go to a temporary name first and are renamed into place.

The endpoint comes from the argument, else `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`
(boto3 reads those itself); credentials from boto3's usual chain. Nothing is deleted on either
side.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACKERS = ("latest_checkpointed_iteration.txt", "latest_train_state.pt", "latest",
            "tracker.txt")
MULTIPART_THRESHOLD = 64 * 1024 * 1024


def split_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/a/b` -> (`bucket`, `a/b/`)."""
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    bucket, _, prefix = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {uri!r}")
    prefix = prefix.strip("/")
    return bucket, (prefix + "/") if prefix else ""


def md5_of(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def same(path: Path, size: int, etag: str) -> bool:
    """Is the local file the object (size, and MD5 when the ETag is one)?"""
    if not path.is_file() or path.stat().st_size != size:
        return False
    etag = etag.strip('"')
    return "-" in etag or md5_of(path) == etag


def tracker_last(rel_paths: list[str]) -> list[str]:
    """Order for transfer: data first, tracker files last."""
    return sorted(rel_paths, key=lambda r: (Path(r).name in TRACKERS, r))


class UnsafeKey(ValueError):
    """An object's key would write outside the checkpoint directory."""


def destination(root: Path, rel: str, uri: str) -> Path:
    """Where the object `rel` (its key less the prefix) goes: always below `root`. A key with
    `..`, or an absolute path after the prefix (`prefix//home/u/.bashrc`), is refused."""
    base = root.resolve()
    dest = (base / rel).resolve()
    if dest == base or base not in dest.parents:
        raise UnsafeKey(f"S3 object {uri.rstrip('/')}/{rel} would be written to {dest}, "
                        f"outside the checkpoint directory {base}; nothing was downloaded. "
                        "Remove that object, or use a prefix that holds only the checkpoint")
    return dest


@dataclass
class S3Stage:
    uri: str
    endpoint_url: str | None = None

    def __post_init__(self) -> None:
        self.bucket, self.prefix = split_uri(self.uri)
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3

            self._client = boto3.client("s3", endpoint_url=self.endpoint_url)
        return self._client

    def remote(self) -> dict[str, tuple[int, str]]:
        """Relative key -> (size, etag) of every object under the prefix."""
        out = {}
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(self.prefix):]
                if rel and not rel.endswith("/"):
                    out[rel] = (int(obj["Size"]), str(obj.get("ETag", "")))
        return out

    def pull(self, local_dir: str) -> list[str]:
        """Download what `local_dir` lacks; return the relative paths fetched."""
        root = Path(local_dir)
        root.mkdir(parents=True, exist_ok=True)
        fetched = []
        remote = self.remote()
        # Every key is checked before anything is written: a refusal leaves the dir as it was.
        dests = {rel: destination(root, rel, self.uri) for rel in remote}
        for rel in tracker_last(list(remote)):
            size, etag = remote[rel]
            dest = dests[rel]
            if same(dest, size, etag):
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.rsp-part-{os.getpid()}")
            self.client.download_file(self.bucket, self.prefix + rel, str(tmp))
            os.replace(tmp, dest)
            fetched.append(rel)
        return fetched

    def push(self, local_dir: str) -> list[str]:
        """Upload what the bucket lacks; return the relative paths sent."""
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD)
        root = Path(local_dir)
        remote = self.remote()
        sent = []
        for rel in tracker_last(list(_files(root))):
            try:
                if rel in remote and same(root / rel, *remote[rel]):
                    continue
                self.client.upload_file(str(root / rel), self.bucket, self.prefix + rel,
                                        Config=config)
            except FileNotFoundError:
                continue  # a temporary file that went away while we walked: not ours to keep
            sent.append(rel)
        return sent


def _files(root: Path) -> Iterator[str]:
    if not root.is_dir():
        return
    for p in sorted(root.rglob("*")):
        if p.is_file() and ".rsp-part-" not in p.name:
            yield p.relative_to(root).as_posix()

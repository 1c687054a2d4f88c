"""Keep a node's Ray session logs when its job ends.

Ray writes its logs into the node-local temp dir, which the agent deletes with the job (it is
on the node's own disk, and the next job must not find it). Before that, the agent copies
`session_latest/logs/` to the shared cluster dir (`ray-logs/<job id>/`), so raylet, GCS,
worker and autoscaler logs of a job that ended (normally, walltime, scancel, head gone,
preemption) can still be read with `ray-slurm logs CONFIG JOB --ray`.

The copy is capped (`provider.ray_logs_max_mb`): it runs inside Slurm's KillWait, and a
chatty job must not fill the user's home. Small files go first (each process's .out/.err
and the autoscaler's logs are small and tell the most); a file that does not fit keeps its
last bytes; files with no room left are only named in `_cut.txt`.
"""

from __future__ import annotations

import os
from pathlib import Path

SESSION_LOGS = ("session_latest", "logs")
CUT_FILE = "_cut.txt"
_CHUNK = 1 << 20


def _files(root: Path) -> list[tuple[int, Path]]:
    """(size, path) of the regular files below `root`, smallest first (no symlinks)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        for name in filenames:
            p = Path(dirpath, name)
            try:
                st = p.lstat()
            except OSError:
                continue
            if p.is_file() and not p.is_symlink():
                found.append((st.st_size, p))
    return sorted(found, key=lambda sp: (sp[0], str(sp[1])))


def _copy(src: Path, dst: Path, skip: int, limit: int) -> tuple[int, bool]:
    """Copy at most `limit` bytes of `src` from byte `skip` to `dst` (0600); return the bytes
    written and whether `src` had more (it grew since it was sized)."""
    dst.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    written = 0
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with src.open("rb") as fin, os.fdopen(fd, "wb") as fout:
        if skip:
            fin.seek(skip)
            fout.write(f"[ray-slurm: the first {skip} bytes were cut to stay under "
                       "provider.ray_logs_max_mb]\n".encode())
        # Read up to the limit, not to the end: a process still writing would pass the cap.
        while written < limit and (chunk := fin.read(min(_CHUNK, limit - written))):
            fout.write(chunk)
            written += len(chunk)
        more = bool(fin.read(1))
    return written, more


def keep(temp_dir: str, dest: Path, max_bytes: int) -> tuple[int, int]:
    """Copy the node's Ray session logs below `temp_dir` to `dest`, at most about
    `max_bytes`; return (files copied, bytes copied). Nothing to copy is not an error."""
    src = Path(temp_dir, *SESSION_LOGS)
    if max_bytes <= 0 or not src.is_dir():
        return 0, 0
    src = src.resolve()
    budget, copied, count = max_bytes, 0, 0
    cut: list[str] = []
    for size, path in _files(src):
        rel = path.relative_to(src)
        if budget <= 0:
            cut.append(f"{rel} ({size} bytes): not kept")
            continue
        skip = max(0, size - budget)
        try:
            n, more = _copy(path, dest / rel, skip, budget)
        except OSError as e:  # a file Ray removed meanwhile, or one we cannot read
            cut.append(f"{rel}: {e}")
            continue
        if skip:
            cut.append(f"{rel} ({size} bytes): only the last {n} kept")
        elif more:
            cut.append(f"{rel}: grew while it was kept; only its first {n} bytes kept")
        budget -= n
        copied += n
        count += 1
    if cut:
        dest.mkdir(parents=True, exist_ok=True, mode=0o700)
        (dest / CUT_FILE).write_text("\n".join(cut) + "\n")
    return count, copied

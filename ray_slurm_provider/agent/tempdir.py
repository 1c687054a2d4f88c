"""The node's Ray temp dir, below the user's own private parent `<root>/rsp-<uid>`.

Ray makes its own dirs below it 0777 (its sockets included), so the parent is what keeps
other users of the node out: the agent creates it 0700 or checks the one it finds. Anyone
can make `<root>/rsp-<uid>` first (and the user cannot remove it from a sticky /tmp): then
the job runs in a fresh private dir beside it, and agent.json records which (state.AgentInfo).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from ray_slurm_provider.agent import raylogs
from ray_slurm_provider.nodespec import split
from ray_slurm_provider.slurm.client import SlurmError, UserJobs

#: A job dir's name (agent.py): a job id (123, an array task's 123_4, 123+1), and a gang
#: member's `.<k>` after it.
_JOB_DIR = re.compile(r"^\d+(?:[_+]\d+)?(?:\.\d+)?$")


def private_parent(temp: str) -> Path:
    """Create (0700) or check the user's parent of `temp`: a directory of its own, owned by
    this user, open to no one else. Ray makes the dirs below it 0777 (sockets included)."""
    parent = Path(temp).parent
    with contextlib.suppress(FileExistsError):
        parent.mkdir(mode=0o700, parents=True)
    st = parent.lstat()
    fix = "provider.temp_dir_root can name another root"
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"{parent} is not a directory of its own (a link or a file); {fix}")
    if st.st_uid != os.getuid():
        raise RuntimeError(f"{parent} is owned by uid {st.st_uid}, not by you "
                           f"(uid {os.getuid()}): another user made it; {fix}")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise RuntimeError(f"{parent} has mode {stat.S_IMODE(st.st_mode):o}: other users can "
                           f"reach Ray's sockets below it; run `chmod 700 {parent}`")
    return parent


def job_dir(temp: str, log: Callable[[str], None]) -> tuple[str, bool]:
    """The job's Ray temp dir and whether it is below the private parent: `temp` when its
    parent is taken, else a fresh private dir (0700, this user's) beside that parent.
    RuntimeError when neither can be had."""
    try:
        private_parent(temp)
        return temp, True
    except (RuntimeError, OSError) as e:  # refused, or it could not be made
        why = e
    parent = Path(temp).parent
    try:
        # `rsp-<uid>.XXXXXXXX`, the job's own dir with no job level below it: Ray's socket
        # paths stay within the budget of `rsp-<uid>/<job>` (jobs.longest_socket_below_root).
        fresh = tempfile.mkdtemp(prefix=f"{parent.name}.", dir=parent.parent)
    except OSError as e:
        raise RuntimeError(f"{why}; no private dir could be made in {parent.parent} "
                           f"either: {e}") from e
    log(f"{why}; using {fresh} instead")
    return fresh, False


def finish(temp: str, dest: Path, max_bytes: int, log: Callable[[str], None]) -> None:
    """Keep Ray's logs of the job's own temp dir `temp` in `dest` (agent/raylogs.py), then
    remove it. Ray has stopped: its logs are complete."""
    try:
        count, copied = raylogs.keep(temp, dest, max_bytes)
        if count:
            log(f"kept {count} Ray log file(s), {copied >> 10} KiB, in {dest}")
    except OSError as e:
        log(f"could not keep Ray's logs: {e}")
    shutil.rmtree(temp, ignore_errors=True)


def _own_dir(entry: os.DirEntry[str]) -> bool:
    """A directory of this user's own (a link is not followed)."""
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def sweep(temp: str, slurm: object, log: Callable[[str], None]) -> list[str]:
    """Remove the dirs beside the job's own `temp`, below its private parent, of this user's
    jobs that Slurm lists in no state at all (a SIGKILLed job's stays, spilled objects too);
    return their names. Only dirs of the user's own, named like a job id; nothing when the
    back end cannot list the user's jobs or the query fails."""
    parent, own = Path(temp).parent, Path(temp).name
    try:
        with os.scandir(parent) as entries:
            found = [e.name for e in entries
                     if e.name != own and _JOB_DIR.match(e.name) and _own_dir(e)]
    except OSError:
        return []
    if not found or not isinstance(slurm, UserJobs):
        return []  # nothing to sweep: Slurm is not asked
    # Listed before Slurm is asked: a job makes its dir only once it runs, so each dir found
    # belongs to a job Slurm lists in the answer unless that job has ended.
    try:
        listed = slurm.user_job_ids()
    except (SlurmError, OSError) as e:
        log(f"not sweeping old temp dirs: cannot list your jobs: {e}")
        return []
    # Not merely "not on this node": nodes (the sandbox's, a shared /tmp) share the parent.
    gone = [name for name in found if split(name)[0] not in listed]
    for name in gone:
        shutil.rmtree(parent / name, ignore_errors=True)
    if gone:
        log(f"removed the temp dirs of jobs Slurm no longer lists: {', '.join(sorted(gone))}")
    return gone

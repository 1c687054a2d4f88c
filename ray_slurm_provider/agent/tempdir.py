"""The node's Ray temp dir, below the user's own private parent `<root>/rsp-<uid>`.

Ray makes its own dirs below it 0777 (its sockets included), so the parent is what keeps
other users of the node out: the agent creates it 0700 or checks the one it finds.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def private_parent(temp: str) -> Path:
    """Create (0700) or check the user's parent of `temp`: a directory of its own, owned by
    this user, open to no one else. Ray makes the dirs below it 0777 (sockets included)."""
    parent = Path(temp).parent
    with contextlib.suppress(FileExistsError):
        parent.mkdir(mode=0o700, parents=True)
    st = parent.lstat()
    fix = "remove it (it is not this job's), or set provider.temp_dir_root to another path"
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"{parent} is not a directory of its own (a link or a file); {fix}")
    if st.st_uid != os.getuid():
        raise RuntimeError(f"{parent} is owned by uid {st.st_uid}, not by you "
                           f"(uid {os.getuid()}): another user made it; {fix}")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise RuntimeError(f"{parent} has mode {stat.S_IMODE(st.st_mode):o}: other users can "
                           f"reach Ray's sockets below it; run `chmod 700 {parent}`")
    return parent

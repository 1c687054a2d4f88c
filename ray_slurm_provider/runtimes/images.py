"""What an Enroot or Pyxis image names: a squashfs file, or a registry reference left to enroot.

`ray up`/`validate` (provider/validation.py) and the node agent (agent/container.py) ask the
same question, so a bad path reads the same in both places. Standard library only: the agent
imports it.

Pyxis takes an image for a file only when it starts with `/` or `.` (pyxis 0.24's
`strspn(image, "./")`); anything else it imports as `docker://<image>`, so a relative
`images/ray.sqsh` would be pulled from a registry. Enroot's `create` reads a file.
"""

from __future__ import annotations

import os

#: The first bytes of every squashfs file (little-endian "sqsh").
SQUASHFS_MAGIC = b"hsqs"
#: Enroot's URIs (`enroot import`): registry references, never files.
URI_SCHEMES = ("docker://", "dockerd://", "podman://")
#: Runtimes whose image is a squashfs file or a registry reference.
RUNTIMES = ("enroot", "pyxis")


def squashfs_path(runtime: str, image: str) -> str | None:
    """The file `image` names for `runtime`, or None for a registry reference (`nvcr.io#
    nvidia/pytorch:25.01-py3`, `docker://...`) or another runtime."""
    if runtime not in RUNTIMES or image.startswith(URI_SCHEMES) or "#" in image:
        return None
    if runtime == "pyxis" and not image.startswith(("/", ".")):
        return None
    return os.path.expanduser(image)


def problem(runtime: str, image: str) -> str | None:
    """Why `image` cannot run under `runtime` (one line), or None."""
    if runtime == "pyxis" and image.endswith((".sqsh", ".squashfs")) \
            and not image.startswith(("/", ".")):
        return (f"{image!r} looks like a file, but pyxis reads an image as a file only when "
                "it starts with '/' or '.' and would pull this one from a registry; write an "
                "absolute path or ./" + image)
    path = squashfs_path(runtime, image)
    if path is None:
        return None
    how = f"make one with `enroot import -o {path} dockerd://<tag>` (or docker://<registry>#<image>)"
    if not os.path.exists(path):
        return f"{path} does not exist; the image must be a squashfs file every node reads: {how}"
    if not os.path.isfile(path):
        return f"{path} is not a file; the image must be a squashfs file: {how}"
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQUASHFS_MAGIC))
    except OSError as e:
        return f"{path} cannot be read ({e.strerror}); every node's user must read it"
    if head != SQUASHFS_MAGIC:
        return (f"{path} is not a squashfs file (it does not start with {SQUASHFS_MAGIC!r}); "
                f"{how}")
    return None

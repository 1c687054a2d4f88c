"""Slurm's units, read and printed in one place: memory sizes and durations.

Slurm reads a memory size as a whole number with an optional K/M/G/T suffix (no suffix: MiB,
`0`: all of the node's memory) and a duration in its own forms (MM, MM:SS, HH:MM:SS, D-HH,
D-HH:MM, D-HH:MM:SS, or UNLIMITED); it prints durations as [D-]HH:MM:SS, or MM:SS under an
hour. Every module that parses or prints either goes through here.
"""

from __future__ import annotations

import math
import re

MIB = 1024 * 1024

#: What an error says is allowed.
MEM_FORMS = "a whole number of MiB or one with a K/M/G/T suffix (4000, 16G, 0 for all)"
TIME_FORMS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED"

_MEM = re.compile(r"^(\d+)([KMGT]?)$", re.IGNORECASE)
_MEM_FACTOR = {"": 1.0, "K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0**2}
_NO_TIME = frozenset({"UNLIMITED", "INFINITE", "NOT_SET", "INVALID", "NONE", "N/A", "(null)"})
_DURATION = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def mem_mb(text: str) -> int:
    """A Slurm memory size in MiB, rounded up (Slurm never gives less than asked); 0 = all.

    Raises ValueError naming the value when it is not one of Slurm's forms."""
    m = _MEM.match(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a Slurm memory size; valid: {MEM_FORMS}")
    return math.ceil(int(m.group(1)) * _MEM_FACTOR[m.group(2).upper()])


def mem_bytes(text: str) -> int | None:
    """A Slurm memory size in bytes; None for `0` (the whole node)."""
    return mem_mb(text) * MIB or None


def parse_duration(text: str) -> int | None:
    """Slurm duration -> seconds; None for unlimited/unset. Raises ValueError otherwise."""
    s = text.strip()
    if s.upper() in _NO_TIME:
        return None
    m = _DURATION.match(s)
    if not m:
        raise ValueError(f"not a Slurm duration: {text!r}")
    days, a, b, c = m.groups()
    n = int(a)
    if days is not None:  # D-HH[:MM[:SS]]
        return int(days) * 86400 + n * 3600 + int(b or 0) * 60 + int(c or 0)
    if c is not None:  # HH:MM:SS
        return n * 3600 + int(b) * 60 + int(c)
    if b is not None:  # MM:SS
        return n * 60 + int(b)
    return n * 60  # MM


def fmt_duration(seconds: int | None) -> str:
    """Seconds as Slurm prints a duration: D-HH:MM:SS, HH:MM:SS or MM:SS; None: UNLIMITED."""
    if seconds is None:
        return "UNLIMITED"
    d, rest = divmod(max(0, int(seconds)), 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    if d:
        return f"{d}-{h:02d}:{m:02d}:{s:02d}"
    return f"{h:02d}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"

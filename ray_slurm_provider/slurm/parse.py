"""Pure parsers for Slurm's text output (no I/O; every function is fixture-tested).

The CLI back end asks for explicit formats with an explicit delimiter, so nothing here depends
on column widths or on the user's SQUEUE_FORMAT.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping

from ray_slurm_provider.slurm.client import Job
from ray_slurm_provider.units import parse_duration

#: ASCII unit separator: cannot appear in node, partition or (our) job names.
DELIM = "\x1f"

#: squeue -o fields in output order. No field changes by itself between calls: the end time
#: (%e) stands in for the time left (%L, which does), so an unchanged cluster lists the same
#: text every time and an unchanged job the same line (`SqueueCache`). The comment (%k) comes
#: last because it is free text and may contain anything, the delimiter included; it is split
#: off with maxsplit. %i is the job id as users name it (`123`, or `123_4` for array task 4,
#: which `squeue --array` lists one line per task even while pending); %A is the numeric job
#: id (each running array task has its own; pending tasks show the array's).
SQUEUE_FIELDS: tuple[tuple[str, str], ...] = (
    ("end_time", "%e"), ("job_id", "%i"), ("name", "%j"), ("state", "%T"), ("reason", "%r"),
    ("nodes", "%N"), ("batch_host", "%B"), ("time_limit", "%l"), ("submit_time", "%V"),
    ("start_time", "%S"), ("partition", "%P"), ("slurm_job_id", "%A"), ("comment", "%k"),
)
SQUEUE_FORMAT = DELIM.join(code for _, code in SQUEUE_FIELDS)

#: What Slurm prints for "no value" in the fields above.
_EMPTY = frozenset({"", "(null)", "n/a", "N/A", "None", "NONE", "Unknown"})



def parse_sbatch(stdout: str) -> str:
    """Job id from `sbatch --parsable` output ("123" or "123;cluster")."""
    lines = [ln.strip() for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise ValueError("sbatch printed no job id")
    job_id = lines[-1].split(";", 1)[0].strip()
    if not job_id.isdigit():
        raise ValueError(f"unexpected sbatch --parsable output: {stdout.strip()!r}")
    return job_id


def _clean(value: str) -> str:
    v = value.strip()
    return "" if v in _EMPTY else v


@functools.lru_cache(maxsize=4096)
def _duration(text: str) -> int | None:
    """`parse_duration`, memoized: a listing repeats the same few limits on every line."""
    return parse_duration(text)


def parse_squeue(stdout: str, addrs: Mapping[str, str] | None = None) -> list[Job]:
    """Jobs from `squeue --noheader --format=SQUEUE_FORMAT`; ValueError on any bad line.

    `addrs` (node name -> NodeAddr) fills each job's `node_addr` from its batch host.

    A bad line is an error rather than a skipped record: a silently shorter list would make
    the caller believe jobs are gone. This runs on every autoscaler tick over the whole
    cluster, so it is written for speed (bench/p4_listing_cpu.py).
    """
    n = len(SQUEUE_FIELDS)
    addr = (addrs or {}).get
    empty = _EMPTY
    jobs = []
    for line in stdout.splitlines():
        parts = line.split(DELIM, n - 1)
        if len(parts) != n:
            if not line.strip():
                continue
            raise ValueError(f"squeue line has {len(parts)} fields, expected {n}: {line!r}")
        # In SQUEUE_FIELDS order; the comment is free text and kept as it is.
        (end_time, job_id, name, state, reason, nodes, batch_host, time_limit, submit_time,
         start_time, partition, numeric) = [p.strip() for p in parts[:-1]]
        comment = parts[-1]
        if not job_id or not state:
            raise ValueError(f"squeue line without job id or state: {line!r}")
        host = "" if batch_host in empty else batch_host
        jobs.append(Job(
            job_id=job_id,
            name=name,
            state=state.upper(),
            reason="" if reason in empty else reason,
            nodes="" if nodes in empty else nodes,
            batch_host=host,
            node_addr=addr(host, "") if host else "",
            time_limit_s=_duration(time_limit),
            end_time="" if end_time in empty else end_time,
            submit_time="" if submit_time in empty else submit_time,
            start_time="" if start_time in empty else start_time,
            partition="" if partition in empty else partition,
            comment="" if comment == "(null)" else comment,
            slurm_job_id=numeric if numeric.isdigit() else job_id,
        ))
    return jobs


class SqueueCache:
    """`parse_squeue` for the same listing every few seconds. An unchanged listing gives back
    the very list of the previous call; an unchanged line the same Job object, without
    parsing it again (a new Job per job per tick cost more than the rest of a tick at 10,000
    jobs: bench P4). Callers must not change what it returns. Not thread-safe: one per
    calling thread."""

    def __init__(self) -> None:
        self._text: str | None = None
        self._out: list[Job] = []
        self._jobs: dict[str, Job] = {}
        self._addrs: Mapping[str, str] | None = None
        self.fresh: list[Job] = []  # the jobs the last call parsed anew

    def parse(self, stdout: str, addrs: Mapping[str, str] | None = None) -> list[Job]:
        if addrs is not self._addrs:  # a new node table: addresses may differ
            self._text = None
            self._jobs = {}
            self._addrs = addrs
        if stdout == self._text:
            self.fresh = []
            return self._out
        seen, now, out = self._jobs, {}, []
        lines = stdout.splitlines()
        new = [ln for ln in lines if ln not in seen and ln.strip()]
        # One parse for all new lines (one Job per non-blank line, or ValueError).
        parsed = dict(zip(new, parse_squeue("\n".join(new), addrs), strict=True))
        for line in lines:
            job = seen.get(line) or parsed.get(line)
            if job is not None:
                now[line] = job
                out.append(job)
        self._text = stdout
        self._out = out
        self._jobs = now
        self.fresh = list(parsed.values())
        return out


# A key starts a token: it follows whitespace (or the line start) and ends with '='. Values may
# contain spaces (Reason=..., OS=Linux 6.1 ...) and '=' (TRES=cpu=2,mem=4000M), but a space
# followed by Word= always begins the next key.
_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_]*)=")


def parse_kv_line(line: str) -> dict[str, str]:
    """One `scontrol show ... -o` record -> {Key: value}."""
    out: dict[str, str] = {}
    matches = list(_KEY.finditer(line))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out[m.group(1)] = line[m.end():end].strip()
    return out


def parse_scontrol_records(stdout: str, first_key: str) -> list[dict[str, str]]:
    """All records of `scontrol show node|partition -o`; lines not starting with
    `first_key=` (e.g. "No partitions in the system") are skipped."""
    return [parse_kv_line(ln.strip()) for ln in stdout.splitlines()
            if ln.strip().startswith(first_key + "=")]


def parse_gres_gpus(gres: str) -> int:
    """GPUs in a GRES string: "gpu:2", "gpu:a100:8(S:0-1)", "gpu:2,shard:4", "(null)"."""
    total = 0
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = item.strip().split(":")
        name = parts[0].removeprefix("gres/")
        if name != "gpu":
            continue
        last = parts[-1] if len(parts) > 1 else ""
        total += int(last) if last.isdigit() else 1  # "gpu" or "gpu:a100" alone mean one
    return total


def parse_version(stdout: str) -> str:
    """"slurm 22.05.8" (or "slurm-wlm 22.05.8") -> "22.05.8"."""
    m = re.search(r"(\d+\.\d+(?:\.\d+)?\S*)", stdout)
    if not m:
        raise ValueError(f"no version in {stdout.strip()!r}")
    return m.group(1)


def _split_top(text: str) -> Iterator[str]:
    """Split on commas outside brackets: "a[1-2,4],b" -> "a[1-2,4]", "b"."""
    depth, start = 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            yield text[start:i]
            start = i + 1
    yield text[start:]


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm host list: "n[1-3,05],gpu1" -> n1 n2 n3 n05 gpu1 (zero padding kept)."""
    out: list[str] = []
    for item in _split_top(text.strip()):
        if not item:
            continue
        m = re.search(r"\[([^\]]*)\]", item)
        if not m:
            out.append(item)
            continue
        head, tail = item[:m.start()], item[m.end():]
        for rng in m.group(1).split(","):
            lo, _, hi = rng.partition("-")
            width = len(lo)
            for k in range(int(lo), int(hi or lo) + 1):
                out.extend(head + str(k).zfill(width) + rest for rest in expand_hostlist(tail)
                           or [""])
    return out

"""Property tests: no JobSpec text can smuggle a directive into sbatch or code into bash.

`parse_sbatch` reads a script the way sbatch 22.05 does (src/sbatch/opt.c, `_opt_batch_script`
and `_get_argument`); the `real sbatch` tests hold it to the installed binary, run with a
throw-away slurm.conf and no controller (sbatch prints each `#SBATCH` argument at -vvvv and
stops on a deliberate option conflict before it would try to submit).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from ray_slurm_provider.slurm.script import JobSpec, ScriptError, render

C_SPACE = b" \t\n\v\f\r"  # C isspace() in the C locale
SPLITTERS = re.compile(rb"hetjob|packjob", re.IGNORECASE)


class SbatchRefuses(Exception):
    """sbatch would refuse the script (fatal parse error or rejected content)."""


def _get_argument(line: bytes, pos: int) -> tuple[bytes | None, int]:
    """One argument from `line[pos:]`, as sbatch's `_get_argument` does."""
    while pos < len(line) and line[pos] in C_SPACE:
        pos += 1
    if pos < len(line) and line[pos] == ord(":"):
        raise SbatchRefuses("Unexpected `:`")
    if pos >= len(line):
        return None, pos
    arg: bytearray | None = None
    quoted, q_char, escape = False, 0, False
    while pos < len(line) and (quoted or line[pos] not in C_SPACE):
        ch = line[pos]
        if escape:
            escape = False
        elif ch == ord("\\"):
            escape = True
            pos += 1
            continue
        elif quoted:
            if ch == q_char:
                quoted = False
                pos += 1
                continue
        elif ch in b"\"'":
            quoted, q_char = True, ch
            pos += 1
            continue
        elif ch == ord("#"):  # unescaped, unquoted '#': the rest of the line is a comment
            break
        arg = arg if arg is not None else bytearray()
        arg.append(ch)
        pos += 1
    if quoted:
        raise SbatchRefuses("Unmatched quote")
    # An argument that produced no characters (e.g. "") ends the line, as in C (NULL return).
    return (bytes(arg) if arg is not None else None), pos


def parse_sbatch(script: bytes) -> list[bytes]:
    """The arguments sbatch takes from the `#SBATCH`/`#SLURM` lines of `script`."""
    if b"\0" in script:
        raise SbatchRefuses("NUL character")
    if b"\r\n" in script:
        raise SbatchRefuses("DOS line breaks")
    if not script.startswith(b"#!"):
        raise SbatchRefuses("not a batch script")
    args: list[bytes] = []
    for line in script.split(b"\n"):
        if line.startswith(b"#SBATCH"):
            rest = line[len(b"#SBATCH") :]
        elif line.startswith(b"#SLURM"):
            rest = line[len(b"#SLURM") :]
        else:
            stripped = line.lstrip(C_SPACE)
            if stripped and not stripped.startswith(b"#"):
                break  # first command: sbatch stops reading directives
            continue
        pos = 0
        while True:
            arg, pos = _get_argument(rest, pos)
            if arg is None:
                break
            args.append(arg)
    return args


def test_parser_examples() -> None:
    script = (
        b"#!/bin/bash\n"
        b"#SBATCH --job-name=\"a b\" --comment='x y'#c\n"
        b"#SBATCH   --partition=abc # comment\n"
        b'#SBATCH --account=ab\\"c\n'
        b"# plain comment\n"
        b"  #SBATCH --qos=indented-is-a-comment\n"
        b"\n"
        b"#SBATCHX\n"
        b'#SBATCH "" --after-empty\n'
        b"echo hi\n"
        b"#SBATCH --nodes=3\n"
    )
    assert parse_sbatch(script) == [
        b"--job-name=a b",
        b"--comment=x y",
        b"--partition=abc",
        b'--account=ab"c',
        b"X",
    ]
    for bad in (b"#!/bin/bash\n#SBATCH :x\n", b"#!/bin/bash\n#SBATCH 'x\n", b"#!/bin/bash\r\n"):
        with pytest.raises(SbatchRefuses):
            parse_sbatch(bad)


# --------------------------------------------------------------------------- strategies

CANARIES = [
    "$(touch pwned)",
    "`touch pwned`",
    "; touch pwned",
    "| touch pwned",
    "&& touch pwned",
    "\ntouch pwned\n",
    "' ; touch pwned ; '",
    '" ; touch pwned ; "',
    "\\",
    "'",
    '"',
    "#",
    " ",
    "\t",
    "\r\n",
    "\r",
    "\x00",
    "\x01",
    "\x7f",
    "\x0b",
    "\x0c",
    "\x85",
    "\u2028",
    "é",
    ":",
    "=",
    "--",
    "-",
    "${IFS}",
    "*",
    "~",
    "{a,b}",
    "!!",
    "%j",
    "\n#SBATCH --partition=evil",
    "#SBATCH --qos=evil",
    " --partition=evil",
    "hetjob",
    "PackJob",
    "a,b",
    "[1-2]",
]
canary = st.sampled_from(CANARIES)
tricky = st.one_of(
    st.text(max_size=20),
    canary,
    st.lists(st.one_of(canary, st.text(max_size=6)), min_size=1, max_size=5).map("".join),
)

VALID: dict[str, st.SearchStrategy[Any]] = {
    "job_name": st.from_regex(r"[A-Za-z0-9_.+-]{1,12}", fullmatch=True),
    "partition": st.sampled_from(["cpu", "gpu,debug"]),
    "account": st.sampled_from(["proj-1", "a.b"]),
    "qos": st.sampled_from(["normal", "high+"]),
    "time": st.sampled_from(["30", "1:00:00", "2-0", "UNLIMITED"]),
    "mem": st.sampled_from(["4000", "4G", "0"]),
    "gres": st.sampled_from(["gpu:2", "gpu:a100:8"]),
    "gpus_per_node": st.sampled_from(["8", "a100:8"]),
    "constraint": st.sampled_from(["intel&ib", "[r1|r2]"]),
    "reservation": st.sampled_from(["maint"]),
    "nodelist": st.sampled_from(["n[1-4],gpu01"]),
    "exclude": st.sampled_from(["n7"]),
    "signal": st.sampled_from(["B:TERM@120", "USR1@60", "10"]),
    "output": st.sampled_from(["/tmp/out-%j.log", "logs/%x.out"]),
    "error": st.sampled_from(["/tmp/err-%j.log"]),
    "open_mode": st.sampled_from(["append", "truncate"]),
}
STRING_FIELDS = sorted(VALID)
OPTION_OF = {name: name.replace("_", "-") for name in STRING_FIELDS}
KEY = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True)
OPTION_KEY = st.one_of(
    st.sampled_from(["mail-type", "comment", "wckey", "gpus", "x", "part", "no-kill", "hold"]),
    st.from_regex(r"[a-z][a-z0-9-]{0,10}", fullmatch=True),
    tricky,
)
OPTION_VALUE = st.one_of(st.none(), st.sampled_from(["END", "a:b=c", "-x"]), tricky)
EXTRA_SLOTS: dict[str, st.SearchStrategy[Any]] = {
    "sbatch_options": st.dictionaries(OPTION_KEY, OPTION_VALUE, min_size=1, max_size=3),
    "extra_directives": st.lists(
        st.one_of(
            st.tuples(st.sampled_from(["--", "#SBATCH --", "#SBATCH  --"]), OPTION_KEY)
            .map("".join)
            .flatmap(lambda k: st.one_of(st.just(k), tricky.map(lambda v: f"{k}={v}"))),
            tricky,
        ),
        min_size=1,
        max_size=2,
    ),
}
# Variables that would change the interpreter the harness runs, not the script's behaviour.
HARNESS_SENSITIVE = re.compile(r"(PYTHON|LD_|LC_|MALLOC|GLIBC_).*|LANG|LANGUAGE|PATH")


@st.composite
def specs(draw: st.DrawFn, *, fuzz_directives: bool = True, fuzz_exec: bool = True) -> JobSpec:
    """A JobSpec with valid or absent fields, a few of them replaced by hostile text."""
    fields: dict[str, Any] = {}
    for name in STRING_FIELDS:
        fields[name] = draw(VALID[name] if name == "job_name" else st.none() | VALID[name])
    fields["sbatch_options"] = draw(
        st.sampled_from([{}, {"mail-type": "END"}, {"no-kill": None, "gpus": "2"}])
    )
    fields["extra_directives"] = draw(st.sampled_from([[], ["--wckey=w", "#SBATCH --contiguous"]]))
    if fuzz_directives:
        # Up to two hostile slots per example, so that most examples still render.
        for slot in draw(st.sets(st.sampled_from([*STRING_FIELDS, *EXTRA_SLOTS]), max_size=2)):
            if slot in EXTRA_SLOTS:
                fields[slot] = draw(EXTRA_SLOTS[slot])
            else:
                fields[slot] = draw(tricky)
    fields["nodes"] = draw(st.integers(1, 4))
    fields["ntasks"] = draw(st.integers(1, 4))
    fields["cpus_per_task"] = draw(st.none() | st.integers(1, 64))
    fields["exclusive"] = draw(st.booleans())
    fields["requeue"] = draw(st.none() | st.booleans())
    env = draw(st.dictionaries(KEY, tricky if fuzz_exec else st.text(max_size=5), max_size=4))
    if fuzz_exec and draw(st.integers(0, 3)) == 0:
        env[draw(tricky)] = draw(tricky)  # a hostile variable name
    fields["environment"] = env
    args = draw(st.lists(tricky if fuzz_exec else st.text(max_size=5), max_size=4))
    keys = sorted(k for k in fields["environment"] if isinstance(k, str))
    prog = (
        "import json,os,sys; print(json.dumps([sys.argv[1:], "
        f"{{k: os.environ.get(k) for k in {keys!r}}}, os.environ.get('RSP_SETUP')]))"
    )
    fields["command"] = [sys.executable, "-c", prog, *args]
    # Trusted setup code; the comment line must not become a directive.
    fields["setup"] = ["#SBATCH --partition=from-setup", "RSP_SETUP=ran; export RSP_SETUP"]
    return JobSpec(**fields)


def expected_directives(spec: JobSpec) -> list[bytes]:
    """The arguments `spec` asks sbatch for, built independently of the renderer."""
    out = [f"--{OPTION_OF[n]}={getattr(spec, n)}" for n in STRING_FIELDS if getattr(spec, n)]
    out += [f"--nodes={spec.nodes}", f"--ntasks={spec.ntasks}"]
    if spec.cpus_per_task is not None:
        out.append(f"--cpus-per-task={spec.cpus_per_task}")
    if spec.exclusive:
        out.append("--exclusive")
    if spec.requeue is not None:
        out.append("--requeue" if spec.requeue else "--no-requeue")
    for key, value in spec.sbatch_options.items():
        out.append(f"--{key}" if value is None else f"--{key}={value}")
    for entry in spec.extra_directives:
        out.append(entry.removeprefix("#SBATCH").lstrip(" "))
    return [arg.encode() for arg in out]


def check_directives(spec: JobSpec, script: str) -> None:
    data = script.encode("utf-8")
    assert b"\0" not in data and b"\r" not in data
    parsed = parse_sbatch(data)
    assert Counter(parsed) == Counter(expected_directives(spec)), script
    for arg in parsed:
        assert arg.startswith(b"--") and not SPLITTERS.search(arg), arg
    assert b"from-setup" not in b"".join(parsed)


# --------------------------------------------------------------------------- properties


@settings(max_examples=400, deadline=None)
@given(specs(fuzz_exec=False))
def test_directive_block_is_exactly_what_was_asked(spec: JobSpec) -> None:
    try:
        script = render(spec)
    except ScriptError:
        event("refused")
        return
    event("rendered")
    check_directives(spec, script)


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="rsp-script-") as tmp:
        yield Path(tmp)


def run_script(script: str, root: Path) -> tuple[Any, list[str]]:
    """Run `script` as Slurm would (exec through its shebang) in an empty directory; return its
    JSON output and whatever files appeared in that directory."""
    bin_dir = Path(tempfile.mkdtemp(dir=root))
    work = Path(tempfile.mkdtemp(dir=root))
    job = bin_dir / "job.sbatch"
    job.write_bytes(script.encode("utf-8"))
    job.chmod(stat.S_IRWXU)
    proc = subprocess.run(
        [str(job)],
        cwd=work,
        env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": str(work)},
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == 0, (proc.stderr, script)
    created = sorted(os.listdir(work)) + sorted(set(os.listdir(bin_dir)) - {"job.sbatch"})
    shutil.rmtree(bin_dir)
    shutil.rmtree(work)
    return json.loads(proc.stdout), created


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs())
def test_rendered_script_is_exactly_what_was_asked(spec: JobSpec, sandbox: Path) -> None:
    try:
        script = render(spec)
    except ScriptError:
        event("refused")
        return
    event("rendered")
    check_directives(spec, script)
    assume(not any(HARNESS_SENSITIVE.fullmatch(k) for k in spec.environment))
    output, created = run_script(script, sandbox)
    assert created == [], script
    assert output == [list(spec.command[3:]), dict(spec.environment), "ran"], script


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    env=st.dictionaries(KEY, tricky, max_size=6),
    args=st.lists(tricky, max_size=6),
)
def test_env_and_argv_reach_the_command_verbatim(
    env: dict[str, str], args: list[str], sandbox: Path
) -> None:
    assume(not any(HARNESS_SENSITIVE.fullmatch(k) for k in env))
    keys = sorted(env)
    prog = (
        "import json,os,sys; print(json.dumps([sys.argv[1:], "
        f"{{k: os.environ.get(k) for k in {keys!r}}}]))"
    )
    spec = JobSpec("env", [sys.executable, "-c", prog, *args], environment=env)
    try:
        script = render(spec)
    except ScriptError as exc:
        event("refused")
        # Only NUL (impossible in argv/environ) and bash's own variables are refused.
        assert "\x00" in "".join([*args, *env.values()]) or "bash" in str(exc), exc
        return
    output, created = run_script(script, sandbox)
    assert created == [], script
    assert output == [args, env], script


# --------------------------------------------------------------------------- real sbatch

SLURM_CONF = """\
ClusterName=rsp-parse-only
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=1
AuthType=auth/none
NodeName=n1 CPUs=1 State=UNKNOWN
PartitionName=p Nodes=n1 Default=YES
"""
# Mutually exclusive on the command line: sbatch reads the whole script, then dies on these
# before it would contact a controller.
STOP = ["--mem=1", "--mem-per-cpu=1"]
FOUND = re.compile(rb'^sbatch: debug2: Found in script, argument "(.*)"$', re.MULTILINE)


@pytest.fixture(scope="module")
def real_sbatch(sandbox: Path) -> Any:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        pytest.skip("sbatch is not installed")
    conf = sandbox / "slurm.conf"
    conf.write_text(SLURM_CONF)

    def run(script: bytes) -> list[bytes] | None:
        """The arguments sbatch found, or None if it refused the script."""
        path = sandbox / "oracle.sbatch"
        path.write_bytes(script)
        proc = subprocess.run(
            [sbatch, "--test-only", "-vvvv", *STOP, str(path)],
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLURM_CONF": str(conf)},
            capture_output=True,
            timeout=30,
        )
        if b"fatal: " in proc.stderr and b"mutually exclusive" not in proc.stderr:
            return None
        if b"DOS line breaks" in proc.stderr or b"NULL character" in proc.stderr:
            return None
        return FOUND.findall(proc.stderr)

    probe = run(b"#!/bin/bash\n#SBATCH --job-name=probe\ntrue\n")
    if probe != [b"--job-name=probe"]:
        pytest.skip(f"sbatch cannot parse offline here: {probe!r}")
    return run


LINE_ALPHABET = st.sampled_from([*"ab-=:#'\"\\ \t\x0b\x0c\r,é", "--x", "#SBATCH"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(st.lists(LINE_ALPHABET, max_size=12).map("".join), min_size=1, max_size=3))
def test_parser_matches_real_sbatch(lines: list[str], real_sbatch: Any) -> None:
    assume(not any(SPLITTERS.search(line.encode()) for line in lines))
    body = "".join(
        f"#SBATCH {line}\n" if i % 2 == 0 else f"{line}\n" for i, line in enumerate(lines)
    )
    script = f"#!/bin/bash\n{body}true\n".encode()
    try:
        mine: list[bytes] | None = parse_sbatch(script)
    except SbatchRefuses:
        mine = None
    event("refused" if mine is None else f"{len(mine)} arguments")
    assert real_sbatch(script) == mine, script


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(fuzz_exec=False))
def test_real_sbatch_reads_exactly_what_was_asked(spec: JobSpec, real_sbatch: Any) -> None:
    try:
        script = render(spec)
    except ScriptError:
        event("refused")
        return
    event("rendered")
    found = real_sbatch(script.encode("utf-8"))
    assert found is not None and Counter(found) == Counter(expected_directives(spec)), script


@pytest.mark.parametrize("name", ["minimal_cpu", "full_gpu", "env_metachars"])
def test_real_sbatch_reads_the_golden_files_like_our_parser(name: str, real_sbatch: Any) -> None:
    script = (Path(__file__).resolve().parent.parent / "golden" / f"{name}.sbatch").read_bytes()
    found = real_sbatch(script)
    assert found is not None and found == parse_sbatch(script)
    assert all(arg.startswith(b"--") and not SPLITTERS.search(arg) for arg in found)

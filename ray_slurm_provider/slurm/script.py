"""Render a `JobSpec` into a Slurm batch script: a pure, deterministic function.

How sbatch reads the `#SBATCH` block (src/sbatch/opt.c, `_opt_batch_script` and
`_get_argument`; checked against the installed sbatch 22.05.8 binary): the script is split on
"\\n" only; a line whose first bytes are exactly `#SBATCH` (no leading blanks, no word
boundary: `#SBATCHX` yields the argument `X`) is cut into arguments at C `isspace` characters
(space, \\t, \\v, \\f, \\r), where `'` and `"` group, a backslash escapes the next byte and an
unquoted `#` ends the line; lines that are blank or start (after blanks) with `#` are skipped,
and the first other line ends the scan (`#SLURM` lines count too). An argument starting with `:`
is fatal, and a `hetjob`/`packjob` argument (any case) is taken as a heterogeneous-job separator
(22.05.8 then drops the rest of that line); 18.08 blanked those words anywhere in the line and
slurmctld's burst-buffer scan still looks for them as substrings. The arguments then go through
getopt_long, which accepts any unambiguous prefix of a long option (`--partit=x` sets the
partition) and splits `--key=value` at the first `=`. sbatch refuses scripts that contain NUL
or "\\r\\n".

So each directive is rendered as one argument, `#SBATCH --key=value`, whose value is drawn from
a per-field charset free of blanks, quotes, backslashes, `#` and control characters, and never
contains `hetjob`/`packjob`; anything else is a `ScriptError`, never an escaped value.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

from ray_slurm_provider.slurm.spec import JobSpec

__all__ = ["JobSpec", "ScriptError", "render", "user_options", "validate"]


class ScriptError(ValueError):
    """A `JobSpec` field holds a value that cannot be rendered safely."""


_NAME = "[A-Za-z0-9_.+-]+"
_NAMES = f"{_NAME}(?:,{_NAME})*"
_NAME_ALLOWED = "letters, digits and _ . + -"
_NUM, _TWO = "[0-9]+", "[0-9]{1,2}"
_TIME = f"{_NUM}(?::{_TWO}){{0,2}}|{_NUM}-{_TWO}(?::{_TWO}){{0,2}}|(?i:unlimited|infinite)"
# Printable ASCII without space, quotes ("'), backslash and '#': one sbatch argument, verbatim.
_SAFE = "[!$-&(-\\[\\]-~]+"
_SAFE_ALLOWED = "printable ASCII without blanks, quotes, backslashes or #"
_HOSTS = "[A-Za-z0-9_.,/\\[\\]-]+"
_INT, _FLAG = "<int>", "<flag>"  # markers in the pattern column

# (field, sbatch long option, value pattern, what is allowed), in rendering order.
_TYPED: tuple[tuple[str, str, str, str], ...] = (
    ("job_name", "job-name", _NAME, _NAME_ALLOWED),
    ("partition", "partition", _NAMES, f"comma-separated names of {_NAME_ALLOWED}"),
    ("account", "account", _NAME, _NAME_ALLOWED),
    ("qos", "qos", _NAME, _NAME_ALLOWED),
    ("time", "time", _TIME, "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, UNLIMITED, INFINITE"),
    ("nodes", "nodes", _INT, "an integer >= 1"),
    ("ntasks", "ntasks", _INT, "an integer >= 1"),
    ("cpus_per_task", "cpus-per-task", _INT, "None or an integer >= 1"),
    ("mem", "mem", f"{_NUM}[KMGTkmgt]?", "a whole number with an optional K/M/G/T suffix"),
    ("gres", "gres", "[A-Za-z0-9_.:,/+-]+", "a GRES list such as gpu:2 or gpu:a100:8"),
    ("gpus_per_node", "gpus-per-node", "[A-Za-z0-9_.:,-]+", "a count or type:count, e.g. a100:8"),
    ("constraint", "constraint", "[A-Za-z0-9_.,&|*\\[\\]()!:+-]+", "a node feature expression"),
    ("exclusive", "exclusive", _FLAG, "True or False"),
    ("reservation", "reservation", _NAMES, f"comma-separated names of {_NAME_ALLOWED}"),
    ("nodelist", "nodelist", _HOSTS, "a hostlist such as n[1-4],gpu01"),
    ("exclude", "exclude", _HOSTS, "a hostlist such as n[1-4],gpu01"),
    (
        "signal",
        "signal",
        "(?:(?:R|B|RB|BR):)?(?:[0-9]+|[A-Za-z][A-Za-z0-9]*)(?:@[0-9]+)?",
        "[{R|B}:]<signal name or number>[@seconds], e.g. B:TERM@120",
    ),
    ("output", "output", _SAFE, f"a path of {_SAFE_ALLOWED}"),
    ("error", "error", _SAFE, f"a path of {_SAFE_ALLOWED}"),
    ("open_mode", "open-mode", "append|truncate", "append or truncate"),
    ("requeue", "requeue", _FLAG, "True, False or None"),
)
_OPTIONAL = frozenset({"cpus_per_task", "requeue"})  # non-string fields that may be None

#: Long options the typed fields own (sbatch_options/extra_directives may not set them), mapped
#: to the field to use instead.
RESERVED_OPTIONS: dict[str, str] = {opt: name for name, opt, _, _ in _TYPED}
RESERVED_OPTIONS["no-requeue"] = "requeue"
#: Options the provider itself decides, with why (no JobSpec field stands for them).
PROVIDER_OPTIONS: dict[str, str] = {
    "array": "the provider submits N nodes of a type as one job array itself",
    "wait": "sbatch would block the autoscaler until the job ends",
    "export": "the provider decides which environment the job's agent starts with",
    "wrap": "the provider's batch script is the job",
    "parsable": "the provider reads sbatch's answer in its own format",
    "test-only": "the job would never run",
}
# getopt_long takes any unambiguous prefix (`--partit=x` is --partition) but prefers an exact
# match, so a real option that is also a prefix of a reserved one does not abbreviate it.
_EXACT_PREFIX_OPTIONS = frozenset({"gpus"})
_OPTION_KEY = re.compile("[a-z][a-z0-9-]*")
_SPLITTERS = re.compile("hetjob|packjob", re.IGNORECASE)
_ENV_KEY = re.compile("[A-Za-z_][A-Za-z0-9_]*")
#: Bash variables that are readonly (export fails, and `set -e` ends the script) or that bash
#: rewrites itself, so the command would not see the value asked for (checked on bash 5.2).
BASH_SPECIAL_VARIABLES = frozenset(
    (
        "_ BASHOPTS BASHPID BASH_ALIASES BASH_ARGC BASH_ARGV BASH_CMDS BASH_COMMAND BASH_LINENO "
        "BASH_SOURCE BASH_SUBSHELL BASH_VERSINFO DIRSTACK EPOCHREALTIME EPOCHSECONDS EUID "
        "FUNCNAME GROUPS HISTCMD LINENO OPTIND PIPESTATUS PPID RANDOM SECONDS SHELLOPTS SHLVL "
        "SRANDOM UID"
    ).split()
)
_SHEBANG = re.compile("#!/(?:[!-~]*/)?(?:env[ \t]+)?bash(?:[ \t]+[!-~]+)*")
_CONTROL = re.compile("[\x00-\x1f\x7f]")
_ESCAPES = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _fail(name: str, value: object, allowed: str) -> ScriptError:
    return ScriptError(f"JobSpec.{name}: invalid value {value!r}; allowed: {allowed}")


def _text(name: str, value: object, *, forbid: str = "\x00") -> str:
    """A str that encodes as UTF-8 and holds none of `forbid`."""
    if not isinstance(value, str):
        raise _fail(name, value, "a string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _fail(name, value, "text encodable as UTF-8 (no lone surrogates)") from None
    if any(ch in value for ch in forbid):
        raise _fail(name, value, f"text without any of {forbid!r}")
    return value


def _value(name: str, value: object, pattern: str, allowed: str) -> str:
    text = _text(name, value)
    if not re.fullmatch(pattern, text):
        raise _fail(name, text, allowed)
    if _SPLITTERS.search(text):
        raise _fail(name, text, f"{allowed}; never hetjob/packjob (sbatch splits the job there)")
    return text


def _option_key(name: str, key: object) -> str:
    if not isinstance(key, str) or not _OPTION_KEY.fullmatch(key):
        raise _fail(name, key, "a long sbatch option name matching [a-z][a-z0-9-]*, without --")
    for opt, owner in RESERVED_OPTIONS.items():
        if key == opt or (opt.startswith(key) and key not in _EXACT_PREFIX_OPTIONS):
            raise _fail(name, key, f"not --{opt} or a prefix of it: set JobSpec.{owner} instead")
    for opt, why in PROVIDER_OPTIONS.items():
        if key == opt or (opt.startswith(key) and len(key) >= 3):
            raise _fail(name, key, f"not --{opt} or a prefix of it: the provider owns it ({why})")
    return _value(name, key, _OPTION_KEY.pattern, "an option name")


def _strings(name: str, value: object) -> list[object]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise _fail(name, value, "a list of strings (not a single string)")
    return list(value)


def _extra(name: str, entry: object) -> tuple[str, str | None]:
    text = _text(name, entry)
    body = text
    if text.startswith("#SBATCH "):
        body = text[len("#SBATCH ") :].lstrip(" ")
    key, eq, value = body.partition("=")
    if not key.startswith("--"):
        raise _fail(name, text, "one '--option[=value]', optionally after '#SBATCH '")
    _option_key(name, key[2:])
    if eq:
        _value(name, value, _SAFE, _SAFE_ALLOWED)
    return key[2:], value if eq else None


def _typed(spec: JobSpec) -> list[str]:
    """Validate the typed directive fields; return their `--key[=value]` arguments in order."""
    out: list[str] = []
    for name, opt, pattern, allowed in _TYPED:
        value = getattr(spec, name)
        if value is None and (name in _OPTIONAL or pattern not in (_INT, _FLAG)):
            if name == "job_name":
                raise _fail(name, value, allowed)
        elif pattern == _INT:
            if type(value) is not int or value < 1:
                raise _fail(name, value, allowed)
            out.append(f"--{opt}={value}")
        elif pattern == _FLAG:
            if not isinstance(value, bool):
                raise _fail(name, value, allowed)
            if name == "requeue":
                out.append("--requeue" if value else "--no-requeue")
            elif value:
                out.append(f"--{opt}")
        else:
            out.append(f"--{opt}={_value(name, value, pattern, allowed)}")
    return out


def user_options(spec: JobSpec) -> list[tuple[str, str | None]]:
    """The user's own sbatch options, validated, as (long option, value or None for a flag):
    `sbatch_options` sorted by name, then `extra_directives` in order, as they are rendered.
    Each is ONE sbatch argument `--key[=value]` (see the module docstring), so this is how
    sbatch reads it; back ends that cannot hand sbatch the script translate these pairs."""
    options = spec.sbatch_options
    if not isinstance(options, Mapping):
        raise _fail("sbatch_options", options, "a mapping of option name to value or None")
    out: list[tuple[str, str | None]] = []
    for key in sorted(_option_key("sbatch_options", key) for key in options):
        value = options[key]
        if value is not None:
            allowed = f"None (a flag) or {_SAFE_ALLOWED}"
            value = _value(f"sbatch_options[{key!r}]", value, _SAFE, allowed)
        out.append((key, value))
    for i, entry in enumerate(_strings("extra_directives", spec.extra_directives)):
        out.append(_extra(f"extra_directives[{i}]", entry))
    return out


def _quote(word: str) -> str:
    """One shell word for bash. Words with ASCII control characters use ANSI-C quoting
    ($'...'), so the script holds no raw control bytes (sbatch rejects "\\r\\n"; raw newlines
    would make line-oriented reading of the script ambiguous); the rest use shlex.quote."""
    if not _CONTROL.search(word):
        return shlex.quote(word)
    escaped = (
        _ESCAPES.get(ch) or (f"\\x{ord(ch):02x}" if _CONTROL.match(ch) else ch) for ch in word
    )
    return "$'" + "".join(escaped) + "'"


def _body(spec: JobSpec) -> list[str]:
    """Validate every field; return the script's lines."""
    shebang = _text("shebang", spec.shebang)
    if not _SHEBANG.fullmatch(shebang):
        raise _fail("shebang", shebang, "a bash interpreter line, e.g. '#!/bin/bash -l'")
    args = _typed(spec)  # validated first: its errors come before the user options' ones
    args += (f"--{key}" if value is None else f"--{key}={value}"
             for key, value in user_options(spec))
    lines = [shebang, *(f"#SBATCH {arg}" for arg in args)]
    # A command right after the directives ends sbatch's #SBATCH scan, so no later line (a
    # comment-only setup line, say) can become a directive. -e and pipefail make a failing
    # setup line (module load, source) end the job instead of starting the command in a broken
    # environment; -u is left out because activate scripts, conda hooks and Lmod/Environment
    # Modules init files read unset variables and would abort under it.
    lines.append("set -eo pipefail")
    env = spec.environment
    if not isinstance(env, Mapping):
        raise _fail("environment", env, "a mapping of variable name to value")
    for key in sorted(_text("environment", key) for key in env):
        if not _ENV_KEY.fullmatch(key) or key in BASH_SPECIAL_VARIABLES:
            raise _fail(
                "environment",
                key,
                "a name matching [A-Za-z_][A-Za-z0-9_]*, not a readonly or dynamic bash "
                "variable (UID, SHLVL, RANDOM, _, ...: see BASH_SPECIAL_VARIABLES)",
            )
        lines.append(f"export {key}={_quote(_text(f'environment[{key!r}]', env[key]))}")
    for i, line in enumerate(_strings("setup", spec.setup)):
        # Trusted shell code, verbatim (may span lines); only what sbatch refuses is rejected.
        lines.append(_text(f"setup[{i}]", line, forbid="\x00\r"))
    argv = [_text(f"command[{i}]", arg) for i, arg in enumerate(_strings("command", spec.command))]
    if not argv or not argv[0] or argv[0].startswith("-"):
        raise _fail("command", spec.command, "a non-empty argv whose program does not start with -")
    # exec: the command replaces bash, so it is the batch step's main process and receives
    # Slurm's signals itself (scancel, --signal=B:..., time-limit SIGTERM); bash would defer
    # them while it waits and would not forward them to the child.
    lines.append("exec " + " ".join(_quote(arg) for arg in argv))
    return lines


def validate(spec: JobSpec) -> None:
    """Raise ScriptError, naming the field, the bad value and what is allowed, if `spec` cannot
    be rendered safely."""
    _body(spec)


def render(spec: JobSpec) -> str:
    """The batch script for `spec`; deterministic (options and environment sorted by name)."""
    return "\n".join(_body(spec)) + "\n"

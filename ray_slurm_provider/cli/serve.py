"""`python -m ray_slurm_provider.cli.serve`: the login node's half of a `ray-slurm` command
run from a laptop (cli/remote.py). One request on stdin (the command line and the config);
what the command prints, then the reply as the last line after wire.MARKER, as the
provider's serve.py answers Ray's calls."""

from __future__ import annotations

import json
import sys
from typing import Any

from ray_slurm_provider.cli import remote
from ray_slurm_provider.cli.main import main as cli_main
from ray_slurm_provider.provider.wire import MARKER, error_reply


def main() -> int:
    request = json.loads(sys.stdin.read())
    try:
        reply: dict[str, Any] = {"ok": remote.run(request, cli_main)}
    except Exception as e:  # crosses back to the laptop, typed, like serve's
        reply = {"error": error_reply(e)}
    sys.stdout.flush()
    sys.stdout.write("\n" + MARKER + json.dumps(reply) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

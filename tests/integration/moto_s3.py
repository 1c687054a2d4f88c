"""moto's standalone S3 server on 127.0.0.1 for the checkpoint-staging tests: nothing touches AWS.

`moto_s3()` starts `moto_server` on a free port, waits until it answers (a deadline, no fixed
sleep), points boto3's environment at fake credentials and the local endpoint, and stops the
server by its pid afterwards.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ray_slurm_provider.gang.rendezvous import probe_free_port

FAKE_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}


@contextmanager
def moto_s3(log_dir: Path) -> Iterator[str]:
    port = probe_free_port("127.0.0.1")
    endpoint = f"http://127.0.0.1:{port}"
    exe = Path(sys.executable).with_name("moto_server")
    saved = {k: os.environ.get(k) for k in [*FAKE_AWS, "AWS_ENDPOINT_URL"]}
    os.environ.update(FAKE_AWS, AWS_ENDPOINT_URL=endpoint)
    with (log_dir / "moto.log").open("wb") as log:
        proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(endpoint + "/", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start: "
                                       f"{(log_dir / 'moto.log').read_text()[-2000:]}") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

"""The login node's half of `provider.ssh`: one provider or runner call per process.

`ray up` on a laptop (laptop.py) cannot touch the cluster directory, which lives on the login
node's filesystem, nor run Slurm's commands. So each of its calls runs here, on the login
node, as `<provider.python> -m ray_slurm_provider.provider.serve` over the one SSH
connection: a JSON request on stdin, the same SlurmNodeProvider and SrunCommandRunner as a
`ray up` on the login node (the config without `ssh`), and the reply as the last line of
stdout after MARKER. So every rule -- listings, hand-off files, their locks, tags, the token
-- has one home, used alike from the login node and from a laptop. What the called code
prints (a command's output, `ray start`'s progress) comes before the reply.

A fresh provider per call is what the head's autoscaler meets after a restart: Slurm and the
cluster directory hold the state, so every call but a listing lists first.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any

from ray_slurm_provider.provider.forward import targets
from ray_slurm_provider.provider.wire import MARKER, error_reply, login_config, pack, unpack

#: NodeProvider calls a laptop forwards; every one but these lists first.
PROVIDER_OPS = frozenset({
    "non_terminated_nodes", "node_tags", "is_running", "is_terminated", "internal_ip",
    "external_ip", "set_node_tags", "create_node", "create_node_with_resources_and_labels",
    "terminate_node", "terminate_nodes", "nodes_for_teardown", "cleanup_cluster_resources",
    "prepare_for_head_node", "describe_job",
})
_NO_LISTING = frozenset({"non_terminated_nodes", "nodes_for_teardown", "prepare_for_head_node"})


def snapshot(provider: Any, ids: list[str]) -> dict[str, Any]:
    """What Ray asks of each listed node, answered by the provider from its listing."""
    return {i: {"tags": provider.node_tags(i), "running": provider.is_running(i),
                "internal_ip": provider.internal_ip(i), "external_ip": provider.external_ip(i)}
            for i in ids}


def handle(request: dict[str, Any]) -> Any:
    """Run one request; the value to reply with."""
    from ray_slurm_provider.provider.provider import SlurmNodeProvider

    op = str(request["op"])
    args = list(request.get("args") or [])
    if op == "version":
        from importlib.metadata import version

        return {"package": version("ray-slurm-provider"), "python": sys.version.split()[0]}
    provider = SlurmNodeProvider(login_config(request["provider"]), request["cluster_name"])
    if op not in _NO_LISTING:
        provider.non_terminated_nodes({})  # the records every other call answers from
    if op == "non_terminated_nodes":
        ids = provider.non_terminated_nodes(*args)
        return {"ids": ids, "nodes": snapshot(provider, ids)}
    if op == "prepare_for_head_node":
        return provider.prepare_for_head_node(*args)
    if op in PROVIDER_OPS:
        out = getattr(provider, op)(*args)
        if op.startswith("create_node") and isinstance(out, dict):
            return {node_id: None for node_id in out}  # the ids; Ray ignores the rest
        return out
    runner = provider.get_command_runner(str(request.get("log_prefix", "")),
                                         str(request["node_id"]), {}, provider.cluster_name,
                                         None, True)
    if op == "run":
        kwargs = dict(request.get("kwargs") or {})
        out = runner.run(*args, **kwargs)
        return out.decode(errors="replace") if isinstance(out, bytes) else out
    if op == "rsync_up":
        files, name, target = str(args[0]), str(args[1]), str(args[2])
        stage = tempfile.mkdtemp(prefix="rsync-", dir=os.path.expanduser(
            provider.pcfg.state_dir))  # 0700, on the login node
        try:
            unpack(files, stage)
            runner.run_rsync_up(os.path.join(stage, name), target)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return None
    if op == "forward_targets":  # `ray dashboard`, `ray exec --port-forward`
        head = provider.cluster_dir.read_head()
        if head is None:
            raise RuntimeError("the head's Ray is not up, nothing to forward to")
        return targets([(int(a), int(b)) for a, b in args[0]], head.ip,
                       runner.moved_ports(head))
    if op == "rsync_down":
        source = str(args[0])
        stage = tempfile.mkdtemp(prefix="rsync-", dir=os.path.expanduser(
            provider.pcfg.state_dir))  # 0700, on the login node
        try:
            got = os.path.join(stage, os.path.basename(source.rstrip("/")) or "files")
            runner.run_rsync_down(source, got)
            files, name = pack(got)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return {"files": files, "name": name}
    raise ValueError(f"unknown request {op!r}")


def reply_line(request: dict[str, Any]) -> str:
    """The reply to `request`, as the last line of stdout."""
    try:
        reply: dict[str, Any] = {"ok": handle(request)}
    except Exception as e:  # every error crosses back to the laptop, typed
        reply = {"error": error_reply(e)}
    return "\n" + MARKER + json.dumps(reply) + "\n"


def main() -> int:
    # A `ray up` on the login node runs with provider.python's environment active; so does
    # this one: its jobs' `python` and `ray` (a Ray job's entrypoint, `ray exec 'ray status'`)
    # are that environment's, not the SSH session's bare PATH.
    here = os.path.dirname(sys.executable)
    os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
    request = json.loads(sys.stdin.read())
    line = reply_line(request)
    sys.stdout.flush()
    sys.stdout.write(line)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

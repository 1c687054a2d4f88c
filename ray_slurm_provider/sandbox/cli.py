"""``ray-slurm sandbox up|status|down``."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from typing import Any

from ray_slurm_provider import proc
from ray_slurm_provider.sandbox import (
    config,
    daemons,
    login,
    pyslurmwheel,
    pyxis,
    roots,
    source,
    strict,
    users,
)
from ray_slurm_provider.sandbox.core import STATE_DIR_ENV, Sandbox
from ray_slurm_provider.sandbox.procs import SandboxError


def register(sub: Any) -> None:
    """Add the ``sandbox`` command group to a ``ray-slurm`` subparsers object."""
    p = sub.add_parser("sandbox", help="a real multi-node Slurm cluster on this machine (root)",
                       description="A local Slurm cluster for tests and development: munged, "
                       "slurmctld, N slurmd (n1..nN on 127.0.0.2..), slurmrestd with JWT and, "
                       "with --docker, a private dockerd. Everything lives in one state dir.")
    ssub = p.add_subparsers(dest="sandbox_command", metavar="{up,status,image,down}")
    ssub.required = True

    up = ssub.add_parser("up", help="start the sandbox (idempotent) and print its exports")
    up.add_argument("--nodes", type=int, default=3, help="number of nodes (default 3)")
    up.add_argument("--gpus-per-node", type=int, default=2,
                    help="fake GPUs per node (default 2; 0: no gpu partition)")
    up.add_argument("--cpus-per-node", type=int, default=2, help="CPUs per node (default 2)")
    up.add_argument("--memory-per-node", type=int, default=4000, metavar="MB",
                    help="RealMemory per node in MB (default 4000)")
    up.add_argument("--docker", action="store_true",
                    help="also start a private dockerd (DOCKER_HOST) and a container Epilog")
    up.add_argument("--users", type=int, default=0, metavar="N",
                    help="also create N throwaway Unix users (rsp-u1..) with homes under the "
                    "state dir, who submit through the sandbox's munge and, with --docker, "
                    "use its dockerd through the group rsp-sbx; `down` deletes them")
    up.add_argument("--slurm", default=roots.HOST_RELEASE, choices=tuple(roots.RELEASES),
                    help=f"Slurm release (default {roots.HOST_RELEASE}, the host's packages; "
                    f"{', '.join(roots.SOURCE)} is built once from its release tarball in "
                    f"${pyxis.VENDOR_ENV}; the others run from a Debian root debootstrapped "
                    f"once; both cached in ${roots.CACHE_ENV} or {roots.DEFAULT_CACHE})")
    up.add_argument("--accounting", action="store_true",
                    help="also run slurmdbd on a private MariaDB with an account tree, the "
                    "users as associations, QOSes normal/high/scavenger/limited (high "
                    "preempts scavenger; limited: 2 jobs per user) and typed GPUs")
    up.add_argument("--pyxis", action="store_true",
                    help="also build enroot and the pyxis SPANK plugin once into the cache "
                    f"(from the release tarballs in ${pyxis.VENDOR_ENV}, default "
                    "<project>/../shared/vendor) and load pyxis: `srun --container-image`; "
                    "env.sh puts the sandbox's enroot on PATH")
    up.add_argument("--pyslurm", action="store_true",
                    help="also build pyslurm from PyPI against the sandbox's Slurm (25.11 "
                    "only: pyslurm X.Y needs Slurm X.Y) once into the cache and install it "
                    "into the Python running ray-slurm")
    up.add_argument("--login", action="store_true",
                    help="also run an sshd (openssh-server, as a plain process) on "
                    "127.0.0.1:6822 (plus the port offset) as the login node, with a host key, "
                    "known_hosts and a key pair per user (needs --users N)")
    up.add_argument("--strict", action="store_true",
                    help="a strict controller (--slurm 25.11 or 26.05): per-user RPC rate "
                    "limiting with a small bucket, MinJobAge=30, PrivateData=jobs; root and "
                    "SlurmUser are exempt, so run the cluster as a --users user")
    up.add_argument("--cgroups", action="store_true",
                    help="TaskPlugin=task/cgroup with ConstrainCores and ConstrainRAMSpace "
                    "(cgroup v1; the host's 22.05 only)")
    up.add_argument("--install", action="store_true",
                    help="apt-get install the missing packages instead of failing")
    up.add_argument("--port-offset", type=int, default=0,
                    help="add this to every daemon port, to run a second sandbox beside "
                    "another (default 0: slurmctld 6817, slurmrestd 6820, slurmd 6831+)")
    _state_dir_arg(up)
    up.set_defaults(func=cmd_up)

    st = ssub.add_parser("status", help="daemons and nodes; exit 0 only when all is up")
    _state_dir_arg(st)
    st.set_defaults(func=cmd_status)

    img = ssub.add_parser("image", help="build the sandbox's Ray node image (no registry "
                          "needed)")
    img.add_argument("--tag", default=None, help="image tag (default rsp-bind:latest); for "
                     "apptainer the image directory (default <state dir>/shared/rsp-bind), "
                     "for enroot (and pyxis) the squashfs file (default <state "
                     "dir>/shared/rsp-bind.sqsh)")
    img.add_argument("--runtime", default="docker",
                     choices=("docker", "podman", "apptainer", "enroot"))
    _state_dir_arg(img)
    img.set_defaults(func=cmd_image)

    down = ssub.add_parser("down", help="stop everything `up` started and remove the state dir")
    _state_dir_arg(down)
    down.set_defaults(func=cmd_down)


def cmd_image(args: argparse.Namespace) -> int:
    from ray_slurm_provider.sandbox import image

    t0 = time.monotonic()
    tag = args.tag or image.DEFAULT_TAG
    if args.runtime in image.FILE_NAMES and args.tag is None:
        shared = Sandbox(args.state_dir).layout.shared_dir
        tag = os.path.join(shared, image.FILE_NAMES[args.runtime])
    try:
        tag = image.build(tag, args.runtime)
    except (proc.CommandError, OSError) as e:
        return _fail("image", e)
    print(f"built {tag} in {time.monotonic() - t0:.1f}s")
    return 0


def _state_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", default=None,
                   help=f"state directory (default: ${STATE_DIR_ENV} or /tmp/rsp-sandbox)")


def _fail(command: str, err: Exception) -> int:
    print(f"ray-slurm sandbox {command}: error: {err}", file=sys.stderr)
    return 1


def cmd_up(args: argparse.Namespace) -> int:
    try:
        sb = Sandbox(args.state_dir, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                     cpus_per_node=args.cpus_per_node,
                     memory_mb_per_node=args.memory_per_node, docker=args.docker,
                     port_offset=args.port_offset, users=args.users, slurm=args.slurm,
                     accounting=args.accounting, pyxis=args.pyxis, pyslurm=args.pyslurm,
                     login=args.login, strict=args.strict, cgroups=args.cgroups)
        t0 = time.monotonic()
        env = sb.up(install=args.install)
    except (SandboxError, ValueError) as e:
        return _fail("up", e)
    spec = sb.spec
    last = config.node_addr(spec.nodes)
    print(f"# Slurm {spec.slurm} sandbox up in {time.monotonic() - t0:.1f}s: {spec.nodes} node(s) "
          f"{config.hostlist(spec.nodes)} on 127.0.0.2..{last}, {spec.cpus_per_node} CPUs, "
          f"{spec.memory_mb_per_node} MB, {spec.gpus_per_node} fake GPU(s) each; "
          f"state in {sb.state_dir}")
    for user in sb.users():
        print(f"# user {user.name} (uid {user.uid}), home {user.home}: "
              f"runuser -u {user.name} -- bash -c 'source {sb.layout.env_file}; cd; sinfo'")
    if spec.login:
        print(f"# login node: sshd on {login.LOGIN_HOST}:{login.ssh_port(spec.port_offset)}: "
              f"ssh -F {login.client_config(sb.layout)} "
              f"{users.user_names(1, spec.port_offset)[0]}@{login.HOST_ALIAS} sinfo")
    if spec.pyxis:
        build = pyxis.build_for(spec.slurm)
        print(f"# enroot {pyxis.ENROOT_VERSION} ({build.enroot_prefix}) and pyxis "
              f"{pyxis.PYXIS_VERSION} ({build.plugin}): srun --container-image=FILE.sqsh; "
              "`ray-slurm sandbox image --runtime enroot` writes one")
    if spec.pyslurm:
        wheel = pyslurmwheel.Wheel(source.install_for(spec.slurm)).path()
        print(f"# pyslurm {pyslurmwheel.VERSIONS[spec.slurm]} installed into {sys.executable} "
              f"from {wheel}; `import pyslurm` needs SLURM_CONF (env.sh sets it)")
    for key in sorted(env):
        print(f"export {key}={shlex.quote(env[key])}")
    print(f"""# Use it from a shell:  source {sb.layout.env_file}
#   sinfo -N -o '%N %P %T %c %m %G'
#   sbatch -p cpu -w n2 --wrap 'echo hello from $SLURMD_NODENAME'   # output in ./slurm-<id>.out
#   srun -p gpu --gres=gpu:1 bash -c 'echo $CUDA_VISIBLE_DEVICES'""")
    if spec.gpus_per_node == 0:
        print("#   (no gpu partition: started with --gpus-per-node 0)")
    print("#   ray-slurm sandbox status;  ray-slurm sandbox down")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    try:
        sb = Sandbox(args.state_dir)
        st = sb.status()
    except (SandboxError, ValueError) as e:
        return _fail("status", e)
    if not st.daemons:
        print(f"no sandbox at {st.state_dir}")
        return 1
    print(f"sandbox at {st.state_dir}: {'running' if st.running else 'NOT fully running'}"
          f"; Slurm {st.slurm}")
    width = max(len(n) for n in st.daemons)
    for name, pid in st.daemons.items():
        print(f"  {name:<{width}}  {pid if pid is not None else '-- not running'}")
    if st.daemons.get("slurmctld") is not None:
        try:
            res = proc.run(["sinfo", "-N", "-o", "%N %P %T %c %m %G"],
                           env=daemons.client_env(sb.layout), timeout=20)
            print(res.stdout.rstrip())
        except proc.CommandError as e:
            print(f"sinfo failed: {e}")
        if st.strict:
            _print_strict(sb)
    return 0 if st.running else 1


def _print_strict(sb: Sandbox) -> None:
    """The strict settings as the running slurmctld reports them."""
    try:
        res = proc.run(["scontrol", "show", "config"], env=daemons.client_env(sb.layout),
                       timeout=20)
    except proc.CommandError as e:
        print(f"scontrol show config failed: {e}")
        return
    print("strict: " + "; ".join(strict.config_lines(res.stdout)))


def cmd_down(args: argparse.Namespace) -> int:
    sb = Sandbox(args.state_dir)
    t0 = time.monotonic()
    try:
        sb.down()
    except (SandboxError, ValueError) as e:
        return _fail("down", e)
    print(f"sandbox at {sb.state_dir} is down ({time.monotonic() - t0:.1f}s)")
    return 0

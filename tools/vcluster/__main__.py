"""`python -m vcluster` (scripts/virtual_cluster.sh): argparse sub-commands. Bad input and a missing privilege are
one line and exit code 2; a failed set-up is one line and exit code 1."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

from . import cluster, nodes, slurm
from .nodes import NodesError, SetupError


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise NodesError(f"{message} (see {self.prog} --help)")


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="virtual_cluster.sh", description="Virtual nodes (network namespaces) and a real Slurm on "
                                                          "them, for rehearsing multi-node launches. Needs root.")
    verbs = top.add_subparsers(dest="verb", required=True, metavar="COMMAND", parser_class=_Parser)
    cmd = verbs.add_parser("up", help="make node1..nodeN (replacing the nodes that are up)")
    cmd.add_argument("n", metavar="N", help=f"how many nodes, 1 to {nodes.MAX_NODES}")
    cmd.add_argument("--slurm", action="store_true", help="also start Slurm on them (needs `install` once)")
    verbs.add_parser("down", help="remove the nodes, their daemons and whatever runs on them (safe to repeat)")
    verbs.add_parser("status", help="the nodes, their addresses and processes, and Slurm's view")
    cmd = verbs.add_parser("exec", help="run a command on a node")
    cmd.add_argument("node", metavar="NODE")
    cmd.add_argument("cmd", metavar="CMD", nargs=argparse.REMAINDER)
    verbs.add_parser("rsh", help="ssh's syntax, for mpirun's rsh agent and horovodrun: rsh [ssh options] HOST CMD...")
    cmd = verbs.add_parser("slurm", help="start or stop munged, slurmctld and the slurmd")
    cmd.add_argument("action", choices=("up", "down"))
    cmd = verbs.add_parser("hosts", help="map each node's own name to 127.0.1.1 (loopback) or to its address")
    cmd.add_argument("mapping", choices=("loopback", "cluster"))
    verbs.add_parser("install", help=f"apt-get install {' '.join({**slurm.PACKAGES, **slurm.FIREWALL})} if missing")
    return top


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["rsh"]:  # ssh's own syntax (options before and after the host), not ours to parse
            nodes.require_root()
            cmd = nodes.rsh_command(argv[1:])
            os.execvp(cmd[0], cmd)
        args = parser().parse_args(argv)
        if args.verb == "up":
            n = nodes.node_count(args.n)
            nodes.require_root()
            with nodes.lock(timeout=5):  # not while a test or a notebook uses the nodes
                cluster.up(n, with_slurm=args.slurm)
            return 0
        nodes.require_root()
        if args.verb == "down":
            with nodes.lock(timeout=5):
                cluster.down()
        elif args.verb == "status":
            print(nodes.status())
        elif args.verb == "exec":
            if not args.cmd:
                raise NodesError("exec needs a node and a command: exec NODE CMD...")
            cmd = nodes.command(args.node, args.cmd)
            os.execvp(cmd[0], cmd)
        elif args.verb == "slurm" and args.action == "up":
            slurm.up()
        elif args.verb == "slurm":
            slurm.down()
        elif args.verb == "hosts":
            nodes.self_on_loopback(args.mapping == "loopback")
            print(f"hosts: every node's own name maps to "
                  f"{nodes.LOOPBACK_SELF if args.mapping == 'loopback' else 'its cluster address'}")
        elif args.verb == "install":
            slurm.install()
            print("install: Slurm, munge and nftables are installed")
    except NodesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (SetupError, subprocess.SubprocessError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

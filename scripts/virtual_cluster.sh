#!/usr/bin/env bash
# A real multi-node cluster on this machine, for rehearsing a workshop and for the tests (notebook 06).
#
#   scripts/virtual_cluster.sh up 2 [--slurm]     node1 (10.77.0.1) and node2 (10.77.0.2), each a network namespace
#                                                 with its own interface eth0, address and host name, on one switch
#   scripts/virtual_cluster.sh exec node2 CMD...  run CMD on node2 (same files, same environment, node2's network)
#   scripts/virtual_cluster.sh install            apt-get install slurm-wlm munge nftables (once per machine)
#   scripts/virtual_cluster.sh slurm up|down      munge + slurmctld on node1 + slurmd on every node
#   scripts/virtual_cluster.sh hosts loopback     the wrong-interface pitfall: every node's name resolves to 127.0.1.1
#   scripts/virtual_cluster.sh status | down      what is up | remove everything (idempotent, also after a crash)
#
# mpirun and horovodrun reach the other nodes through scripts/netns_rsh, which stands in for ssh.
# Needs root. The implementation is tools/vcluster/ (a tool of the repository, not part of the tutorial package).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=$root/.venv/bin/python
[[ -x $python ]] || python=$(command -v python3)  # an activated environment with the project installed
export PYTHONPATH=$root/tools${PYTHONPATH:+:$PYTHONPATH}
exec "$python" -m vcluster "$@"

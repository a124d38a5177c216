#!/usr/bin/env bash
# A real multi-node cluster on this machine, for rehearsing a workshop and for the tests (notebook 06, issue 14).
#
#   scripts/virtual_cluster.sh up 2 [--slurm]     node1 (10.77.0.1) and node2 (10.77.0.2), each a network namespace
#                                                 with its own interface eth0, address and host name, on one switch
#   scripts/virtual_cluster.sh exec node2 CMD...  run CMD on node2 (same files, same environment, node2's network)
#   scripts/virtual_cluster.sh slurm up|down      munge + slurmctld on node1 + slurmd on every node (apt-get installs
#                                                 slurm-wlm and munge the first time)
#   scripts/virtual_cluster.sh hosts loopback     seed 003's pitfall: every node's name resolves to 127.0.1.1
#   scripts/virtual_cluster.sh status | down      what is up | remove everything (idempotent, also after a crash)
#
# mpirun and horovodrun reach the other nodes through scripts/netns_rsh, which stands in for ssh.
# Needs root. The implementation is src/tutorial/launch/nodes.py.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=$root/.venv/bin/python
if [[ ! -x $python ]]; then
  python=$(command -v python3)
  export PYTHONPATH=$root/src${PYTHONPATH:+:$PYTHONPATH}
fi
exec "$python" -m tutorial.launch.nodes "$@"

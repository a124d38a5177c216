#!/usr/bin/env bash
# After the tests: nothing they started may survive (engines, controllers, MPI launchers and daemons, launchers and
# their workers). The list of program names is tutorial.launch.child_processes.PROCESS_NAMES, the one the tests use.
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-.venv}
[[ $venv = /* ]] || venv=$root/$venv
# The virtual cluster (scripts/virtual_cluster.sh) must be gone too: its network namespaces and Slurm daemons.
if command -v ip >/dev/null && left=$(ip netns list 2>/dev/null | grep -E '^(node[0-9]+|vcluster-switch)\b') \
   && [[ -n $left ]]; then
  echo "error: virtual-cluster namespaces left behind: $(echo "$left" | cut -d' ' -f1 | tr '\n' ' ')" >&2
  exit 1
fi
if left=$(pgrep -af '(^|/)(slurmctld|slurmd|munged)( |$)') && [[ -n $left ]]; then
  echo "error: Slurm daemons left behind (scripts/virtual_cluster.sh down stops them): $left" >&2
  exit 1
fi
exec "$venv/bin/python" -m tutorial.launch.child_processes

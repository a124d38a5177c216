#!/usr/bin/env bash
# After the tests: nothing they started may survive (engines, controllers, MPI launchers and daemons).
left=$(pgrep -af 'ipengine|ipcontroller|ipcluster|mpiexec|mpirun|orted|horovodrun|torchrun|ipyparallel\.(engine|controller)|tutorial-cluster-reaper' | grep -v -e pgrep -e check_leftovers || true)
if [[ -n $left ]]; then
  echo "error: processes left behind by the tests:" >&2
  echo "$left" >&2
  exit 1
fi
echo "no engines, controllers or MPI processes left behind"

#!/usr/bin/env bash
# After the tests: nothing they started may survive (engines, controllers, MPI launchers and daemons, launchers and
# their workers). The list of program names is tutorial.launch.processes.PROCESS_NAMES, the one the tests use.
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-.venv}
[[ $venv = /* ]] || venv=$root/$venv
exec "$venv/bin/python" -m tutorial.launch.processes

#!/usr/bin/env bash
# `make lab`: JupyterLab on notebooks/ with the project's kernel. Token authentication stays on; Jupyter prints the
# URL with its token. A busy port is not an error: say so and let Jupyter take the next free one.
set -euo pipefail
cd "$(dirname "$0")/.."
ip=${1:-127.0.0.1}
port=${2:-8888}
VENV=${VENV:-.venv}
if "$VENV/bin/python" -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', $port)) != 0)"; then
  echo "lab: port $port is busy (another Jupyter?); JupyterLab will take the next free port and print its URL"
fi
extra=()
# Jupyter refuses root unless told; containers and cloud VMs often run as root, so allow it only there.
[[ $(id -u) == 0 ]] && extra+=(--allow-root)
echo "lab: open the URL below (with its token). On a compute node: ssh -L $port:localhost:$port <node>, then open it locally."
exec "$VENV/bin/jupyter" lab --no-browser --ip="$ip" --port="$port" --port-retries=50 \
  --ServerApp.root_dir=notebooks "${extra[@]}"

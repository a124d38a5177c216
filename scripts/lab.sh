#!/usr/bin/env bash
# `make lab`: JupyterLab on notebooks/ with the project's kernel. Token authentication stays on; Jupyter prints the
# URL with its token. A busy port is not an error: say so and let Jupyter take the next free one.
# It opens on the course: the first notebook (00_setup, the README's first) open (and the first file in
# the file browser, below the capstone/ folder: JupyterLab lists folders first), its
# kernel `tutorial` started without a kernel dialog, and no "get notified about official Jupyter news?" pop-up over
# it (the settings below).
# LAB_ROOT: the folder to serve (default notebooks; tests/test_lab_ui.py serves a copy).
# LAB_CULL_S: a kernel no browser tab is connected to (a closed tab, a laptop gone home) is stopped after this many
# idle seconds, and with it its engines and their GPUs (default 3600; 0 keeps kernels until the lab stops).
set -euo pipefail
cd "$(dirname "$0")/.."
ip=${1:-127.0.0.1}
port=${2:-8888}
VENV=${VENV:-.venv}
root=${LAB_ROOT:-notebooks}
cull=${LAB_CULL_S:-3600}
if "$VENV/bin/python" -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', $port)) != 0)"; then
  echo "lab: port $port is busy (another Jupyter?); JupyterLab will take the next free port and print its URL"
fi
"$VENV/bin/python" scripts/lab_settings.py "$VENV"  # the course's lab defaults (also the hub's)
first=$(cd "$root" && ls [0-9]*.ipynb 2>/dev/null | sort | head -n 1)
extra=()
# Jupyter refuses root unless told; containers and cloud VMs often run as root, so allow it only there.
[[ $(id -u) == 0 ]] && extra+=(--allow-root)
[[ -n $first ]] && extra+=(--LabApp.default_url="/lab/tree/$first")
echo "lab: open the URL below (with its token). On a compute node: ssh -L $port:localhost:$port <node>, then open it locally."
exec "$VENV/bin/jupyter" lab --no-browser --ip="$ip" --port="$port" --port-retries=50 \
  --ServerApp.root_dir="$root" --MappingKernelManager.default_kernel_name=tutorial \
  --MappingKernelManager.cull_idle_timeout="$cull" --MappingKernelManager.cull_interval="$(( cull > 0 && cull < 300 ? (cull + 1) / 2 : 300 ))" \
  "${extra[@]}"

#!/usr/bin/env bash
# `make gpu-check`: verify the GPU path on a machine with a CUDA GPU (tutorial.bench.gpucheck lists what it runs);
# one line per check in results/gpu_check.jsonl. Works after `make install` on a GPU node (the venv), and on a bare
# GPU machine that has torch but none of the project's other packages: they come as wheels from $WHEELS (default
# .whl/, made here by scripts/gpu_wheels.sh) installed into a scratch folder, and the package is used from src/.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -x ${VENV:-.venv}/bin/python ]]; then
  py=${VENV:-.venv}/bin/python
else
  py=${PYTHON:-python3}
  wheels=${WHEELS:-.whl}
  site=${TMPDIR:-/tmp}/tutorial-gpu-site
  if compgen -G "$wheels/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$wheels"/*.whl
  fi
  export PYTHONPATH="$PWD/src:$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
  "$py" -m ipykernel install --user --name python3 >/dev/null 2>&1 || true  # the notebooks' kernel: this Python
fi
exec "$py" -m tutorial.bench.gpucheck "$@"

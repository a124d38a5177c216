#!/usr/bin/env bash
# `make notebooks [NB=notebooks/03_*.ipynb]`: re-execute notebooks in place with the CPU preset so their stored
# outputs are what strict nbval compares. Run it after changing a notebook or the code it shows.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export TUTORIAL_PRESET=${TUTORIAL_PRESET:-smoke} IPP_NONINTERACTIVE=1 CI=${CI:-true}
shopt -s nullglob
notebooks=(${NB:-notebooks/[0-9][0-9]*_*.ipynb notebooks/appendix_*.ipynb})
for nb in "${notebooks[@]}"; do
  start=$(date +%s)
  "$VENV/bin/jupyter" nbconvert --to notebook --execute --inplace --ExecutePreprocessor.kernel_name=tutorial \
    --ExecutePreprocessor.timeout=900 "$nb"
  "$VENV/bin/python" scripts/relative_outputs.py "$nb"  # runs/... and .venv/..., not this checkout's absolute path
  echo "executed $nb in $(( $(date +%s) - start )) s"
done
"$VENV/bin/python" scripts/course_plan.py  # the plan's CPU column is the stored cell times
bash scripts/check_leftovers.sh

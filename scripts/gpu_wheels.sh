#!/usr/bin/env bash
# Download, on a machine with internet, the wheels `make gpu-check` needs on a bare GPU machine that has torch and
# Python 3.12 but nothing else of the project (copy .whl/ there with the checkout). torch itself is not included.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${WHEELS:-.whl}
python=${GPU_PYTHON_VERSION:-3.12}
mkdir -p "$dest"
# What the trainers, launchers, notebooks and checks import, and what those need in turn.
packages=(numpy scikit-learn scipy joblib threadpoolctl tqdm psutil tensorboard tensorboard-data-server protobuf
  absl-py grpcio markdown werkzeug matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing
  python-dateutil six packaging ipyparallel ipykernel ipython jupyter-client jupyter-core nbconvert nbformat
  traitlets pyzmq tornado decorator entrypoints comm debugpy nest-asyncio matplotlib-inline prompt-toolkit
  pygments jedi parso pexpect ptyprocess wcwidth stack-data executing asttokens pure-eval platformdirs
  fastjsonschema jsonschema jsonschema-specifications referencing rpds-py attrs bleach tinycss2 webencodings
  mistune jinja2 markupsafe nbclient pandocfilters defusedxml beautifulsoup4 soupsieve jupyterlab-pygments
  pyyaml cloudpickle cffi pycparser py-spy)
for p in "${packages[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "$p" \
    || echo "gpu_wheels: no wheel for $p (skipped)" >&2
done
echo "wheels in $dest: $(ls "$dest" | wc -l)"

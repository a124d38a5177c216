#!/usr/bin/env bash
# `make gpu-bundle`: on a machine with internet, the wheels `make gpu-check` needs on an offline GPU node whose own
# Python 3.12 already has torch, torchvision, lightning, numpy, scikit-learn, matplotlib, tensorboard, psutil,
# filelock, mpi4py and their dependencies: exactly what such a node lacks, pinned in scripts/gpu_bundle.txt (Jupyter's
# kernel and notebook runner, ipyparallel, py-spy, DeepSpeed and its needs). Copy the checkout with .whl/ to the node;
# scripts/gpu_check.sh installs them over the node's torch into a scratch folder, without a network.
#   WHEELS=DIR              where the wheels go (default .whl)
#   GPU_PYTHON_VERSION=X.Y  the node's Python (default 3.12; make test's rehearsal builds one for its own Python)
#   BUILD_PYTHON=PATH       a Python with torch, to build DeepSpeed's wheel (default .venv/bin/python, else python3)
# DeepSpeed has only a source archive on PyPI: its wheel is built here without compiled ops (DS_BUILD_OPS=0; any op
# is compiled on first use), py3-none-any, so it fits every Python. Prints the bundle's size; over 60 MiB is an error.
set -euo pipefail
cd "$(dirname "$0")/.."
list=$PWD/scripts/gpu_bundle.txt
dest=${WHEELS:-.whl}
pyver=${GPU_PYTHON_VERSION:-3.12}
build_py=${BUILD_PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
limit=$((60 * 1024 * 1024))
mkdir -p "$dest"
pins=$(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$list" | grep -v '^$')
deepspeed=$(grep '^deepspeed==' <<<"$pins")
stamp="$(sha256sum "$list" | cut -c1-16) python $pyver"
if [[ -f $dest/BUNDLE && $(cat "$dest/BUNDLE") == "$stamp" ]]; then
  echo "gpu-bundle: $dest is already built from this list for Python $pyver"
else
  # DeepSpeed's wheel is built by $build_py (its setup.py imports torch; bdist_wheel comes from setuptools >= 70.1
  # or the wheel package): say which is missing in one line rather than "40 wheels for 41 pins" at the end.
  for need in torch "setuptools.command.bdist_wheel|wheel"; do
    if ! "$build_py" -c "import importlib.util as u, sys; sys.exit(not any(u.find_spec(m) for m in '$need'.split('|')))" 2>/dev/null; then
      echo "error: gpu-bundle: $build_py cannot build DeepSpeed's wheel: it has no ${need//|/ or } (make install, then" \
        "make gpu-bundle uses .venv; or BUILD_PYTHON=a Python with torch, setuptools >= 70.1 or wheel)" >&2
      exit 2
    fi
  done
  rm -f "$dest"/*.whl "$dest/BUNDLE"
  # Binary wheels for glibc 2.28 and newer (RHEL 8, Ubuntu 20.04 and later compute nodes); pure ones fit any.
  grep -v '^deepspeed==' <<<"$pins" >"$dest/.pins"
  "$build_py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any -d "$dest" -r "$dest/.pins"
  DS_BUILD_OPS=0 "$build_py" -m pip wheel -q --no-deps --no-build-isolation --no-binary deepspeed -w "$dest" \
    "$deepspeed" 2>&1 | grep -v '^WARNING: Location' || true
  rm -f "$dest/.pins"
  count=$(ls "$dest"/*.whl | wc -l)
  expected=$(wc -l <<<"$pins")
  if [[ $count -ne $expected ]]; then
    echo "error: gpu-bundle: $count wheels in $dest for $expected pins in scripts/gpu_bundle.txt" >&2
    exit 1
  fi
  echo "$stamp" >"$dest/BUNDLE"
fi
bytes=$(cat "$dest"/*.whl | wc -c)
echo "gpu-bundle: $(ls "$dest"/*.whl | wc -l) wheels for Python $pyver in $dest: $((bytes / 1024)) KiB" \
  "($(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}') MiB of at most 60)"
if ((bytes > limit)); then
  echo "error: gpu-bundle: $bytes bytes is over the 60 MiB that travels with the checkout" >&2
  exit 1
fi

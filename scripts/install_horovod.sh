#!/usr/bin/env bash
# Build and install Horovod for the PyTorch in the given Python environment.
#
#   scripts/install_horovod.sh [PYTHON]          (default: .venv/bin/python)
#   HOROVOD_GPU_OPERATIONS=NCCL scripts/install_horovod.sh   on a GPU node with CUDA and NCCL
#
# Why a source build: Horovod 0.28.1 (2023) is the last release and PyPI only has its source archive. Its CMake files
# hard-code C++14, but torch >= 2.1 needs C++17 and recent torch needs C++20, so the standard is raised to what the
# installed torch's headers ask for (upstream fixed this on master, never released). The built wheel is cached,
# keyed by Horovod, torch, Python and GPU ops, so a second install takes seconds.
set -euo pipefail
say() { echo "install_horovod: $*"; }
die() { echo "install_horovod: error: $*" >&2; exit 1; }

# NCCL for HOROVOD_GPU_OPERATIONS=NCCL, from the pip package torch brought (nvidia-nccl-cu1x): it holds
# lib/libnccl.so.2 and include/nccl.h, but Horovod's FindNCCL looks for libnccl.so (or, by default, the static
# libnccl_static.a, which pip's package lacks). So: a scratch folder with include/ and lib/libnccl.so -> libnccl.so.2,
# linked as a shared library; at run time torch has already loaded that libnccl.so.2. A HOROVOD_NCCL_HOME you set
# (a site's NCCL module) is used as it is.
nccl_lookup() {  # SITE_PACKAGES SCRATCH: exports HOROVOD_NCCL_HOME, _INCLUDE, _LIB and _LINK
  local site scratch=$2 nccl lib
  site=$(cd "$1" && pwd)
  if [[ -n ${HOROVOD_NCCL_HOME:-} ]]; then
    export HOROVOD_NCCL_INCLUDE=${HOROVOD_NCCL_INCLUDE:-$HOROVOD_NCCL_HOME/include}
    export HOROVOD_NCCL_LIB=${HOROVOD_NCCL_LIB:-$HOROVOD_NCCL_HOME/lib} HOROVOD_NCCL_LINK=${HOROVOD_NCCL_LINK:-SHARED}
    return
  fi
  nccl=$(dirname "$(dirname "$(ls "$site"/nvidia/nccl/include/nccl.h "$site"/nvidia/cu1*/include/nccl.h \
    2>/dev/null | head -n 1)")")
  [[ -f $nccl/include/nccl.h ]] || die "no NCCL in $site/nvidia (pip's nvidia-nccl package); set HOROVOD_NCCL_HOME"
  lib=$(ls "$nccl"/lib/libnccl.so.* 2>/dev/null | sort -V | tail -n 1 || true)
  [[ -n $lib ]] || die "$nccl/lib has no libnccl.so.*; set HOROVOD_NCCL_HOME to an NCCL with lib/libnccl.so"
  mkdir -p "$scratch/lib"
  ln -sfn "$nccl/include" "$scratch/include"
  ln -sf "$lib" "$scratch/lib/libnccl.so"
  export HOROVOD_NCCL_HOME=$scratch HOROVOD_NCCL_INCLUDE=$scratch/include HOROVOD_NCCL_LIB=$scratch/lib
  export HOROVOD_NCCL_LINK=SHARED
}
if [[ ${1:-} == --nccl-lookup ]]; then  # scripts/install_horovod.sh --nccl-lookup SITE_PACKAGES SCRATCH (tests)
  nccl_lookup "$2" "$3"
  env | grep '^HOROVOD_NCCL_' | sort
  exit 0
fi

PY=${1:-.venv/bin/python}
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
GPU_OPS=${HOROVOD_GPU_OPERATIONS:-}
CACHE=${TUTORIAL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tutorial-workbook}/horovod

case "$GPU_OPS" in
  ""|NCCL) ;;
  *) echo "install_horovod: error: HOROVOD_GPU_OPERATIONS=$GPU_OPS is not supported; use NCCL or leave it unset (CPU ops)" >&2; exit 2 ;;
esac
[[ -x $PY ]] || die "no Python at $PY (run 'make install')"
command -v mpicc >/dev/null || die "mpicc not found: install Open MPI with headers (apt-get install openmpi-bin libopenmpi-dev) or load your site's MPI module"
command -v cmake >/dev/null || die "cmake not found: install it (apt-get install cmake, or conda install cmake)"

read -r TORCH_VERSION TORCH_CUDA PY_TAG SITE < <("$PY" -c '
import sys, sysconfig, torch
print(torch.__version__.split("+")[0], torch.version.cuda or "none",
      "cp%d%d" % sys.version_info[:2], sysconfig.get_paths()["purelib"])')
OPS_TAG=${GPU_OPS:-cpu}
KEY="horovod-${HOROVOD_VERSION}_torch-${TORCH_VERSION}-cuda-${TORCH_CUDA}_${PY_TAG}_ops-${OPS_TAG,,}"

# Already installed for this torch? (A Horovod built against another torch fails at import or crashes.)
if "$PY" - "$KEY" <<'PY' 2>/dev/null; then
import sys, pathlib, horovod.torch
stamp = pathlib.Path(horovod.__file__).parent / "tutorial_build_key"
sys.exit(0 if stamp.exists() and stamp.read_text().strip() == sys.argv[1] else 1)
PY
  say "already installed ($KEY)"
  exit 0
fi

mkdir -p "$CACHE/$KEY"
wheel=$(ls "$CACHE/$KEY"/horovod-*.whl 2>/dev/null | head -n 1 || true)
if [[ -z $wheel ]]; then
  say "building $KEY (takes about 4 minutes on 2 cores)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work" 2>&1 | grep -v "is ignored: it is neither" || true
  ls "$work"/horovod-*.tar.gz >/dev/null 2>&1 || die "could not download horovod==$HOROVOD_VERSION's source from PyPI"
  tar -xzf "$work"/horovod-*.tar.gz -C "$work"
  src=$(echo "$work"/horovod-"$HOROVOD_VERSION")

  # The C++ standard torch's headers require (they #error below it).
  std=14
  inc="$SITE/torch/include/ATen/ATen.h"
  grep -q "C++17 or later compatible compiler" "$inc" && std=17
  grep -q "C++20 or later compatible compiler" "$inc" && std=20
  sed -i "s/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD $std)/" "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  sed -i "s/set(CMAKE_CXX_STANDARD 17)\\\\n/set(CMAKE_CXX_STANDARD $std)\\\\n/" "$src/CMakeLists.txt"
  ((std == 14)) || ! grep -q "CMAKE_CXX_STANDARD 14" "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt" \
    || die "could not raise the C++ standard in Horovod's CMake files"
  say "C++ standard raised to $std for torch $TORCH_VERSION"

  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
  export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
  export MAKEFLAGS=${MAKEFLAGS:--j$(nproc)}
  # cmake >= 4 rejects gloo's old cmake_minimum_required.
  export CMAKE_POLICY_VERSION_MINIMUM=3.5

  # A CUDA build of torch makes Horovod's CMake require a CUDA toolkit even for CPU ops. Without a real toolkit,
  # assemble one from the CUDA runtime pip packages that came with torch (headers and libcudart).
  if [[ $TORCH_CUDA != none ]]; then
    cuda_home=${CUDA_HOME:-}
    if [[ -z $cuda_home || ! -f $cuda_home/include/cuda_runtime.h ]]; then
      nv=$(ls -d "$SITE"/nvidia/cu1* "$SITE"/nvidia/cuda_runtime 2>/dev/null | head -n 1 || true)
      [[ -n $nv && -f $nv/include/cuda_runtime.h ]] || die "torch is a CUDA build but no CUDA headers were found; set CUDA_HOME to a CUDA toolkit"
      command -v nvcc >/dev/null || die "torch is a CUDA build and Horovod's CMake needs nvcc; install the CUDA toolkit (or load its module)"
      cuda_home=$work/cuda
      mkdir -p "$cuda_home/lib64" "$cuda_home/bin"
      ln -s "$nv/include" "$cuda_home/include"
      ln -s "$(ls "$nv"/lib/libcudart.so.* | head -n 1)" "$cuda_home/lib64/libcudart.so"
      ln -s "$(command -v nvcc)" "$cuda_home/bin/nvcc"
    fi
    export CUDA_HOME=$cuda_home HOROVOD_CUDA_HOME=$cuda_home
    export HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-80,90}
  fi
  if [[ $GPU_OPS == NCCL ]]; then
    [[ $TORCH_CUDA != none ]] || die "HOROVOD_GPU_OPERATIONS=NCCL needs a CUDA build of torch"
    export HOROVOD_GPU_OPERATIONS=NCCL
    nccl_lookup "$SITE" "$work/nccl"
    say "NCCL: $HOROVOD_NCCL_LIB/libnccl.so, $HOROVOD_NCCL_INCLUDE/nccl.h ($HOROVOD_NCCL_LINK)"
  else
    unset HOROVOD_GPU_OPERATIONS
  fi

  start=$(date +%s)
  "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$work/dist" "$src" > "$work/build.log" 2>&1 \
    || { tail -n 40 "$work/build.log" >&2; die "Horovod build failed (log above)"; }
  cp "$work"/dist/horovod-*.whl "$CACHE/$KEY/"
  wheel=$(ls "$CACHE/$KEY"/horovod-*.whl | head -n 1)
  say "built in $(( $(date +%s) - start )) s, cached in $CACHE/$KEY"
fi

"$PY" -m pip install -q --no-deps --force-reinstall "$wheel"
"$PY" - "$KEY" <<'PY'
import sys, pathlib, horovod
(pathlib.Path(horovod.__file__).parent / "tutorial_build_key").write_text(sys.argv[1] + "\n")
PY
"$(dirname "$PY")/horovodrun" --check-build

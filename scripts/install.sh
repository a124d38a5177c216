#!/usr/bin/env bash
# `make install`: everything the workbook needs, idempotent (seconds when all is there).
#   1. system packages: Open MPI with headers, cmake, a C++ compiler; npm and chromium for the slides (apt, when root
#      and missing)
#   2. .venv with the pinned requirements.txt (re-run only when requirements.txt changes), DeepSpeed on its own
#   3. the tutorial package, editable
#   4. Horovod, built from source by scripts/install_horovod.sh (cached wheel)
#   5. a Jupyter kernel "tutorial" registered inside the venv, used by JupyterLab and nbval, and the course's lab
#      defaults (scripts/lab_settings.py)
#   6. the hub's proxy, configurable-http-proxy from npm, into tools/hub/node_modules (npm ci; skipped without npm)
#   7. .venv-floor: the oldest torch the workbook supports over the venv's other packages (scripts/torch_floor.sh)
# SITE_TORCH=1 keeps the site's torch (an Intel XPU or AMD ROCm build) instead of PyPI's CUDA one (step 2).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
say() { echo "install: $*"; }
die() { echo "install: error: $*" >&2; exit 1; }

case "${HOROVOD_GPU_OPERATIONS:-}" in
  ""|NCCL) ;;
  *) echo "install: error: HOROVOD_GPU_OPERATIONS=${HOROVOD_GPU_OPERATIONS} is not supported; use NCCL or leave it unset (CPU ops)" >&2; exit 2 ;;
esac
case "${SITE_TORCH:-}" in
  ""|0|1) ;;
  *) echo "install: error: SITE_TORCH=$SITE_TORCH is not supported; use 1 (the site's torch) or leave it unset" >&2; exit 2 ;;
esac

# 1. system packages
# apt_install WHY PACKAGE...: as root with apt-get, install them and return 0; otherwise return 1 (the caller says
# what to do instead: the MPI toolchain is required, the slides' browser is not).
apt_install() {
  local why=$1; shift
  [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null || return 1
  say "apt-get install $*$why"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}
missing=()
command -v mpicc >/dev/null || missing+=(openmpi-bin libopenmpi-dev)
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
if ((${#missing[@]})) && ! apt_install "" "${missing[@]}"; then
  die "missing ${missing[*]}: install them (sudo apt-get install ${missing[*]}), or load your site's MPI, cmake and compiler modules"
fi
# For the slides only: npm fetches reveal.js once (`make slides`), Debian's chromium renders every deck headless
# (tests/test_slides.py; about a minute to install). Without root the rest still installs, and the test is skipped.
slides=()
command -v npm >/dev/null || slides+=(nodejs npm)
command -v chromium >/dev/null || slides+=(chromium)
if ((${#slides[@]})) && ! apt_install " (slides and their browser test)" "${slides[@]}"; then
  say "note: ${slides[*]} missing: make slides and its browser test need them (sudo apt-get install ${slides[*]})"
fi

# 2. the virtual environment
"$PYTHON" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))' \
  || die "$("$PYTHON" -V 2>&1) is not supported; use Python 3.10-3.12 (set PYTHON=python3.11)"
# SITE_TORCH=1: the site's own torch, the one $PYTHON imports (Aurora's XPU build after `module load frameworks`, a
# ROCm build on an AMD system), seen through --system-site-packages; PyPI's torch and torchvision are CUDA builds
# and would shadow it. The site's torch must be at least pyproject.toml's floor.
skip='^deepspeed=='
venv_args=()
intel_max() {  # an Intel Data Center GPU Max: vendor 0x8086, device 0x0bxx (core/accelerator.py reads the same)
  local d
  for d in /sys/class/drm/renderD*/device; do
    [[ $(cat "$d/vendor" 2>/dev/null) == 0x8086 && $(cat "$d/device" 2>/dev/null) == 0x0b* ]] && return 0
  done
  return 1
}
case "${SITE_TORCH:-}" in
  ""|0) if [[ -e /dev/kfd ]] || intel_max; then
          say "note: this node has AMD or Intel GPUs and PyPI's torch is built for NVIDIA's: load the site's torch and run SITE_TORCH=1 make install"
        fi ;;
  1) site=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null) \
       || die "SITE_TORCH=1 but $PYTHON imports no torch: load the site's module first (Aurora: module load frameworks), or set PYTHON"
     floor=$(sed -n 's/.*"torch>=\([0-9]*\.[0-9]*\)".*/\1/p' pyproject.toml)
     "$PYTHON" -c "import sys; v = tuple(int(x) for x in '${site%%+*}'.split('.')[:2]); sys.exit(v < tuple(int(x) for x in '$floor'.split('.')))" \
       || die "SITE_TORCH=1: $PYTHON's torch $site is older than $floor, the oldest this workbook supports: load a newer one"
     say "the site's torch $site ($PYTHON), not PyPI's"
     skip='^(deepspeed|torch|torchvision)=='
     venv_args=(--system-site-packages) ;;
esac
# A venv that is there already: the site's own (its torch is the one $PYTHON imports: a venv the site's torch was
# installed into, named by VENV), or one made with the site's packages in view; a .venv of an install without
# SITE_TORCH has PyPI's torch inside and no view of the site's.
if [[ ${SITE_TORCH:-} == 1 && -f $VENV/pyvenv.cfg ]] && ! grep -q '^include-system-site-packages = true' "$VENV/pyvenv.cfg" \
   && [[ $("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null) != "$site" ]]; then
  die "SITE_TORCH=1: $VENV was made without the site's packages (a make install without SITE_TORCH): remove it (rm -rf $VENV) and run again"
fi
[[ -x $VENV/bin/python ]] || { say "creating $VENV"; "$PYTHON" -m venv ${venv_args[@]+"${venv_args[@]}"} "$VENV"; }
if [[ ${SITE_TORCH:-} == 1 && $("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null) != "$site" ]]; then
  # --system-site-packages shows the base interpreter's packages: a torch installed in another venv is not among them
  die "SITE_TORCH=1: $VENV does not see $PYTHON's torch $site (is it in a virtual environment of its own? then install into that one: make install SITE_TORCH=1 VENV=its folder)"
fi
stamp=$VENV/.requirements.sha256
want=$(sha256sum requirements.txt | cut -d' ' -f1)
[[ ${SITE_TORCH:-} == 1 ]] && want+=-site
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  say "installing requirements.txt into $VENV (torch is a few GB the first time)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # Everything but DeepSpeed, whose build must see this torch (below), and the site's torch where it has one.
  "$VENV/bin/python" -m pip install -q -r <(grep -Ev "$skip" requirements.txt)
  # PyPI's torchvision is built against a CUDA torch; a mismatched torch fails here rather than in a notebook.
  if [[ ${SITE_TORCH:-} == 1 ]]; then
    "$VENV/bin/python" -c 'import torchvision' 2>/dev/null \
      || die "SITE_TORCH=1: the site's torch comes without torchvision: load the site's module that has both (Aurora: module load frameworks)"
  fi
  "$VENV/bin/python" -c 'import torch, torchvision; torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)' \
    || die "torch and torchvision do not work together; check the pair pinned in requirements.txt"
  echo "$want" > "$stamp"
fi

# DeepSpeed: a source archive whose setup.py imports torch. --no-build-isolation lets it see the venv's torch (an
# isolated build sees none); DS_BUILD_OPS=0 precompiles no C++/CUDA op (they are JIT-compiled if ever used);
# --no-deps because its needs are pinned in requirements.txt and installed above.
deepspeed=$(sed -n 's/^deepspeed==\([^ #]*\).*/\1/p' requirements.txt)
if [[ -n $deepspeed && $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("deepspeed"))' 2>/dev/null) != "$deepspeed" ]]; then
  say "installing deepspeed==$deepspeed (built against this torch, no precompiled ops)"
  DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps --no-cache-dir "deepspeed==$deepspeed"
  DS_ACCELERATOR=cpu "$VENV/bin/python" -c 'import deepspeed' || die "deepspeed==$deepspeed does not import; see the output above"
fi

# 3. the package
"$VENV/bin/python" -c 'import tutorial' 2>/dev/null || "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e .

# 4. Horovod
bash scripts/install_horovod.sh "$VENV/bin/python"

# 5. the Jupyter kernel
kernel=$VENV/share/jupyter/kernels/tutorial/kernel.json
if [[ ! -f $kernel ]] || ! grep -q "$(cd "$VENV" && pwd)/bin/python" "$kernel"; then
  "$VENV/bin/python" -m ipykernel install --sys-prefix --name tutorial --display-name "Python (distributed tutorial)" >/dev/null
  say "registered Jupyter kernel 'tutorial'"
fi
"$VENV/bin/python" scripts/lab_settings.py "$VENV"
# 6. the hub's proxy (tools/hub): the exact versions of package-lock.json, again only when it changed (seconds)
hub=tools/hub
lock=$(sha256sum "$hub/package-lock.json" | cut -d' ' -f1)
if [[ $(cat "$hub/node_modules/.lock.sha256" 2>/dev/null) != "$lock" ]]; then
  if command -v npm >/dev/null; then
    say "installing the hub's proxy (npm ci in $hub)"
    if (cd "$hub" && npm ci --no-audit --no-fund --loglevel=error); then
      echo "$lock" > "$hub/node_modules/.lock.sha256"
    else
      say "note: npm ci in $hub failed (above): the workshop's hub (make hub) and its test need the proxy"
    fi
  else
    say "note: npm missing: the workshop's hub (make hub) needs it for its proxy (sudo apt-get install npm)"
  fi
fi
# 7. the oldest supported torch, for make test's floor lane: an overlay of the venv (about 0.5 GB, once); not over a
# site's torch (make test is the maintainers' check, on PyPI's torch)
if [[ ${SITE_TORCH:-} == 1 ]]; then
  say "note: no .venv-floor over the site's torch: make test's floor lane needs a make install without SITE_TORCH"
else
  VENV=$VENV bash scripts/torch_floor.sh
fi
say "ready ($VENV)"

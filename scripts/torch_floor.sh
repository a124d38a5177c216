#!/usr/bin/env bash
# The oldest torch the workbook supports, for make test's floor lane (issue 39): GPU nodes bring their own torch (the
# lent H100/H200 node has 2.11, sites ship their builds), so the trainers' core paths and gpu-check's CPU rehearsal
# also run on the floor. The floor is declared once, as pyproject.toml's "torch>=X.Y"; torchvision is its pair
# (0.(Y+15), PyTorch's release pairing). The floor environment is an overlay of .venv: its own torch and torchvision,
# then everything else from .venv (a .pth file), so it costs one download (~0.5 GB) and no second install.
#   scripts/torch_floor.sh            create or refresh .venv-floor (idempotent: seconds when it is there)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
FLOOR_VENV=${FLOOR_VENV:-.venv-floor}
say() { echo "torch-floor: $*"; }
die() { echo "torch-floor: error: $*" >&2; exit 1; }

floor=$(sed -n 's/.*"torch>=\([0-9]*\.[0-9]*\)".*/\1/p' pyproject.toml)
[[ $floor =~ ^2\.[0-9]+$ ]] || die "pyproject.toml declares no torch floor as \"torch>=2.N\" (found '${floor}')"
torch="torch==$floor.0"
vision="torchvision==0.$(( ${floor#2.} + 15 )).0"
[[ -x $VENV/bin/python ]] || die "$VENV is missing: run make install first"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

if [[ -x $FLOOR_VENV/bin/python && -x $FLOOR_VENV/bin/torchrun ]] && "$FLOOR_VENV/bin/python" -c "
import sys, torch, torchvision
sys.exit(torch.__version__.split('+')[0] != '$floor.0' or not torch.__file__.startswith('$(pwd)/$FLOOR_VENV'))
" 2>/dev/null; then
  exit 0
fi
say "creating $FLOOR_VENV: $torch and $vision over $VENV's other packages"
rm -rf "$FLOOR_VENV"
"$VENV/bin/python" -m venv --without-pip "$FLOOR_VENV"
floor_site=$("$FLOOR_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# --no-deps: the CUDA libraries, triton and the rest come from .venv (same CUDA major); --target: no pip in the overlay
"$VENV/bin/python" -m pip install -q --no-deps --target "$floor_site" "$torch" "$vision"
# After the overlay's own packages: .venv's, and the package's source (.venv's editable install is a .pth there,
# which a path added by a .pth file does not process).
echo "$(cd "$site" && pwd)" > "$floor_site/zz-venv.pth"
echo "$(pwd)/src" > "$floor_site/zz-tutorial-src.pth"
# torchrun as a venv has it, of the floor's torch (pip --target wrote its script for .venv's Python, the pinned torch):
# a cell that types `torchrun` runs the floor too
printf '#!/bin/sh\nexec "%s" -m torch.distributed.run "$@"\n' "$(pwd)/$FLOOR_VENV/bin/python" > "$FLOOR_VENV/bin/torchrun"
chmod +x "$FLOOR_VENV/bin/torchrun"
"$FLOOR_VENV/bin/python" -c 'import torch, torchvision; torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)' \
  || die "$torch and $vision do not work together over $VENV"
say "ready ($FLOOR_VENV: $("$FLOOR_VENV/bin/python" -c 'import torch; print(torch.__version__)'))"

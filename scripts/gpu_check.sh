#!/usr/bin/env bash
# `make gpu-check STAGE=N`: verify the GPU path, one stage of at most 8 minutes (python -m gpucheck
# --list --stage N shows its checks and their estimates). With the project's venv (after `make install`) it uses
# that. On an offline GPU node with only its own Python and torch it uses that Python ($PYTHON, default python3) and
# installs the wheels `make gpu-bundle` made ($WHEELS, default .whl/) over it into a scratch folder, without a
# network (once: a second stage reuses the folder); the package itself is used from src/. The driver says which
# torch it found.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -x ${VENV:-.venv}/bin/python ]]; then
  py=${VENV:-.venv}/bin/python
  export PATH="$PWD/${VENV:-.venv}/bin:$PATH"  # the venv's horovodrun, py-spy
else
  py=${PYTHON:-python3}
  wheels=${WHEELS:-.whl}
  if compgen -G "$wheels/*.whl" >/dev/null; then
    key=$(cat "$wheels"/BUNDLE "$wheels"/*.whl 2>/dev/null | cksum | cut -d' ' -f1)
    site=${TMPDIR:-/tmp}/tutorial-gpu-site-$key
    if [[ ! -f $site/.installed ]]; then
      rm -rf "$site"
      start=$SECONDS
      if "$py" -m pip --version >/dev/null 2>&1; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check --target "$site" \
          "$wheels"/*.whl
      else  # no pip in this Python: a wheel is a zip file (its .data/scripts go to bin/)
        "$py" - "$site" "$wheels"/*.whl <<'PY'
import os, shutil, stat, sys, zipfile
site, wheels = sys.argv[1], sys.argv[2:]
for wheel in wheels:
    zipfile.ZipFile(wheel).extractall(site)
for data in [d for d in os.listdir(site) if d.endswith(".data")]:
    for kind in os.listdir(os.path.join(site, data)):
        src = os.path.join(site, data, kind)
        dest = os.path.join(site, "bin") if kind == "scripts" else site
        if kind in ("scripts", "purelib", "platlib"):
            os.makedirs(dest, exist_ok=True)
            for name in os.listdir(src):
                shutil.move(os.path.join(src, name), os.path.join(dest, name))
                if kind == "scripts":
                    os.chmod(os.path.join(dest, name), 0o755)
    shutil.rmtree(os.path.join(site, data))
PY
      fi
      touch "$site/.installed"
      echo "gpu-check: $(ls "$wheels"/*.whl | wc -l) wheels from $wheels installed into $site in $((SECONDS - start)) s"
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
  else
    echo "gpu-check: no wheels in $wheels (make gpu-bundle where there is internet): checks that need what this" \
      "Python lacks are recorded as skips" >&2
  fi
  export PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD/tools${PYTHONPATH:+:$PYTHONPATH}"  # the driver is a tool of the repository, tools/gpucheck
exec "$py" -m gpucheck "$@"

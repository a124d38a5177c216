"""scripts/install.sh's choice of torch: PyPI's (a CUDA build) by default, the site's own with SITE_TORCH=1 (Aurora's
XPU build, a ROCm build), which must be at least pyproject.toml's floor and visible from the new venv. What it
refuses, it refuses in one line, before it installs anything. The site's torch here is a stub package that says its
version; the whole install over a real site torch cannot run on this machine (no Python here has one outside a venv)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

FLOOR = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)


def install(tmp_path, site_torch: str, version: str | None = None) -> subprocess.CompletedProcess:
    """install.sh with SITE_TORCH, and a Python whose torch (on its PYTHONPATH) says it is `version` (None: no torch;
    -S leaves this venv's own torch out)."""
    stub = tmp_path / "site-packages"
    if version is not None:
        (stub / "torch").mkdir(parents=True)
        (stub / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={stub if version else ""} exec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    env = dict(os.environ, SITE_TORCH=site_torch, PYTHON=str(python), VENV=str(tmp_path / "venv"))
    return subprocess.run(["bash", str(ROOT / "scripts" / "install.sh")], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("site_torch, version, code, said", [
    ("2", None, 2, "install: error: SITE_TORCH=2 is not supported; use 1 (the site's torch) or leave it unset"),
    ("1", None, 1, "install: error: SITE_TORCH=1 but {python} imports no torch: load the site's module first"),
    ("1", "2.8.0+xpu", 1, "install: error: SITE_TORCH=1: {python}'s torch 2.8.0+xpu is older than " + FLOOR),
])
def test_a_site_torch_that_cannot_serve_is_refused_before_anything_is_made(tmp_path, site_torch, version, code, said):
    done = install(tmp_path, site_torch, version)
    assert done.returncode == code and said.format(python=tmp_path / "python") in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "venv").exists()


def test_a_site_torch_the_new_venv_cannot_see_is_named_before_pypis_is_installed(tmp_path):
    """A torch new enough, but installed where --system-site-packages does not look (here: a PYTHONPATH; at a site:
    a venv of its own): the venv is made with the site's packages in view, then the script stops, naming the
    torch it could not see and the way out, before pip installs anything into it."""
    done = install(tmp_path, "1", "2.14.0+xpu")
    assert done.returncode == 1, done.stderr
    assert "the site's torch 2.14.0+xpu" in done.stdout
    assert f"does not see {tmp_path / 'python'}'s torch 2.14.0+xpu" in done.stderr and "VENV=its folder" in done.stderr
    config = (tmp_path / "venv" / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = true" in config
    assert not list((tmp_path / "venv").glob("lib/python*/site-packages/numpy")), "pip ran"


def test_a_venv_made_without_the_sites_packages_is_named_not_reused(tmp_path):
    """SITE_TORCH=1 over a .venv that an install without it made (PyPI's torch inside): it says to remove it."""
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\n")
    done = install(tmp_path, "1", "2.14.0+xpu")
    assert done.returncode == 1 and f"{tmp_path / 'venv'} was made without the site's packages" in done.stderr
    assert f"rm -rf {tmp_path / 'venv'}" in done.stderr, done.stderr


def test_the_sites_own_venv_is_installed_into_not_refused(tmp_path):
    """A site's torch in a venv of its own (PyPI's XPU wheels installed into one; the way out the refusal above names,
    VENV=its folder): the checks pass and the requirements' step starts in it (here a venv without pip,
    offline, so it stops there, having installed nothing).
    Control: the same venv without the site's torch is the .venv of an install without SITE_TORCH, refused."""
    venv = tmp_path / "site-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    env = dict(os.environ, SITE_TORCH="1", PYTHON=str(python), VENV=str(venv), PIP_NO_INDEX="1",
               PIP_FIND_LINKS=str(tmp_path / "no-wheels"))

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(ROOT / "scripts" / "install.sh")], env=env, capture_output=True, text=True,
                              timeout=120)

    (Path(site) / "torch").mkdir()
    (Path(site) / "torch" / "__init__.py").write_text("__version__ = '2.14.0+xpu'\n")
    done = run()
    assert "the site's torch 2.14.0+xpu" in done.stdout and f"installing requirements.txt into {venv}" in done.stdout
    assert "made without the site's packages" not in done.stderr and "does not see" not in done.stderr, done.stderr
    assert done.returncode != 0  # no pip, no index: nothing was installed, and the site's torch is untouched
    assert (Path(site) / "torch" / "__init__.py").read_text() == "__version__ = '2.14.0+xpu'\n"
    (Path(site) / "torch" / "__init__.py").unlink()
    (Path(site) / "torch").rmdir()
    env["PYTHON"] = sys.executable  # this venv's PyPI torch as "the site's": the venv above no longer has it
    done = run()
    assert done.returncode == 1 and f"{venv} was made without the site's packages" in done.stderr, done.stderr

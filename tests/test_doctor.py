"""`tutorial doctor` on a GPU node whose driver is older than torch's CUDA build, and Horovod without NCCL there.

This machine has no GPU, so an `nvidia-smi` that prints what a real one prints on such a node stands in for the
driver; torch really sees no GPU here, exactly as it would with a too-old driver."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from conftest import BIN, have_horovod

NVIDIA_SMI = """#!/bin/sh
cat <<'OUT'
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 570.86.15              Driver Version: 570.86.15      CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
|   0  NVIDIA A100-SXM4-40GB          On  |   00000000:07:00.0 Off |                    0 |
+-----------------------------------------------------------------------------------------+
OUT
"""


def doctor_on_a_node_with_driver(tmp_path, cuda: str) -> subprocess.CompletedProcess:
    (tmp_path / "nvidia-smi").write_text(NVIDIA_SMI.format(cuda=cuda))
    (tmp_path / "nvidia-smi").chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    return subprocess.run([BIN / "tutorial", "doctor"], capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def node_with_a_new_driver(tmp_path_factory) -> subprocess.CompletedProcess:
    """One doctor run (each imports every framework: seconds) on a node whose driver supports CUDA 12.8."""
    return doctor_on_a_node_with_driver(tmp_path_factory.mktemp("driver"), "12.8")


def test_gpu_invisible_to_torch_names_the_build_to_install(node_with_a_new_driver):
    proc = node_with_a_new_driver
    assert proc.returncode == 1
    assert "NVIDIA driver 570.86.15 (CUDA up to 12.8) but torch sees no GPU" in proc.stdout
    fix = next(line for line in proc.stderr.splitlines() if line.startswith("missing GPUs:"))
    assert "newer than the driver supports" in fix and "install the CUDA 12.8 build" in fix
    assert "torch==" in fix and "torchvision==" in fix and fix.endswith("/whl/cu128")


def test_a_driver_too_old_for_every_build_says_so(tmp_path):
    fix = next(line for line in doctor_on_a_node_with_driver(tmp_path, "11.8").stderr.splitlines()
               if line.startswith("missing GPUs:"))
    assert "supports CUDA 11.8" in fix and "newer NVIDIA driver" in fix


@pytest.mark.skipif(not have_horovod(), reason="Horovod not built (run make install)")
def test_horovod_without_nccl_on_a_gpu_node_is_flagged(node_with_a_new_driver):
    import horovod.torch as hvd
    proc = node_with_a_new_driver
    flagged = [line for line in proc.stderr.splitlines() if line.startswith("missing horovod:")]
    if hvd.nccl_built():
        assert not flagged
    else:
        assert flagged == ["missing horovod: HOROVOD_GPU_OPERATIONS=NCCL make install (rebuilds Horovod with NCCL "
                           "all-reduce)"]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a real NVIDIA driver is present")
def test_cpu_machine_is_ready_without_gpu_fixes():
    proc = subprocess.run([BIN / "tutorial", "doctor"], capture_output=True, text=True, timeout=120)
    assert "missing GPUs" not in proc.stderr and "missing horovod" not in proc.stderr

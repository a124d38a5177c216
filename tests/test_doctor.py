"""`tutorial doctor` on GPU nodes where torch cannot use the GPUs, and what it says where it can, per vendor.

NVIDIA: this machine has no GPU, so an `nvidia-smi` that prints what a real one prints on a node whose driver is older
than torch's CUDA build stands in for the driver; torch really sees no GPU here, exactly as it would with a too-old
driver. AMD and Intel: in this process, with test_accelerator's simulated ROCm and XPU builds and drivers' files."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import torch
from conftest import BIN, ROOT, have_horovod
from test_accelerator import PVC, amd_node, intel_node, simulate_rocm, simulate_xpu
from test_accelerator import no_gpus_on_this_machine  # noqa: F401 - autouse fixture: no GPU of this machine counts

from tutorial import cli

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


def test_a_driver_too_old_for_every_build_says_so():
    """The doctor's GPUs row for a driver whose CUDA no torch build supports, in this process (the run above reads
    nvidia-smi and prints the rows' fixes as "missing GPUs: ..." lines: one whole run is enough)."""
    what, fix = rows(("470.256.02", "11.8"))["GPUs"]
    assert what == "NVIDIA driver 470.256.02 (CUDA up to 11.8) but torch sees no GPU"
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


# ------------------------------------------------------------------ AMD and Intel nodes, and this CPU machine
# f7f8195's doctor read torch.version.cuda and nvidia-smi only: it called a ROCm torch a CPU build, and on an AMD or
# Intel node whose torch could not see the GPUs it printed "GPUs none: CPU presets (gloo)" and "ready", each a
# control below.


BUILT = f"torch is built for CUDA {torch.version.cuda}" if torch.version.cuda else "torch is a CPU build"  # here


def rows(driver=None) -> dict:
    """doctor's torch, GPUs and backend rows: {name: (what is there, fix)}; driver: nvidia-smi's answer."""
    return {name: (value, fix) for name, value, fix in [cli._torch_row(torch), *cli._gpu_rows(torch, driver)]}


def test_a_cpu_machine_prints_the_lines_00_stored(monkeypatch):
    """Here (a CUDA build, no GPU) the rows are those in 00's stored doctor output: no backend row (the GPUs row says
    gloo), nothing missing. A CPU-only build keeps its "CUDA none (CPU build)"."""
    cell = next(c for c in json.loads((ROOT / "notebooks" / "00_setup.ipynb").read_text())["cells"]
                if "cli.doctor(" in "".join(c["source"]))
    stored = "".join("".join(out.get("text", "")) for out in cell["outputs"])
    here = rows()
    assert here == {"torch": (f"{torch.__version__} (CUDA {torch.version.cuda or 'none (CPU build)'}, NCCL -)", None),
                    "GPUs": ("none: CPU presets (gloo)", None)}
    assert re.search(r"^torch +\S+ \(CUDA [\d.]+, NCCL -\)$", stored, re.M)
    assert re.search(r"^GPUs +none: CPU presets \(gloo\)$", stored, re.M) and "backend" not in stored
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)
    assert rows()["torch"] == (f"{torch.__version__} (CUDA none (CPU build), NCCL -)", None)


@pytest.mark.skipif(not torch.version.cuda, reason="a CPU-only build of torch has no NCCL")
def test_nvidia_gpus_get_the_nccl_backend_row(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    assert rows() == {"torch": (f"{torch.__version__} (CUDA {torch.version.cuda}, NCCL {nccl})", None),
                      "GPUs": ("2 NVIDIA H100 80GB HBM3", None), "backend": ("nccl", None)}


def test_a_rocm_node_names_rocm_rccl_and_its_gpus(tmp_path, monkeypatch):
    amd_node(tmp_path)
    simulate_rocm(monkeypatch)
    assert rows() == {"torch": (f"{torch.__version__} (ROCm 6.2, RCCL 2.20.5)", None),  # f7f8195: "CPU build"
                      "GPUs": ("8 AMD Instinct MI250X", None), "backend": ("nccl (RCCL, under NCCL's name)", None)}


def test_an_amd_node_with_a_cuda_torch_is_not_ready(tmp_path):
    """What `make install` leaves on an AMD node: CUDA wheels. The fix installs the ROCm build of the same pair."""
    amd_node(tmp_path)
    value, fix = rows()["GPUs"]
    assert value == "8 AMD Instinct GPU(s) (gfx90a: MI210/MI250/MI250X) but torch sees no GPU"
    assert fix.startswith(f"{BUILT}, not ROCm; install a ROCm build: "
                          ".venv/bin/pip install --force-reinstall torch==")
    assert "torchvision==" in fix
    assert "--index-url https://download.pytorch.org/whl/rocm6.2 (ROCm 6.2 is installed here" in fix


def test_an_amd_node_whose_rocm_torch_sees_nothing_names_the_variable_and_dev_kfd(tmp_path, monkeypatch):
    amd_node(tmp_path, kfd=False)  # a container started without --device /dev/kfd
    simulate_rocm(monkeypatch, gpus=0)
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "")
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    assert rows()["GPUs"][1] == ("torch is built for ROCm 6.2 but sees no GPU: check ROCR_VISIBLE_DEVICES='' (the GPUs "
                                 "this process may see); /dev/kfd is missing here (a container needs --device "
                                 "/dev/kfd --device /dev/dri), and that you are in the render and video groups")


def test_an_aurora_node_names_xpu_its_tiles_and_xccl(tmp_path, monkeypatch):
    intel_node(tmp_path)
    simulate_xpu(monkeypatch)
    assert rows() == {"torch": (f"{torch.__version__} (XPU on Level Zero, SYCL 20250101, oneCCL)", None),
                      "GPUs": (f"12 {PVC}", None), "backend": ("xccl (oneCCL)", None)}
    simulate_xpu(monkeypatch, xccl=False)  # an XPU torch older than 2.8
    assert rows()["backend"] == ("xccl (oneCCL)", f"torch {torch.__version__} has no xccl backend: install a torch "
                                                  "built for XPU with it")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a real NVIDIA driver is present")
def test_an_aurora_node_with_a_cuda_torch_is_not_ready(tmp_path, capsys):
    """The whole doctor, as 00's first cell runs it, on an Aurora node where `make install` put CUDA wheels over the
    site's XPU torch. Control: f7f8195's doctor printed "GPUs none: CPU presets (gloo)" and "ready" there."""
    from tutorial.core.deepspeed_compat import import_deepspeed
    import_deepspeed()  # DeepSpeed keeps the accelerator it finds at import: this machine's, as in 00
    intel_node(tmp_path)
    assert cli.doctor([]) == 1
    out = capsys.readouterr()
    assert "MISSING 6 Intel Data Center GPU Max card(s) but torch sees no GPU" in out.out and "ready" not in out.out
    fix = next(line for line in out.err.splitlines() if line.startswith("missing GPUs:"))
    assert fix.startswith(f"missing GPUs: {BUILT}, not XPU; install the XPU "
                          "build: .venv/bin/pip install --force-reinstall torch==")
    assert fix.endswith("--index-url https://download.pytorch.org/whl/xpu, or use the site's XPU torch (on Aurora: "
                        "module load frameworks, then SITE_TORCH=1 make install)")


def test_an_aurora_node_whose_xpu_torch_sees_nothing_names_ze_affinity_mask(tmp_path, monkeypatch):
    intel_node(tmp_path)
    simulate_xpu(monkeypatch, tiles=0)
    monkeypatch.setenv("ZE_AFFINITY_MASK", "6")  # card 6 of a 6-card node: nothing
    assert rows()["GPUs"] == ("6 Intel Data Center GPU Max card(s) but torch sees no GPU",
                              "torch is built for XPU but sees no GPU: check ZE_AFFINITY_MASK='6' (the GPUs this "
                              "process may see), the Level Zero loader (level-zero package) and that you are in the "
                              "render group")


def test_a_laptops_intel_or_radeon_graphics_leaves_it_ready(tmp_path):
    """Negative control of the two above: integrated graphics publish the same files, with a laptop's ids."""
    intel_node(tmp_path, cards=1, ids=("0x8086", "0x46a6"))
    amd_node(tmp_path, versions=(110003,), rocm=None)
    assert rows()["GPUs"] == ("none: CPU presets (gloo)", None)

"""core.accelerator: which vendor's GPUs torch is built for and sees, their backend, bf16 and FP8, and the GPUs a
machine has that torch cannot see.

No ROCm or XPU build of torch can run here, so simulate_rocm and simulate_xpu set what such a build answers (its
version strings, device counts, names, architectures) on this CUDA build; everything else runs as it is. The
machine's GPUs are published by the drivers under /sys: amd_node and intel_node write those files in a folder.
test_doctor uses the same simulations for `tutorial doctor`."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT

from tutorial.core import accelerator
from tutorial.core.config import ConfigError
from tutorial.core.precision import Precision, fp8_line

MI250X, MI300X = ("AMD Instinct MI250X", "gfx90a:sramecc+:xnack-", (9, 0)), ("AMD Instinct MI300X", "gfx942", (9, 4))
PVC = "Intel(R) Data Center GPU Max 1550"


def simulate_rocm(monkeypatch, gpus: int = 8, gpu=MI250X) -> None:
    """A ROCm build of torch on an AMD node, as it answers: device type "cuda", torch.version.hip set and cuda None,
    its GPUs through torch.cuda with their gfx architecture, RCCL's version through torch.cuda.nccl."""
    name, arch, capability = gpu
    monkeypatch.setattr(torch.version, "hip", "6.2.41133-dd7f95766")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(name=name, gcnArchName=arch, major=capability[0],
                                                            minor=capability[1]))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 20, 5))


def simulate_xpu(monkeypatch, tiles: int = 12, xccl: bool = True, bf16: bool = True) -> None:
    """An XPU build of torch on an Aurora node: device type "xpu", torch.version.xpu set and cuda None, 12 tiles of
    Data Center GPU Max 1550 through torch.xpu, and the xccl backend (torch >= 2.8) unless xccl=False."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "xpu", "20250101")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("xpu"))
    monkeypatch.setattr(torch.xpu, "is_available", lambda: tiles > 0)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: tiles)
    monkeypatch.setattr(torch.xpu, "get_device_name", lambda device=None: PVC)
    monkeypatch.setattr(torch.xpu, "is_bf16_supported", lambda including_emulation=True: bf16)
    available = dist.is_backend_available
    monkeypatch.setattr(dist, "is_backend_available", lambda name: xccl if name == "xccl" else available(name))


@pytest.fixture(autouse=True)
def no_gpus_on_this_machine(tmp_path, monkeypatch):
    """The drivers' files are read from empty folders unless a test writes a node there (so that a developer's own
    GPU does not change what the tests see)."""
    for name in ("DRM", "KFD_NODES"):
        (tmp_path / name).mkdir()
        monkeypatch.setattr(accelerator, name, tmp_path / name)
    monkeypatch.setattr(accelerator, "KFD_DEVICE", tmp_path / "no-dev-kfd")
    monkeypatch.setattr(accelerator, "ROCM_INFO", tmp_path / "no-rocm-info")


def amd_node(tmp_path, versions=(90010,) * 8, rocm: str | None = "6.2.4-120", kfd: bool = True) -> None:
    """What ROCm's driver publishes: a KFD topology node per CPU socket (gfx_target_version 0) and per GPU die
    (90010 is gfx90a: an MI250X is two of them), /dev/kfd, and /opt/rocm/.info/version."""
    for i, version in enumerate((0, *versions)):
        (tmp_path / "KFD_NODES" / str(i)).mkdir()
        (tmp_path / "KFD_NODES" / str(i) / "properties").write_text(
            f"cpu_cores_count {0 if version else 64}\nsimd_count {440 if version else 0}\n"
            f"gfx_target_version {version}\nvendor_id {4098 if version else 0}\n")
    if kfd:
        accelerator.KFD_DEVICE.write_text("")
    if rocm:
        accelerator.ROCM_INFO.write_text(rocm + "\n")


def intel_node(tmp_path, cards: int = 6, ids: tuple[str, str] = ("0x8086", "0x0bd5")) -> None:
    """What the i915 driver publishes: a render node per PCI GPU with its vendor and device id (0x0bd5: Max 1550)."""
    for i in range(cards):
        device = tmp_path / "DRM" / f"renderD{128 + i}" / "device"
        device.mkdir(parents=True)
        (device / "vendor").write_text(ids[0] + "\n")
        (device / "device").write_text(ids[1] + "\n")


def test_this_machine_is_what_its_torch_says():
    """This machine: a CUDA build of torch and no GPU, so the CPU's gloo; the backends torch names per device."""
    assert accelerator.vendor() is (accelerator.NVIDIA if torch.version.cuda else None)
    assert accelerator.device_count() == 0 and accelerator.device_names() == []
    assert accelerator.backend() == "gloo" and accelerator.library_version() is None
    assert (accelerator.backend("cuda"), accelerator.backend("xpu"), accelerator.backend(torch.device("cpu"))) == \
        ("nccl", "xccl", "gloo")
    if torch.version.cuda:
        assert accelerator.runtime() == f"CUDA {torch.version.cuda}"


def test_rocm_is_told_from_cuda_by_torch_version_hip(monkeypatch):
    """A ROCm build calls its GPUs "cuda" and RCCL "nccl": only torch.version.hip names AMD. Control: f7f8195's doctor
    read torch.version.cuda alone and called this torch a CPU build."""
    simulate_rocm(monkeypatch)
    assert accelerator.device_type() == "cuda" and accelerator.vendor() is accelerator.AMD
    assert accelerator.runtime() == "ROCm 6.2" and accelerator.library_version() == "2.20.5"
    assert accelerator.backend() == "nccl" and accelerator.AMD.library == "RCCL"
    assert accelerator.device_names() == ["AMD Instinct MI250X"] * 8
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "0,1")
    assert accelerator.visible_devices(accelerator.AMD) == {"ROCR_VISIBLE_DEVICES": "0,1"}
    monkeypatch.setattr(torch.version, "hip", None)  # control: the same answers without hip are NVIDIA's
    assert accelerator.vendor() is accelerator.NVIDIA


def test_xpu_is_intel_with_xccl(monkeypatch):
    simulate_xpu(monkeypatch)
    assert accelerator.vendor() is accelerator.INTEL and accelerator.backend() == "xccl"
    assert accelerator.device_names() == [PVC] * 12 and accelerator.runtime() == "XPU on Level Zero, SYCL 20250101"
    assert accelerator.library_version() is None  # torch reports no oneCCL version
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0.0")
    assert accelerator.visible_devices(accelerator.INTEL) == {"ZE_AFFINITY_MASK": "0.0"}


OCP, FNUZ = accelerator.OCP_FP8, accelerator.FNUZ_FP8


@pytest.mark.parametrize("name, capability, want", [
    ("NVIDIA H100 80GB HBM3", (9, 0), OCP), ("NVIDIA L40S", (8, 9), OCP), ("NVIDIA A100-SXM4-40GB", (8, 0), ()),
    ("Tesla V100-SXM2-32GB", (7, 0), ())])
def test_fp8_on_nvidia_from_compute_capability_8_9(monkeypatch, name, capability, want):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert accelerator.fp8_formats(torch.device("cuda", 0)) == want
    assert fp8_line(torch.device("cuda", 0)).startswith(
        f"FP8 matmuls on this device ({name}, compute capability {capability[0]}.{capability[1]}): "
        + ("yes, float8_e4m3fn and float8_e5m2" if want else "no: they need compute capability 8.9"))


@pytest.mark.parametrize("gpu, want", [(MI250X, ()), (MI300X, FNUZ), (("AMD Instinct MI355X", "gfx950", (9, 5)), OCP)])
def test_fp8_on_amd_from_the_architecture_not_the_capability(monkeypatch, gpu, want):
    """MI250X is gfx90a, which torch reports as capability (9, 0): the NVIDIA rule (>= 8.9, 04's cell on f7f8195)
    says FP8 yes, the control below. MI300 multiplies AMD's fnuz formats, MI350 the OCP ones."""
    simulate_rocm(monkeypatch, gpu=gpu)
    device = torch.device("cuda", 0)
    assert accelerator.fp8_formats(device) == want
    if gpu is MI250X:
        assert torch.cuda.get_device_capability(device) >= (8, 9)  # the rule that got it wrong
        assert fp8_line(device) == ("FP8 matmuls on this device (AMD Instinct MI250X, gfx90a): no: on AMD GPUs they "
                                    "start with MI300 (gfx942); MI250X is gfx90a")
    if gpu is MI300X:
        assert fp8_line(device) == ("FP8 matmuls on this device (AMD Instinct MI300X, gfx942): yes, float8_e4m3fnuz "
                                    "and float8_e5m2fnuz")


def test_no_fp8_on_intel_max_or_a_cpu_and_04s_stored_line_holds(monkeypatch):
    stored = [line for cell in json.loads((ROOT / "notebooks" / "04_mixed_precision.ipynb").read_text())["cells"]
              for out in cell.get("outputs", []) for line in "".join(out.get("text", "")).splitlines()
              if line.startswith("FP8 matmuls on this device")]
    assert stored == [fp8_line(torch.device("cpu"))]  # 04's cell may call fp8_line: its CPU output stays as stored
    assert accelerator.fp8_formats(torch.device("cpu")) == ()
    simulate_xpu(monkeypatch)
    assert accelerator.fp8_formats(torch.device("xpu", 0)) == ()
    assert fp8_line(torch.device("xpu", 0)) == (f"FP8 matmuls on this device ({PVC}): no: Intel's Data Center GPU "
                                                "Max multiplies 8-bit integers, not FP8")


def test_precision_takes_fp16_and_bf16_on_every_vendor_and_refuses_them_as_before_on_a_cpu(monkeypatch):
    """fp16 with loss scaling runs on AMD and Intel GPUs too; a CPU still gets f7f8195's one line. An Intel GPU
    without bf16 is refused naming it."""
    with pytest.raises(ConfigError, match=r"^precision fp16 needs a CUDA GPU \(no fast fp16 kernels or loss scaling "
                                          r"on a CPU\); use --precision bf16 or fp32 here$"):
        Precision("fp16", torch.device("cpu"))
    assert Precision("bf16", torch.device("cpu")).dtype == torch.bfloat16
    simulate_xpu(monkeypatch)
    fp16 = Precision("fp16", torch.device("xpu", 0))  # f7f8195 refused it: "needs a CUDA GPU"
    assert fp16.dtype == torch.float16 and fp16.scaler.is_enabled()
    assert Precision("bf16", torch.device("xpu", 0)).dtype == torch.bfloat16
    simulate_xpu(monkeypatch, bf16=False)
    refusal = f"precision bf16 needs a GPU with bf16 arithmetic; {PVC} has none: use --precision fp16"
    with pytest.raises(ConfigError, match="^" + re.escape(refusal)):
        Precision("bf16", torch.device("xpu", 0))


def test_precision_takes_bf16_on_mi250x(monkeypatch):
    """torch's own answer on ROCm (every GPU it runs on has bf16), although MI250X's capability (9, 0) is not the
    point: a V100's refusal (test_trainers) comes from torch.cuda.is_bf16_supported too."""
    simulate_rocm(monkeypatch)
    assert accelerator.has_bf16(torch.device("cuda", 0))
    assert Precision("bf16", torch.device("cuda", 0)).dtype == torch.bfloat16


def test_the_gpus_a_node_has_are_read_from_the_drivers_files(tmp_path):
    """Instinct dies and Data Center GPU Max cards count; a laptop's Radeon (gfx1103) or Intel graphics (0x46a6) and
    an NVIDIA card's render node do not (the NVIDIA driver is nvidia-smi's)."""
    assert accelerator.amd_gpus() == [] and accelerator.intel_gpus() == [] and accelerator.node_rocm() is None
    amd_node(tmp_path, versions=(90010, 90010, 90402, 110003))
    assert accelerator.amd_gpus() == ["gfx90a", "gfx90a", "gfx942"] and accelerator.node_rocm() == "6.2"
    intel_node(tmp_path, cards=6)
    assert accelerator.intel_gpus() == ["0x0bd5"] * 6


@pytest.mark.parametrize("ids", [("0x8086", "0x46a6"), ("0x10de", "0x2330")])
def test_a_laptops_graphics_is_not_a_gpu_node(tmp_path, ids):
    intel_node(tmp_path, cards=1, ids=ids)
    amd_node(tmp_path, versions=(110003,), rocm=None)  # a Ryzen laptop's Radeon 780M
    assert accelerator.intel_gpus() == [] and accelerator.amd_gpus() == []


def test_a_torch_older_than_torch_accelerator_gets_the_same_answers(monkeypatch):
    """A site's torch before 2.6 has neither torch.accelerator nor dist.get_default_backend_for_device: the version
    strings and the device modules give the same answers, on this machine, on ROCm and on XPU."""
    def answers():
        return (accelerator.device_type(), accelerator.vendor(), accelerator.backend(), accelerator.backend("cuda"),
                accelerator.backend("xpu"), accelerator.backend("cpu"))

    for simulate in (None, simulate_rocm, simulate_xpu):
        with monkeypatch.context() as node:
            if simulate:
                simulate(node)
            want = answers()
            node.delattr(torch, "accelerator")
            node.delattr(dist, "get_default_backend_for_device")
            assert answers() == want, simulate

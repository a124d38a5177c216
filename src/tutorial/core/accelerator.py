"""Which GPUs the torch in this process is built for and sees: NVIDIA (CUDA), AMD (ROCm) or Intel (XPU).

torch calls two of them "cuda": a ROCm build answers through torch.cuda (HIP copies CUDA's API) and names RCCL
"nccl", so only torch.version.hip tells AMD from NVIDIA. Intel's GPUs are "xpu", with oneCCL behind the "xccl"
backend. `tutorial doctor` (00_setup) reports what is found here, 04_mixed_precision asks which FP8 formats a device
multiplies, 07_scaling_study which device a peak belongs to.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .visible import GPU_DEVICE_TYPES, HIDDEN


@dataclass(frozen=True)
class Vendor:
    key: str                            # "cuda", "rocm" or "xpu"
    company: str
    device_type: str                    # torch's name for the device: "cuda" on NVIDIA and on AMD
    runtime: str                        # what torch is built for
    library: str                        # the collective library behind the backend
    visible_devices: tuple[str, ...]    # the variables that pick (or, set empty, hide) the GPUs a process sees
    wheels: str                         # pytorch.org's wheel index for this runtime, less the version for CUDA, ROCm


WHEELS = "https://download.pytorch.org/whl/"
NVIDIA = Vendor("cuda", "NVIDIA", "cuda", "CUDA", "NCCL", ("CUDA_VISIBLE_DEVICES",), WHEELS + "cu")
# ROCR_VISIBLE_DEVICES is applied by the ROCm runtime, HIP_VISIBLE_DEVICES on top of it (both count from 0).
AMD = Vendor("rocm", "AMD", "cuda", "ROCm", "RCCL", ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"), WHEELS + "rocm")
# Level Zero's mask of the devices a process sees: "0,1", or "0.1" for tile 1 of card 0 (Aurora's 6 cards are 12
# tiles, 12 devices to torch).
INTEL = Vendor("xpu", "Intel", "xpu", "XPU", "oneCCL", ("ZE_AFFINITY_MASK",), WHEELS + "xpu")


def device_type() -> str | None:
    """torch's accelerator for this build ("cuda", "xpu"), whether or not it sees a device; None: a CPU-only build."""
    if hasattr(torch, "accelerator"):  # torch >= 2.6; the floor has it, a site's older torch may not
        current = torch.accelerator.current_accelerator()
        return current.type if current is not None else None
    if torch.version.cuda or getattr(torch.version, "hip", None):
        return "cuda"
    return "xpu" if getattr(torch, "xpu", None) is not None and torch.xpu.is_available() else None


def vendor() -> Vendor | None:
    """The GPU vendor this torch is built for; None on a CPU-only build (or an accelerator this course does not use,
    such as Apple's mps)."""
    kind = device_type()
    if kind == "cuda":
        return AMD if getattr(torch.version, "hip", None) else NVIDIA
    return INTEL if kind == "xpu" else None


def device_count() -> int:
    """How many GPUs this process sees (after its visible-devices variable); 0 on a CPU."""
    found = vendor()
    # The device module's count (torch.cuda, torch.xpu) is what torch.accelerator.device_count() answers; the
    # simulated GPUs and the tests' fakes set it there.
    return getattr(torch, found.device_type).device_count() if found else 0


def gpu_type() -> str:
    """torch's device type of the GPUs this process sees ("cuda" on NVIDIA and AMD, "xpu" on Intel), "cpu" where it
    sees none; asks no GPU (nothing is initialised to answer)."""
    return vendor().device_type if device_count() else "cpu"


def device_module():
    """torch's module for the GPUs this process sees (torch.cuda on NVIDIA and AMD, torch.xpu on Intel), for what
    torch.accelerator does not cover (events, RNG state, device properties); None where it sees no GPU."""
    found = vendor()
    return getattr(torch, found.device_type) if found and device_count() else None


def device_names() -> list[str]:
    """The name of every GPU this process sees, by index; [] on a CPU."""
    return [device_name(torch.device(vendor().device_type, i)) for i in range(device_count())]


def device_name(device: torch.device) -> str:
    """What the vendor's driver calls this device ("NVIDIA H100 80GB HBM3", "AMD Instinct MI250X",
    "Intel(R) Data Center GPU Max 1550"); "CPU" for a CPU."""
    if device.type not in GPU_DEVICE_TYPES:
        return "CPU"
    return getattr(torch, device.type).get_device_name(device)


def runtime() -> str | None:
    """"CUDA 13.0", "ROCm 6.2", "XPU on Level Zero, SYCL 20250101", or None on a CPU-only build."""
    found = vendor()
    if found is NVIDIA:
        return f"CUDA {torch.version.cuda}"
    if found is AMD:
        return "ROCm " + ".".join(torch.version.hip.split(".")[:2])  # hip is "6.2.41133-dd7f95766"
    if found is INTEL:
        sycl = getattr(torch.version, "xpu", None)  # the SYCL compiler's date; some XPU builds leave it None
        return f"XPU on Level Zero, SYCL {sycl}" if sycl else "XPU on Level Zero"
    return None


def backend(device: torch.device | str | None = None) -> str:
    """The collective backend torch picks for the device (this process's GPU when None): nccl on NVIDIA and AMD
    (RCCL under NCCL's name), xccl on Intel, gloo on a CPU."""
    if device is None:
        found = vendor()
        device = found.device_type if found and device_count() else "cpu"
    kind = torch.device(device).type
    if hasattr(dist, "get_default_backend_for_device"):  # torch >= 2.6, as torch.accelerator
        try:
            return dist.get_default_backend_for_device(kind)
        except ValueError:  # a device type with no backend registered
            return "gloo"
    return {"cuda": "nccl", "xpu": "xccl"}.get(kind, "gloo")


def library_version() -> str | None:
    """The NCCL (or, on ROCm, RCCL) version this torch carries, where it sees a GPU; oneCCL gives torch none."""
    found = vendor()
    if found in (NVIDIA, AMD) and device_count():
        return ".".join(map(str, torch.cuda.nccl.version()))
    return None


# --- which GPUs a child process sees (engines, launches, ranks moved to the CPU)

def visible_variable() -> str:
    """The variable that names the GPUs a process sees, for this torch's vendor: CUDA_VISIBLE_DEVICES on NVIDIA (and
    on a CPU-only build, the course's default), ZE_AFFINITY_MASK on Intel; on AMD ROCR_VISIBLE_DEVICES, unless this
    process was given HIP_VISIBLE_DEVICES or its alias CUDA_VISIBLE_DEVICES: HIP applies those on top of ROCR's list
    and counts in it, so their names are the ones this process's GPUs have."""
    found = vendor() or NVIDIA
    if found is AMD:
        return next((name for name in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES") if name in os.environ),
                    "ROCR_VISIBLE_DEVICES")
    return found.visible_devices[0]


HIDING = {"cuda": ("CUDA_VISIBLE_DEVICES",), "rocm": ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"),
          "xpu": ("ONEAPI_DEVICE_SELECTOR",)}  # each vendor's entries of visible.HIDDEN


def showing(gpus) -> dict[str, str]:
    """The environment a child process needs to see exactly these GPUs (named as visible_variable() names them);
    empty gpus hide every GPU, in this vendor's spelling (core.visible)."""
    if gpus:
        return {visible_variable(): ",".join(str(g) for g in gpus)}
    return {name: HIDDEN[name] for name in HIDING[(vendor() or NVIDIA).key]}


# --- bf16 and FP8 per vendor (04_mixed_precision, core.precision)

OCP_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)          # NVIDIA's and the OCP standard's: inf, -0, max 448
FNUZ_FP8 = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)   # MI300's: no inf, no -0, one NaN, max 240
# AMD's FP8 matrix units by architecture: MI300 (gfx942; gfx940/941 were its early parts) multiplies the fnuz
# formats, MI350 (gfx950) the OCP ones; MI250X (gfx90a) and MI100 (gfx908) have none.
ROCM_FP8 = {"gfx940": FNUZ_FP8, "gfx941": FNUZ_FP8, "gfx942": FNUZ_FP8, "gfx950": OCP_FP8}


def gfx_arch(device: torch.device) -> str:
    """An AMD GPU's architecture, "gfx90a" from "gfx90a:sramecc+:xnack-". Its compute capability is no guide:
    torch reports gfx90a as (9, 0), which NVIDIA's numbering would read as a Hopper."""
    return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]


def has_bf16(device: torch.device) -> bool:
    """bf16 arithmetic in hardware (not emulated): NVIDIA from compute capability 8.0, every ROCm GPU torch runs on,
    Intel GPUs with bf16 conversions (Max, Arc); a CPU runs bf16 autocast anyway."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)  # True on ROCm
    if device.type == "xpu":
        return torch.xpu.is_bf16_supported(including_emulation=False)
    return True


def fp8_formats(device: torch.device) -> tuple[torch.dtype, ...]:
    """The FP8 formats this device's matrix units multiply; () where there are none (a CPU, an A100, MI250X, Intel's
    Data Center GPU Max, whose XMX engines stop at 8-bit integers)."""
    if device.type != "cuda":
        return ()
    if getattr(torch.version, "hip", None):
        return ROCM_FP8.get(gfx_arch(device), ())
    return OCP_FP8 if torch.cuda.get_device_capability(device) >= (8, 9) else ()  # Ada, Hopper and later


class AllocatorWindow:
    """The GPU allocator's counters over a block (`with AllocatorWindow(device) as mem:`), through torch.accelerator
    so any vendor's: `before` (bytes allocated at the start), `max` (the most allocated during the block), `peak`
    (max less before), `kept` (allocated at the end less before). The peak counter is reset at the start and the
    device synchronized at both ends, so kernels still queued are counted. On the CPU, which has no such counters,
    all four stay None (the lessons read the profiler's memory events there)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.before = self.max = self.peak = self.kept = None

    def __enter__(self) -> "AllocatorWindow":
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
            torch.accelerator.reset_peak_memory_stats(self.device)
            self.before = torch.accelerator.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type != "cpu" and exc[0] is None:
            torch.accelerator.synchronize(self.device)
            self.max = torch.accelerator.max_memory_allocated(self.device)
            self.peak = self.max - self.before
            self.kept = torch.accelerator.memory_allocated(self.device) - self.before


def device_label(device: torch.device) -> str:
    """The device and what its precision support follows from: "NVIDIA A100-SXM4-40GB, compute capability 8.0",
    "AMD Instinct MI250X, gfx90a", "Intel(R) Data Center GPU Max 1550", "a CPU"."""
    if device.type not in GPU_DEVICE_TYPES:
        return "a CPU"
    name = device_name(device)
    if device.type == "xpu":
        return name
    if getattr(torch.version, "hip", None):
        return f"{name}, {gfx_arch(device)}"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{name}, compute capability {major}.{minor}"


# --- GPUs the machine has, seen or not by torch (tutorial doctor)
# A node whose torch cannot see its GPUs runs every notebook on the CPU without a word. What the drivers publish
# under /sys needs no tool on PATH and no subprocess. Only data-center GPUs count: a laptop's integrated Intel or
# Radeon graphics shows up there too, and its owner must not be told to install a GPU build for the CPU workbook.
DRM = Path("/sys/class/drm")                          # renderD*/device/{vendor,device}: one PCI GPU each
KFD_NODES = Path("/sys/class/kfd/kfd/topology/nodes")  # one node per CPU socket and per AMD GPU (die)
KFD_DEVICE = Path("/dev/kfd")                          # ROCm's compute device file; a container needs it passed in
INSTINCT = {"gfx908": "MI100", "gfx90a": "MI210/MI250/MI250X", "gfx940": "MI300", "gfx941": "MI300",
            "gfx942": "MI300/MI325", "gfx950": "MI350/MI355"}
ROCM_INFO = Path("/opt/rocm/.info/version")
INTEL_VENDOR_ID = "0x8086"
INTEL_MAX_IDS = "0x0b"  # PCI ids of Data Center GPU Max (Ponte Vecchio) are 0x0bxx; Intel's graphics ids are not


def nvidia_driver() -> tuple[str, str] | None:
    """(driver version, the newest CUDA it supports) from nvidia-smi, or None where there is no NVIDIA driver."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    driver, cuda = re.search(r"Driver Version:\s*([\d.]+)", out), re.search(r"CUDA Version:\s*([\d.]+)", out)
    return (driver.group(1), cuda.group(1)) if driver and cuda else None


def amd_gpus() -> list[str]:
    """The architecture of every AMD Instinct GPU (an MI250X counts as its two dies) the ROCm driver lists."""
    archs = []
    for properties in sorted(glob.glob(str(KFD_NODES / "*" / "properties"))):
        found = re.search(r"^gfx_target_version (\d+)$", _read(properties), re.M)
        version = int(found.group(1)) if found else 0  # 0 on a CPU node; 90010 is 9, 0, 10: gfx90a in hex
        arch = f"gfx{version // 10000}{version // 100 % 100:x}{version % 100:x}"
        if arch in INSTINCT:
            archs.append(arch)
    return archs


def intel_gpus() -> list[str]:
    """The PCI device id of every Intel Data Center GPU Max card (a Max 1550 is two tiles) with a render node."""
    ids = []
    for card in sorted(glob.glob(str(DRM / "renderD*" / "device"))):
        vendor_id, device_id = (_read(Path(card, f)).strip().lower() for f in ("vendor", "device"))
        if vendor_id == INTEL_VENDOR_ID and device_id.startswith(INTEL_MAX_IDS):
            ids.append(device_id)
    return ids


def _read(path) -> str:
    try:
        return Path(path).read_text()
    except OSError:  # a node unplugged or unreadable while we look: it shows no GPU
        return ""


def node_rocm() -> str | None:
    """The ROCm release installed on this machine ("6.2" from /opt/rocm/.info/version), or None."""
    found = re.match(r"(\d+\.\d+)", _read(ROCM_INFO))
    return found.group(1) if found else None


def visible_devices(found: Vendor) -> dict[str, str]:
    """The vendor's visible-devices variables that are set in this process, with their values."""
    return {name: os.environ[name] for name in found.visible_devices if name in os.environ}

"""Simulated GPUs on a CPU-only machine: the GPU branch of every cell, helper, launch and trainer, executed.

TUTORIAL_SIMGPU=N gives the node N GPUs; CUDA_VISIBLE_DEVICES picks among them as on a real node (indices; unset:
all; empty: none), so a per-task binding (each rank its own GPU as cuda:0) and a shared node's subset behave as they
would. What is simulated, and how:

- the queries: torch.cuda's and torch.accelerator's (count, current device, properties with a UUID per physical
  GPU, capability, bf16, memory), as NVIDIA's driver would answer them;
- CUDA tensors: a tensor moved or created on "cuda" is a CPU tensor whose class says cuda:<index> (SimCuda); every
  torch call made with tensors on two devices fails as CUDA would ("Expected all tensors to be on the same device");
- NCCL: a process group asked for NCCL is made with gloo and remembered as NCCL. Its ranks compare their GPUs'
  UUIDs first and fail as NCCL does when two share one ("Duplicate GPU detected"); a collective given a CPU tensor on
  it fails as NCCL does ("No backend type associated with device type cpu"). get_backend answers "nccl".

What CUDA refuses beyond devices, refused with CUDA's own words: a CUDA tensor to numpy (np.asarray, what matplotlib
and pandas do with a metric left on the GPU), pin_memory of a CUDA tensor, CUDA in a child forked after the parent
initialised it (is_initialized() is False until the first call that needs a context, as torch's lazy init), and a
checkpoint loaded without map_location onto a device this process does not see. torch.save writes a CUDA tensor's
device into the file and torch.load without map_location puts it back there, as on a GPU node (where every rank that
resumes without one piles onto the GPU rank 0 saved from).

What is measured: autocast("cuda", dtype) runs as CPU autocast with that dtype, so bf16 and fp16 branches compute in
the dtypes a GPU gives and GradScaler sees fp16's overflows; host syncs (item, tolist, bool, printing, a blocking copy
to the host) are counted per caller (host_syncs(); tests/simgpu/host_syncs.py gives them per training step);
memory as the caching allocator counts it: every live storage on its simulated GPU in 512-byte blocks, those that
autograd (gradients, values saved for backward), foreach kernels and DDP's reducer make below Python included, with a
peak, reserved segments, torch.cuda's and torch.accelerator's memory calls, and torch.cuda.OutOfMemoryError with
CUDA's message past TUTORIAL_SIMGPU_MEMORY bytes (default 80 GiB, an Intel tile's 64; set it low and a leak fails as
on a GPU).
CUDA-only kernels: SyncBatchNorm's five are computed as CUDA computes them (SYNC_BN_KERNELS), so its statistics and
collectives run on a simulated full node.

Held to a real GPU: tests/simgpu/versus_cuda.py asks the same questions of CUDA and of the simulation (what is
refused and with which words, autocast's dtypes, memory_allocated at each phase of a training step, host syncs, lazy
initialisation, NCCL's refusals, DDP's buckets); an H200's answers (results/simgpu_vs_cuda.json, 2026-11-29) and
the simulation's must agree, apart from what this docstring says is left out (test_simulated_gpus).

Other vendors (TUTORIAL_SIMGPU_VENDOR): rocm, an AMD node's ROCm build (torch.cuda's API, torch.version.hip, RCCL
under NCCL's name, ROCR_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES); xpu, an Intel node's XPU build (torch.xpu's API,
"xpu" tensors, oneCCL's xccl over gloo, ZE_AFFINITY_MASK picking tiles and ONEAPI_DEVICE_SELECTOR hiding them;
"cuda" refused, as a build without CUDA refuses it). What is said above of CUDA and NCCL holds for them with their
names, except that two ranks on one tile are not refused (oneCCL's answer is not known here: lane.py refuses it in the
package's groups).

Every process group made is recorded, one JSON line per rank in $TUTORIAL_SIMGPU_RECORD: the backend asked and the
device, the GPUs the rank sees, its environment's GPU and NCCL variables, and whether it was refused. The lane
(tests/simgpu/lane.py) checks the records against README's allocation table.

What it cannot show (README's tests section lists it for readers of a green lane): kernels, speed, streams (a
non_blocking copy is done at once; Event times the host), device-side asserts (a bad index fails at once here, where
CUDA fails later and poisons the context), NCCL's watchdog, timeouts and aborts, the temporaries that backward's
kernels make and free inside one autograd node (so a peak in backward is a lower bound: what its gradients and saved
values make it), cuDNN's and cuBLAS's workspaces, the CUDA context and fragmentation, numerics of CUDA kernels (tf32,
cuBLAS), CUDA's random numbers (each device has a CPU generator), compiling (torch.compile runs the function as it
is), and tensors that DDP's reducer, autograd, FSDP2's DTensor and DCP make below torch's Python layer (they are
plain CPU tensors here, so only CPU tensors made by Python, and what Python computes from them alone, count as the
CPU in the device check and NCCL's: DDP's buckets reach a comm hook's all-reduce as they would on a GPU, but say cpu;
memory counts them where it can find them: gradients, saved values, DDP's buckets; FSDP2's and DCP's only where
Python ops made them). The Python such code runs inside backward() (DTensor's, FSDP2's,
DDP's comm hooks) runs with the simulation on: loss.backward() starts autograd's engine itself (_backward).
Those are gpu-check's, on a real GPU; the Makefile runs 04 and 09 on the CPU for these reasons.
"""
from __future__ import annotations

import functools
import gc
import importlib.abc
import importlib.machinery
import json
import os
import re
import socket
import sys
import threading
import time
import types
import weakref

ENV_PREFIXES = ("CUDA_", "ROCR_", "HIP_", "ZE_", "ONEAPI_", "CCL_", "NCCL_", "TORCH_NCCL", "TORCH_FR", "LOCAL_RANK",
                "RANK", "WORLD_SIZE", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "TUTORIAL_")
# TUTORIAL_SIMGPU_VENDOR=rocm: an AMD node's ROCm build of torch (torch.version.hip set, cuda None, RCCL under
# NCCL's name), whose GPUs are picked by ROCR_VISIBLE_DEVICES and, on top of its list, HIP_VISIBLE_DEVICES (or its alias
# CUDA_VISIBLE_DEVICES); an MI250X's GCDs. TUTORIAL_SIMGPU_VENDOR=xpu: an Intel node's XPU build (Aurora's: 6 Data
# Center GPU Max 1550, 12 tiles, each a device of its own to torch), whose tensors are "xpu", whose collectives are
# oneCCL's behind the "xccl" backend, whose GPUs ZE_AFFINITY_MASK picks and ONEAPI_DEVICE_SELECTOR hides; torch.cuda
# sees nothing there (a CPU build for CUDA: "cuda" tensors are refused as on such a node). Default: NVIDIA's CUDA.
VENDOR = os.environ.get("TUTORIAL_SIMGPU_VENDOR", "cuda")
ROCM, XPU = VENDOR == "rocm", VENDOR == "xpu"
DEV = "xpu" if XPU else "cuda"          # torch's device type of the simulated GPUs
LIBRARY = "xccl" if XPU else "nccl"     # the backend of their collectives (RCCL is "nccl" on ROCm)
NOT_COMPILED = "Torch not compiled with CUDA enabled (simulated Intel GPUs: this torch is built for XPU)"
GPU_NAME = os.environ.get("TUTORIAL_SIMGPU_NAME", "AMD Instinct MI250X (simulated)" if ROCM else
                          "Intel(R) Data Center GPU Max 1550 (simulated)" if XPU else
                          "NVIDIA H100 80GB HBM3 (simulated)")
CAPABILITY = tuple(int(x) for x in os.environ.get("TUTORIAL_SIMGPU_CAPABILITY", "9.0").split("."))
ARCH = "gfx90a:sramecc+:xnack-" if ROCM else ""
# bytes per GPU (an H100's 80 GiB; a Max 1550 tile's 64); set low, a test meets its OOM
MEMORY = int(os.environ.get("TUTORIAL_SIMGPU_MEMORY", (64 if XPU else 80) * 2**30))


def physical() -> list[int]:
    """The node's GPUs this process sees, by physical index, in CUDA_VISIBLE_DEVICES's order (read at each call:
    the engines set it before their first CUDA call, as the real driver reads it at initialisation). XPU: the tiles
    of ZE_AFFINITY_MASK, then of those, the ones ONEAPI_DEVICE_SELECTOR selects (_selected). ROCm: the
    GPUs of ROCR_VISIBLE_DEVICES (an empty one hides them all), then HIP_VISIBLE_DEVICES or CUDA_VISIBLE_DEVICES
    picks among those by their place in that list (an empty HIP list hides nothing, as ROCm/hip#3001 found)."""
    count = int(os.environ["TUTORIAL_SIMGPU"])
    if XPU:  # Level Zero's mask first (empty: no mask), then SYCL's selector over what it left
        tiles = _indices(os.environ.get("ZE_AFFINITY_MASK") or None, list(range(count)), tiles=True)
        selector = os.environ.get("ONEAPI_DEVICE_SELECTOR")
        return tiles if selector is None else _selected(selector, tiles)
    if not ROCM:
        return _indices(os.environ.get("CUDA_VISIBLE_DEVICES"), list(range(count)))
    seen = _indices(os.environ.get("ROCR_VISIBLE_DEVICES"), list(range(count)))
    on_top = next((os.environ[n] for n in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES") if os.environ.get(n)), None)
    return _indices(on_top, seen)


def _indices(listed: str | None, among: list[int], tiles: bool = False) -> list[int]:
    """The members of `among` a visible-devices list names by position; None: all of them. tiles: Level Zero's
    card.tile names too ("2.1": tile 1 of card 2, the 6th of 12 tiles, two per card)."""
    if listed is None:
        return among
    chosen = []
    for item in listed.split(","):
        item = item.strip()
        if tiles and re.fullmatch(r"\d+\.[01]", item):
            item = str(2 * int(item.split(".")[0]) + int(item.split(".")[1]))
        if not item.isdigit() or int(item) >= len(among):
            break  # the driver stops at the first index it does not know
        chosen.append(among[int(item)])
    return chosen


def _selected(selector: str, tiles: list[int]) -> list[int]:
    """What ONEAPI_DEVICE_SELECTOR leaves of the Level Zero GPUs: terms "backend:devices" separated by ";", a "!"
    discarding; only level_zero's and "*"'s count here (devices "gpu", "*" or positions); with no accepting term at
    all, every device but the discarded ones. core.visible's "opencl:cpu" accepts no GPU: none."""
    every = set(range(len(tiles)))
    accept, discard, accepting = set(), set(), False
    for term in filter(None, (t.strip() for t in selector.split(";"))):
        negative = term.startswith("!")
        backend, _, devices = term.lstrip("!").partition(":")
        accepting |= not negative
        if backend.strip() not in ("level_zero", "*"):
            continue
        picked = set()
        for device in devices.split(","):
            device = device.strip()
            picked |= every if device in ("gpu", "*") else {int(device)} if device.isdigit() else set()
        (discard if negative else accept).update(picked & every)
    return [tiles[i] for i in sorted((accept if accepting else every) - discard)]


def uuid(index: int) -> str:
    return f"GPU-5133d0{physical()[index]:02d}-0000-4000-8000-00000000000{physical()[index] % 10}"


_current = threading.local()

# CUDA's initialisation, per process as the driver's: the first call that needs a context (a tensor on the GPU,
# set_device, a device's properties, a stream) initialises it; is_available and device_count do not (NVML). A child
# forked after that finds CUDA unusable, as torch's at-fork hook makes it ("bad fork").
_init = {"done": False, "bad_fork": False}
BAD_FORK = (f"Cannot re-initialize {DEV.upper()} in forked subprocess. To use {DEV.upper()} with multiprocessing, "
            "you must use the "
            "'spawn' start method (simulated GPUs)")


def lazy_init() -> None:
    if _init["bad_fork"]:
        raise RuntimeError(BAD_FORK)
    if not _init["done"] and physical():
        _init["done"] = True
        follow()


def visible() -> list[int]:
    """physical(), for torch.cuda's and torch.accelerator's answers: a process whose GPUs became visible after torch's
    import starts following its tensors when it first asks for them (what code does before it uses a GPU)."""
    found = physical()
    if found:
        follow()
    return found


def follow() -> None:
    if not _following[0]:
        _following[0] = True
        enter_mode()


def _after_fork_in_child() -> None:
    _init["bad_fork"], _init["done"] = _init["done"], False
    # A forked child (a DataLoader worker) leaves what it inherited to the parent: the simulation's own objects (a
    # weak reference and an entry per live storage) would otherwise bring the child's first full collection forward,
    # a pause of 0.3 s that a GPU run does not have (01's loader exercise read it as the loader being slow).
    gc.freeze()


os.register_at_fork(after_in_child=_after_fork_in_child)


def current_device() -> int:
    return getattr(_current, "index", 0)


def _check_index(device) -> int:
    import torch

    if isinstance(device, torch.device):
        device = device.index if device.index is not None else current_device()
    elif isinstance(device, str):
        device = torch.device(device).index or 0
    elif device is None:
        device = current_device()
    if not 0 <= device < len(physical()):
        raise RuntimeError(f"{'XPU' if XPU else 'CUDA'} error: invalid device ordinal {device} (simulated: "
                           f"{len(physical())} visible)")
    return device


def set_device(device) -> None:
    index = _check_index(device)
    lazy_init()
    _current.index = index


def properties(device=None):
    index = _check_index(device)
    lazy_init()
    return types.SimpleNamespace(name=GPU_NAME, total_memory=MEMORY, major=CAPABILITY[0], minor=CAPABILITY[1],
                                 multi_processor_count=132, uuid=uuid(index), is_integrated=False,
                                 L2_cache_size=50 * 2**20, gcnArchName=ARCH, has_fp64=True, gpu_eu_count=448,
                                 platform_name="Intel(R) oneAPI Unified Runtime over Level-Zero" if XPU else "")


class Event:
    """torch.cuda.Event: times with the host clock (the simulated GPU has no queue of its own)."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1000.0


class Stream:
    def __init__(self, device=None, priority=0, **_):
        import torch

        self.device = torch.device(DEV, _check_index(device) if physical() else 0)
        lazy_init()
        self.device_index, self.device_type, self.stream_id = self.device.index, DEV, 0

    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or Event()
        event.record()
        return event

    def query(self):
        return True

    def is_capturing(self):
        return False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_generators: dict = {}


def _generator(device=None):
    """The random number generator of a simulated GPU: a CPU generator per device (what CUDA's draws would be is
    not simulated, only that each device has its own state to save and restore)."""
    import torch

    if not physical():  # torch.cuda.manual_seed and friends do nothing where no GPU is visible
        return torch.Generator()
    index = _check_index(device if device not in ("cuda", "xpu") else None)
    if index not in _generators:
        _generators[index] = torch.Generator()
    return _generators[index]


# -- memory, as CUDA's caching allocator counts it ---------------------------------------------------------------
# Every storage the simulation puts on a GPU (an op's output, a move, a parameter, a gradient autograd made below
# Python, DDP's buckets) is counted on its device from the moment it is tagged until the storage itself is freed:
# a weak reference to the storage object (torch keeps one Python object per storage for as long as the storage
# lives, views and C++ owners included) says when. Sizes are rounded as the allocator rounds a request (512-byte
# blocks), so memory_allocated reads as it does on a GPU, and an allocation past TUTORIAL_SIMGPU_MEMORY raises
# torch.cuda.OutOfMemoryError with CUDA's message. Reserved memory is what a cache would hold: allocated memory's
# high-water mark in 2 MiB segments, given back by empty_cache().
BLOCK, SEGMENT = 512, 2 * 2**20
_live: dict = {}  # storage key -> [device index, rounded bytes, weak reference to the storage or its owner]
_allocated: dict = {}  # device index -> bytes
_peak: dict = {}
_reserved: dict = {}
_peak_reserved: dict = {}
_ooms: dict = {}
# Leaf tensors on a simulated GPU that require grad (parameters): autograd makes their gradients below Python, as
# plain CPU tensors that no op of the simulation sees. A hook on each counts its gradient as autograd accumulates it
# (so a peak in backward holds them), and a memory query looks again (_sweep: a gradient assigned or swapped in).
_leaves: dict = {}
_bucketed: dict = {}  # id of a parameter whose gradient will be a view of DDP's bucket -> the bucket's count


def _rounded(nbytes: int, unit: int = BLOCK) -> int:
    return -(-nbytes // unit) * unit


def _size(n: float) -> str:
    """Bytes as the caching allocator's messages write them (c10's format_size)."""
    if n <= 1024:
        return f"{int(n)} bytes"
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20)):
        if n <= scale * 1024:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**30:.2f} GiB"


def _freed(key, ref=None) -> None:
    entry = _live.get(key)
    if entry is not None and (ref is None or entry[2] is ref):
        del _live[key]
        _allocated[entry[0]] = _allocated.get(entry[0], 0) - entry[1]


def _allocate(key, index: int, nbytes: int, owner) -> None:
    """Count nbytes on GPU index until owner (a storage, or what holds a storage Python never sees) is freed."""
    import torch

    entry = _live.get(key)
    if entry is not None:
        if entry[2]() is not None:
            return  # a view, or a tensor tagged again: one storage, counted once
        _freed(key)  # a freed storage whose address a new one took before its weak reference was called
    size = _rounded(nbytes)
    if not size:
        return  # CUDA allocates nothing for an empty tensor
    total = _allocated.get(index, 0) + size
    if total > MEMORY:
        _ooms[index] = _ooms.get(index, 0) + 1
        reserved = max(_reserved.get(index, 0), _allocated.get(index, 0))
        raise torch.cuda.OutOfMemoryError(
            f"{DEV.upper()} out of memory. Tried to allocate {_size(size)}. GPU {index} has a total capacity of "
            f"{_size(MEMORY)} of which {_size(MEMORY - reserved)} is free. Including non-PyTorch memory, this process "
            f"has {_size(reserved)} memory in use. Of the allocated memory {_size(_allocated.get(index, 0))} is "
            f"allocated by PyTorch, and {_size(reserved - _allocated.get(index, 0))} is reserved by PyTorch but "
            f"unallocated." + ("" if XPU else " If reserved but unallocated memory is large try setting "
                               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.") +
            " (simulated GPUs)")
    _live[key] = [index, size, weakref.ref(owner, functools.partial(_freed, key))]
    _allocated[index] = total
    _grew(index, total)


def _grew(index: int, total: int) -> None:
    if total > _peak.get(index, 0):
        _peak[index] = total
    if total > _reserved.get(index, 0):
        _reserved[index] = min(_rounded(total, SEGMENT), MEMORY)
        _peak_reserved[index] = max(_peak_reserved.get(index, 0), _reserved[index])


def _track(t, index: int) -> None:
    """Count t's storage on GPU index (t: a tensor the simulation has just put there)."""
    import torch

    with torch._C.DisableTorchFunction():
        storage = t.untyped_storage()
        _allocate(storage._cdata, index, storage.nbytes(), storage)
        if type(t) is SimCuda and t.requires_grad and t.is_leaf and id(t) not in _leaves:
            _leaves[id(t)] = weakref.ref(t, lambda _, key=id(t): _leaves.pop(key, None))
            t.register_post_accumulate_grad_hook(_grad_made)


def _grad_made(leaf) -> None:
    import torch

    with torch._C.DisableTorchFunction():
        grad = torch._C.TensorBase.grad.__get__(leaf)
    if grad is not None and type(leaf) is SimCuda:
        _track(grad, on(leaf))
        _freed(_bucketed.pop(id(leaf), None))  # a view of DDP's bucket: the bucket is counted through it now


_SAVED: dict = {}  # autograd node class -> the names of its saved values


def _track_saved(out, inputs, index: int) -> None:
    """Count what the autograd nodes of one op saved for backward that Python never saw: the log-softmax inside
    cross_entropy, layer norm's statistics, dropout's mask. They are found on the nodes the op added (from its
    outputs' grad_fn back to its inputs'); outside saved-tensor hooks only, whose packing decides what is kept (and
    where reading a saved value would run checkpointing's recomputation)."""
    import torch

    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return
    with torch._C.DisableTorchFunction():
        outs = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)] \
            if isinstance(out, (list, tuple)) else []
        todo = [t.grad_fn for t in outs if t.grad_fn is not None]
        if not todo:
            return
        stop = {t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        seen = 0
        while todo and seen < 16:  # an op adds a node or a few; a long walk would be a graph built before it
            node = todo.pop()
            if node in stop or type(node).__name__ == "AccumulateGrad":
                continue
            seen += 1
            names = _SAVED.get(type(node))
            if names is None:
                names = _SAVED[type(node)] = [a for a in dir(node) if a.startswith("_saved_")]
            for name in names:
                value = getattr(node, name)
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, torch.Tensor) and type(t) is not SimCuda:
                        _track(t, index)
            todo.extend(n for n, _ in node.next_functions if n is not None)


def _sweep() -> None:
    """Before a memory query: count the gradients autograd and DDP's reducer made for the GPU's leaves, and the
    storages' sizes now (a storage resized in place, as FSDP frees and refills its unsharded parameters)."""
    import torch

    with torch._C.DisableTorchFunction():
        for ref in list(_leaves.values()):
            leaf = ref()
            grad = torch._C.TensorBase.grad.__get__(leaf) if type(leaf) is SimCuda and leaf.is_leaf else None
            if grad is not None:
                _tag(grad, on(leaf)) if type(grad) is not SimCuda else _track(grad, on(grad))
                _freed(_bucketed.pop(id(leaf), None))
        totals: dict = {}
        for entry in list(_live.values()):
            owner = entry[2]()
            if isinstance(owner, torch.UntypedStorage):
                entry[1] = _rounded(owner.nbytes())
            if owner is not None:
                totals[entry[0]] = totals.get(entry[0], 0) + entry[1]
    for index in set(_allocated) | set(totals):
        _allocated[index] = totals.get(index, 0)
        _grew(index, _allocated[index])


def _queried(device):
    """The device a memory call asks about, None where CUDA was never initialised (torch answers 0 there)."""
    if not _init["done"] or _init["bad_fork"]:
        return None
    index = _check_index(device)
    _sweep()
    return index


def memory_allocated(device=None) -> int:
    index = _queried(device)
    return 0 if index is None else _allocated.get(index, 0)


def max_memory_allocated(device=None) -> int:
    index = _queried(device)
    return 0 if index is None else _peak.get(index, 0)


def memory_reserved(device=None) -> int:
    index = _queried(device)
    return 0 if index is None else _reserved.get(index, 0)


def max_memory_reserved(device=None) -> int:
    index = _queried(device)
    return 0 if index is None else _peak_reserved.get(index, 0)


def reset_peak_memory_stats(device=None) -> None:
    index = _queried(device)
    if index is not None:
        _peak[index], _peak_reserved[index] = _allocated.get(index, 0), _reserved.get(index, 0)


def empty_cache() -> None:
    for index in list(_reserved):
        _reserved[index] = min(_rounded(_allocated.get(index, 0), SEGMENT), MEMORY)


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) as the driver answers: what the cache holds is not free."""
    index = _queried(device)
    return MEMORY - (0 if index is None else _reserved.get(index, 0)), MEMORY


def memory_stats(device=None) -> dict:
    """The caching allocator's counters the course reads, under torch's names (a process that never initialised
    CUDA gets {}, as from torch)."""
    index = _queried(device)
    if index is None:
        return {}
    stats = {"num_ooms": _ooms.get(index, 0), "num_alloc_retries": 0}
    for name, now, peak in (("allocated_bytes", _allocated, _peak), ("active_bytes", _allocated, _peak),
                            ("reserved_bytes", _reserved, _peak_reserved)):
        stats.update({f"{name}.all.current": now.get(index, 0), f"{name}.all.peak": peak.get(index, 0)})
    return stats


def _patch_ddp(torch) -> None:
    """DDP's reducer allocates its buckets below Python (as many bytes as the parameters that need gradients), on
    the parameters' GPU, when it is made: counted as long as the DDP module lives. With gradient_as_bucket_view the
    gradients become views of the buckets: then the buckets are counted through the gradients once found (_sweep),
    in place of the count made at wrapping (an H200 gave the same bytes at both points, 2026-11-29)."""
    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__

    @functools.wraps(init)
    def init_(self, *args, **kwargs):
        init(self, *args, **kwargs)
        params = [p for p in self.module.parameters() if p.requires_grad and type(p) is SimCuda]
        if params:
            key = ("ddp buckets", id(self))
            _allocate(key, on(params[0]), sum(p.numel() * p.element_size() for p in params), self)
            if self.gradient_as_bucket_view:
                _bucketed.update((id(p), key) for p in params)

    DistributedDataParallel.__init__ = init_


def _patch_cuda(torch) -> None:
    """torch.cuda's answers (torch.xpu's on an Intel node) and torch.accelerator's."""
    cuda = getattr(torch, DEV)

    def nothing(*a, **k):
        return None

    patches = dict(
        is_available=lambda: bool(visible()), device_count=lambda: len(visible()), current_device=current_device,
        set_device=set_device, get_device_properties=properties,
        get_device_name=lambda device=None: properties(device).name,
        get_device_capability=lambda device=None: (properties(device).major, properties(device).minor),
        is_bf16_supported=lambda including_emulation=True: CAPABILITY >= (8, 0),
        is_initialized=lambda: _init["done"] and not _init["bad_fork"],
        _is_in_bad_fork=lambda: _init["bad_fork"],
        _lazy_init=lazy_init, init=lazy_init, synchronize=lambda device=None: lazy_init(),
        empty_cache=empty_cache, ipc_collect=nothing, reset_accumulated_memory_stats=nothing,
        Event=Event, Stream=Stream, current_stream=lambda device=None: Stream(device),
        default_stream=lambda device=None: Stream(device), stream=lambda s=None: Stream(),
        get_rng_state=lambda device=DEV: _generator(device).get_state(),
        set_rng_state=lambda state, device=DEV: _generator(device).set_state(state),
        get_rng_state_all=lambda: [_generator(i).get_state() for i in range(len(physical()))],
        set_rng_state_all=lambda states: [_generator(i).set_state(s) for i, s in enumerate(states)],
        manual_seed=lambda seed: _generator().manual_seed(seed),
        manual_seed_all=lambda seed: [_generator(i).manual_seed(seed) for i in range(len(physical()))],
        seed=lambda: _generator().seed(), seed_all=lambda: [_generator(i).seed() for i in range(len(physical()))],
        initial_seed=lambda: _generator().initial_seed(),
        get_arch_list=lambda: ["sm_90"], is_current_stream_capturing=lambda: False, set_stream=nothing,
    )
    for name, value in patches.items():
        if value is nothing:  # one function object per name: torch keeps registries keyed by function
            value = functools.wraps(value)(lambda *a, _v=value, **k: _v(*a, **k))
        setattr(cuda, name, value)
    memory = dict(memory_allocated=memory_allocated, max_memory_allocated=max_memory_allocated,
                  memory_reserved=memory_reserved, max_memory_reserved=max_memory_reserved,
                  reset_peak_memory_stats=reset_peak_memory_stats, reset_max_memory_allocated=reset_peak_memory_stats,
                  memory_stats=memory_stats, mem_get_info=mem_get_info, empty_cache=empty_cache)
    for module in (cuda, cuda.memory):  # torch.cuda's names are torch.cuda.memory's
        for name, value in memory.items():
            if hasattr(module, name):
                setattr(module, name, value)
    cuda.device = _DeviceContext
    torch.Stream, torch.Event = Stream, Event
    _patch_data_parallel(torch)
    acc = torch.accelerator
    for name, value in dict(is_available=lambda: bool(visible()), device_count=lambda: len(visible()),
                            current_device_index=current_device, current_device_idx=current_device,
                            set_device_index=set_device, set_device_idx=set_device, synchronize=nothing,
                            current_stream=lambda device=None: Stream(device), set_stream=nothing,
                            device_index=_DeviceContext,
                            current_accelerator=lambda check_available=False: torch.device(DEV)
                            if visible() or not check_available else None).items():
        if hasattr(acc, name):
            setattr(acc, name, value)
    memory.update(get_memory_info=mem_get_info)
    for module in (acc, acc.memory):  # torch.accelerator's own functions, as the same counters answer them
        for name, value in memory.items():
            if hasattr(module, name):
                setattr(module, name, functools.wraps(value)(lambda *a, _v=value, **k: _v(*a, **k)))
    _patch_ddp(torch)


def _patch_cuda_on_intel(torch) -> None:
    """On an Intel node torch.cuda answers as a build without CUDA does, without a word: no GPU, a count of 0 (whatever
    GPU the machine running the simulation has); what needs a context fails as such a build's does. Code that asks it
    where it should ask torch.accelerator trains on the CPU unawares (f7f8195's notebooks on Aurora: every cell's
    `if torch.cuda.is_available()` took the CPU branch, and the lane's groups were gloo ranks on the CPU, as the table
    allows). So every call the course makes to a torch.cuda function (a cell's, or the package's; not torch's own
    calls, nor a library's) is recorded with where it was made, and the lane fails the notebook on it. torch.cuda's
    classes (Event, Stream, amp) are not followed; autocast("cuda") is (_patch_autocast)."""
    import inspect

    def not_compiled(*args, **kwargs):
        raise AssertionError(NOT_COMPILED)

    cuda = torch.cuda
    cuda.is_available, cuda.device_count, cuda.is_initialized = (lambda: False), (lambda: 0), (lambda: False)
    cuda._lazy_init = cuda.init = cuda.set_device = cuda.current_device = cuda.get_device_properties = not_compiled

    def asked(name, fn):
        @functools.wraps(fn)
        def ask(*args, **kwargs):
            _asked_cuda(f"torch.cuda.{name}", sys._getframe(1))
            return fn(*args, **kwargs)
        return ask

    for name, value in vars(cuda).items():
        if not name.startswith("_") and inspect.isfunction(value) and \
                getattr(value, "__module__", "").startswith(("torch.cuda", __name__)):
            setattr(cuda, name, asked(name, value))


def _asked_cuda(what: str, frame) -> None:
    """Record a question put to CUDA on an Intel node, if the course put it (frame: its caller)."""
    module = frame.f_globals.get("__name__", "")
    if module == "__main__" or module.startswith("tutorial"):
        record(dict(kind="cuda asked", asked=what, where=f"{module}:{frame.f_code.co_name}:{frame.f_lineno}"))


class _DeviceContext:
    """torch.cuda.device(i): makes i current inside the block."""

    def __init__(self, device):
        self.index = _check_index(device) if device is not None and device != -1 else None

    def __enter__(self):
        self.before = current_device()
        if self.index is not None:
            set_device(self.index)

    def __exit__(self, *exc):
        set_device(self.before)
        return False


def _patch_data_parallel(torch) -> None:
    """DataParallel's copies between GPUs (torch.nn.parallel.comm, C++ with CUDA streams), done on the host."""
    from torch.nn.parallel import comm

    def index(device):
        return None if device in (-1, "cpu") else _where(device)

    def scatter(tensor, devices, chunk_sizes=None, dim=0, streams=None, out=None):
        with torch._C.DisableTorchFunction():
            chunks = tensor.split(list(chunk_sizes), dim) if chunk_sizes else tensor.chunk(len(devices), dim)
        return tuple(_move(chunk.contiguous(), index(d)) for chunk, d in zip(chunks, devices))

    def gather(tensors, dim=0, destination=None, out=None):
        with torch._C.DisableTorchFunction():
            joined = torch.cat([t.as_subclass(torch.Tensor) for t in tensors], dim)
        return _tag(joined, index(destination if destination is not None else current_device()))

    def broadcast_coalesced(tensors, devices, buffer_size=10485760):
        return [[_move(t, index(d)) if on(t) != index(d) else t for t in tensors] for d in devices]

    def reduce_add_coalesced(inputs, destination=None, buffer_size=10485760):
        with torch._C.DisableTorchFunction():
            sums = [functools.reduce(torch.add, [t.as_subclass(torch.Tensor) for t in same]) for same in zip(*inputs)]
        return [_tag(s, index(destination if destination is not None else current_device())) for s in sums]

    comm.scatter, comm.gather, comm.broadcast_coalesced, comm.reduce_add_coalesced = \
        scatter, gather, broadcast_coalesced, reduce_add_coalesced


# -- CUDA tensors ------------------------------------------------------------------------------------------------


def _tensor_classes(torch):
    class SimCuda(torch.Tensor):
        """A CPU tensor that says it lives on cuda:<index>."""

        _sim_index = 0

        @property
        def device(self):
            return torch.device(DEV, self._sim_index)

        @property
        def is_cuda(self):
            return not XPU

        @property
        def is_xpu(self):
            return XPU

        def record_stream(self, stream):  # reached with torch functions off (inside autograd Functions)
            return None

        def get_device(self):
            return self._sim_index
    return SimCuda


SimCuda = _Tensor = _Parameter = None  # set by install(), once torch is imported

# Host syncs: every read of a simulated CUDA tensor's values on the host (item, tolist, bool, int, float, printing,
# a blocking copy to the CPU), counted per caller ("module:function:line", the first frame outside torch and this
# file). On a GPU each one waits for every kernel queued before it; the course reads the loss only at log steps.
# Printing a tensor counts once here; CUDA's sync debug mode counted 21 syncs for printing 6 values on an H200
# (the formatter reads the tensor piece by piece), and a boolean mask as an index counts as nonzero does.
SYNC_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__format__", "__repr__", "__str__",
              # an output sized by the values: the host waits to learn the size (as CUDA's sync debug mode reports)
              "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}
SYNCS: dict = {}


def _count_sync(kind: str) -> None:
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("torch", __name__, "functools",
                                                                                  "contextlib")):
        frame = frame.f_back
    where = "?" if frame is None else \
        f"{frame.f_globals.get('__name__', '?')}:{frame.f_code.co_name}:{frame.f_lineno}"
    SYNCS[(where, kind)] = SYNCS.get((where, kind), 0) + 1


def host_syncs() -> dict:
    """{(caller, kind): count} of the host syncs this process made since the last reset_host_syncs()."""
    return dict(SYNCS)


def reset_host_syncs() -> None:
    SYNCS.clear()
METADATA = {"_has_compatible_shallow_copy_type", "__get__", "__set__", "copy_", "set_", "is_same_size",
            "is_pinned", "__repr__", "__format__", "_make_subclass", "__reduce_ex__", "__deepcopy__", "__setstate__"}


def on(t):
    """The simulated CUDA index a tensor is on, None for the CPU."""
    return t._sim_index if type(t) is SimCuda else None


def _on_cpu(t):
    """Mark a tensor that Python code made on the CPU. Only such tensors count as the CPU in the device check:
    tensors made below torch's Python layer (inside DTensor's dispatch, autograd's saved values, a checkpoint's
    storage) are CPU tensors here whatever device they would be on, and would be false alarms."""
    if type(t) is _Tensor:
        t._sim_cpu = True
    return t


def _made_below(t) -> bool:
    """A tensor made below torch's Python layer, whose device the simulation cannot tell: not a simulated GPU's, not a
    CPU tensor Python made (_on_cpu) and not a module's parameter (made by Python, so on the CPU unless moved). What
    Python computes from it stays unmarked too: 12's tensor-parallel attention returned its DTensor's local tensor
    (to_local), marked as a CPU tensor, and adding it to the GPU's residual stream was refused, falsely."""
    import torch

    return isinstance(t, torch.Tensor) and type(t) not in (SimCuda, _Parameter) and not getattr(t, "_sim_cpu", False)


def _tag(t, index):
    """Make t (a new tensor of an op) say cuda:index."""
    if index is not None and type(t) in (_Tensor, _Parameter):
        lazy_init()
        t.__dict__.pop("_sim_cpu", None)
        if type(t) is _Parameter:
            t._is_param = True  # isinstance(t, nn.Parameter) still holds (Parameter's metaclass reads it)
        t.__class__ = SimCuda
        t._sim_index = index
        _track(t, index)
    return t


def _move(t, index):
    """A copy of t on simulated cuda:index (None: the CPU)."""
    import torch

    if index is not None:
        lazy_init()
    with torch._C.DisableTorchFunction():
        t = t.clone()
    if index is None:
        t.__class__ = torch.Tensor
        return _on_cpu(t)
    t.__class__ = SimCuda
    t._sim_index = index
    _track(t, index)
    return t


def _where(dev):
    """A device argument as a simulated index (None: the CPU), or False where it names no device."""
    import torch

    if isinstance(dev, int) and not isinstance(dev, bool):
        return _check_index(dev)
    if isinstance(dev, str):
        try:
            dev = torch.device(dev)
        except RuntimeError:
            return False
    if isinstance(dev, torch.device):
        if dev.type == DEV:
            return _check_index(dev)
        if XPU and dev.type == "cuda":  # an Intel node's torch has no CUDA: code that names "cuda" fails there
            raise AssertionError(NOT_COMPILED)
        if dev.type == "xpu":  # and a CUDA build has no XPU
            raise RuntimeError("PyTorch is not linked with support for xpu devices (simulated GPUs: a CUDA or ROCm "
                               "build)")
        return None
    return False


# SyncBatchNorm's kernels exist for CUDA only ("Could not run 'aten::batch_norm_stats' with arguments from the 'CPU'
# backend"): the simulation computes them as the CUDA kernels do, in the input's accumulation type, with torch's own
# operations (so the results are on the inputs' simulated GPU), and a full node's SyncBatchNorm (03b) runs its
# collectives and statistics as on GPUs. torch's functions are replaced, not intercepted in the mode: its backward
# runs where the mode does not see it.
def _channel_view(t, like):
    return t.reshape([1, -1] + [1] * (like.dim() - 2))


def _reduced_dims(t):
    return [d for d in range(t.dim()) if d != 1]


def _acc(t):
    import torch
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _bn_stats(input, eps):
    x = _acc(input)
    mean, var = x.mean(_reduced_dims(x)), x.var(_reduced_dims(x), unbiased=False)
    return mean, (var + eps).rsqrt()


def _bn_gather_stats_with_counts(input, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts):
    counts = counts.to(mean_all.dtype).reshape(-1, 1)  # one row per rank: its mean, invstd and sample count
    n = counts.sum()
    mean = (mean_all * counts).sum(0) / n
    var = ((invstd_all.pow(-2) - eps + mean_all.pow(2)) * counts).sum(0) / n - mean.pow(2)
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
    if running_var is not None:  # the unbiased variance, as the CUDA kernel keeps it
        running_var.mul_(1 - momentum).add_((var * n / (n - 1)).to(running_var.dtype), alpha=momentum)
    return mean, (var + eps).rsqrt()


def _bn_elemt(input, weight, bias, mean, invstd, eps):
    out = (_acc(input) - _channel_view(mean, input)) * _channel_view(invstd, input)
    if weight is not None:
        out = out * _channel_view(weight, input)
    if bias is not None:
        out = out + _channel_view(bias, input)
    return out.to(input.dtype)


def _bn_backward_reduce(grad_output, input, mean, invstd, weight, input_g, weight_g, bias_g):
    dy, xmu = _acc(grad_output), _acc(input) - _channel_view(mean, input)
    sum_dy, sum_dy_xmu = dy.sum(_reduced_dims(dy)), (dy * xmu).sum(_reduced_dims(dy))
    grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if weight_g and weight is not None else None
    grad_bias = sum_dy.to(weight.dtype) if bias_g and weight is not None else None
    return sum_dy, sum_dy_xmu, grad_weight, grad_bias


def _bn_backward_elemt(grad_output, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    n = count.sum().to(sum_dy.dtype)
    xmu = _acc(input) - _channel_view(mean, input)
    scale = invstd * (weight if weight is not None else 1)
    grad = (_acc(grad_output) - _channel_view(sum_dy / n, input)
            - xmu * _channel_view(invstd.pow(2) * sum_dy_xmu / n, input)) * _channel_view(scale, input)
    return grad.to(input.dtype)


SYNC_BN_KERNELS = {"batch_norm_stats": _bn_stats, "batch_norm_gather_stats_with_counts": _bn_gather_stats_with_counts,
                   "batch_norm_elemt": _bn_elemt, "batch_norm_backward_reduce": _bn_backward_reduce,
                   "batch_norm_backward_elemt": _bn_backward_elemt}


# CUDA's autocast runs these in fp32 (torch's list of "CUDA ops that can autocast to float32"); CPU autocast's list
# lacks some (sum: an H200 gave fp32 for the sum of a bf16 matmul, CPU autocast bf16, 2026-11-29). Applied only
# inside an autocast asked for "cuda".
CUDA_FP32_OPS = {"__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits",
                 "cosh", "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum",
                 "dist", "erfinv", "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss",
                 "layer_norm", "log", "log_softmax", "log10", "log1p", "log2", "margin_ranking_loss", "mse_loss",
                 "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist",
                 "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss",
                 "soft_margin_loss", "softmax", "softmin", "softplus", "sum", "renorm", "tan", "triplet_margin_loss"}
_cuda_autocast = [0]  # how many autocast("cuda") contexts are open


def _to_fp32(t):
    import torch
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _tensors(obj, tensor_type) -> list:
    """The tensors in an operation's arguments (lists, tuples and dicts, nested): what the mode checks, found without
    pytree's general flattening, which took a third of the mode's time (2026-11-30)."""
    found, todo = [], [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, tensor_type):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
    return found


def _mode_class(torch):
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_map_only

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.backward or func is torch.autograd.backward:
                return _backward(self, func, args, kwargs)
            name = getattr(func, "__name__", "")
            if name in ("to", "cuda", "xpu", "cpu") and args and isinstance(args[0], torch.Tensor):
                moved = _transfer(torch, name, args, kwargs)
                if type(args[0]) is SimCuda and on(moved) is None and not kwargs.get("non_blocking"):
                    _count_sync("copy to the host")
                return moved
            if name in SYNC_READS and args and type(args[0]) is SimCuda:
                _count_sync(name)
            if name == "__getitem__" and len(args) == 2 and type(args[0]) is SimCuda and any(
                    type(t) is SimCuda and t.dtype == torch.bool for t in _tensors(args[1], torch.Tensor)):
                _count_sync("boolean mask")
            if name == "pin_memory" and args:
                if type(args[0]) is SimCuda:  # what a loader's pin_memory does to a batch already on the GPU
                    kind = torch.Tensor.type(args[0].as_subclass(torch.Tensor)).replace("torch.", f"torch.{DEV}.", 1)
                    raise RuntimeError(f"cannot pin '{kind}' only dense CPU tensors can be pinned (simulated GPUs)")
                return args[0]  # pinned host memory needs the driver; the simulation has nothing to pin for
            if name == "record_stream":
                return None
            if name in ("__deepcopy__", "__reduce_ex__") and type(args[0]) is SimCuda:
                return _as_cpu_tensor(args[0], name, args[1:], kwargs)  # a copy moved back; a save as on the CPU
            if name in ("numpy", "__array__") and type(args[0]) is SimCuda:  # np.asarray, matplotlib, pandas
                raise TypeError(f"can't convert {DEV}:{on(args[0])} device type tensor to numpy. Use Tensor.cpu() to "
                                "copy the tensor to host memory first. (simulated GPUs)")
            if name == "__format__" and type(args[0]) is SimCuda and args[0].dim() == 0:
                return args[0].item().__format__(*args[1:])  # what Tensor.__format__ does for its own type
            if name == "get_device" and args:
                return on(args[0]) if on(args[0]) is not None else -1
            if name == "__set__" and len(args) == 2 and isinstance(args[1], torch.Tensor):
                with torch._C.DisableTorchFunction():
                    func(*args, **kwargs)
                if on(args[1]) is not None:  # param.data = cuda tensor (what Module.to does): the param moved
                    _tag(args[0], on(args[1]))
                elif type(args[0]) is SimCuda:
                    args[0].__class__ = torch.nn.Parameter if getattr(args[0], "_is_param", False) else torch.Tensor
                return None
            flat = _tensors((args, kwargs), torch.Tensor)
            cuda = {on(t) for t in flat if type(t) is SimCuda}
            cpu = any(type(t) is not SimCuda and getattr(t, "_sim_cpu", False) and t.dim() > 0 for t in flat)
            if name in ("__getitem__", "__setitem__") and cuda and args and type(args[0]) is not SimCuda:
                raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor "
                                   "(cpu) (simulated GPUs)")
            if name in ("__getitem__", "__setitem__") and type(args[0]) is SimCuda and len(cuda) == 1:
                cpu = False  # CUDA indexes a GPU tensor with CPU indices (it copies them over)
            if name not in METADATA and (len(cuda) > 1 or (cuda and cpu)):
                seen = [f"{DEV}:{i}" for i in sorted(cuda)] + (["cpu"] if cpu else [])
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"{' and '.join(seen)}! (simulated GPUs, in {name})")
            index = min(cuda) if cuda else None
            if kwargs.get("device") is not None and _where(kwargs["device"]) is not False:
                index = _where(kwargs["device"])
                kwargs = dict(kwargs, device="cpu")
            if name.endswith("_") and not name.endswith("__") and args and isinstance(args[0], torch.Tensor):
                index = on(args[0])
            with torch._C.DisableTorchFunction():
                if name in CUDA_FP32_OPS and _cuda_autocast[0] and torch.is_autocast_enabled("cpu"):
                    args, kwargs = tree_map_only(torch.Tensor, _to_fp32, (args, kwargs))
                out = func(*args, **kwargs)
            if index is not None and torch.is_grad_enabled():
                _track_saved(out, flat, index)
            if index is None and any(_made_below(t) for t in flat):
                return out  # from tensors whose device the simulation never saw (DTensor's, autograd's): unknown too
            if isinstance(out, torch.Tensor):
                return _on_cpu(out) if index is None else _tag(out, index)
            if not isinstance(out, (list, tuple, dict)) or isinstance(out, torch.Size):
                return out  # pytree would turn a torch.Size into a tuple
            return tree_map_only(torch.Tensor, _on_cpu if index is None else (lambda t: _tag(t, index)), out)

    return Mode


def _backward(mode, func, args, kwargs) -> None:
    """loss.backward() (torch.autograd.backward), run with the simulation on. Autograd's engine runs the Python of
    custom Functions and hooks inside it (DTensor's redistribution, FSDP2's reduce-scatter, DDP's comm hooks), on this
    thread; called from the mode as any op is, with torch functions off, that Python reached the real CUDA ("Found no
    NVIDIA driver", a DTensor gradient moved to 'cuda'). So the engine is started here, the mode pushed again, as
    torch.autograd.backward starts it (its private steps: this is a test tool, checked against the floor torch too)."""
    import torch
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    names = ("tensors", "grad_tensors", "retain_graph", "create_graph") + \
        (("inputs",) if func is torch.Tensor.backward else ("grad_variables", "inputs"))
    bound = dict(zip(names, args), **{"grad_tensors" if k == "gradient" else k: v for k, v in kwargs.items()})
    tensors, inputs = bound["tensors"], bound.get("inputs")
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    create = bool(bound.get("create_graph") or False)
    retain = create if bound.get("retain_graph") is None else bound["retain_graph"]
    with torch._C.DisableTorchFunction():
        grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(bound.get("grad_tensors"), len(tensors)),
                            is_grads_batched=False)
    with mode:
        _engine_run_backward(tensors, grads, retain, create, inputs, allow_unreachable=True, accumulate_grad=True)


def _as_cpu_tensor(t, method, args, kwargs):
    """t.__deepcopy__ / t.__reduce_ex__ done on t as the CPU tensor it is; a deep copy is moved back to its GPU.
    torch.save so writes a CUDA tensor's bytes as a CPU one's, its device as a GPU file's (_patch_load)."""
    import torch

    index, state = on(t), {k: t.__dict__.pop(k) for k in ("_sim_index",) if k in t.__dict__}
    if method == "__reduce_ex__":
        with torch._C.DisableTorchFunction():
            _saving[t.untyped_storage().data_ptr()] = index  # torch.save's location tag (_patch_load)
    param = getattr(t, "_is_param", False)
    if param:
        del t.__dict__["_is_param"]
    t.__class__ = torch.nn.Parameter if param else torch.Tensor
    try:
        out = getattr(t, method)(*args, **kwargs)
    finally:
        t.__class__ = SimCuda
        t.__dict__.update(state)
        if param:
            t._is_param = True
    return _tag(out, index) if method == "__deepcopy__" else out


def _patch_autocast(torch) -> None:
    """autocast("cuda", dtype) is CPU autocast with that dtype, so the fp16 and bf16 branches compute in the dtypes a
    GPU gives (the same ops run in lower precision: torch's CPU and CUDA autocast lists differ in a few ops only), and
    GradScaler's inf checks and skipped steps see fp16's overflows. torch.is_autocast_enabled("cuda") and
    get_autocast_dtype("cuda") answer for it."""
    from torch.amp import autocast_mode

    init = autocast_mode.autocast.__init__

    @functools.wraps(init)
    def init_(self, device_type, *args, **kwargs):
        if XPU and device_type == "cuda":  # torch warns and disables it on a build without CUDA; so does this
            _asked_cuda('torch.autocast("cuda")', sys._getframe(1))
            device_type, kwargs = "cpu", dict(kwargs, enabled=False)
        self._sim_cuda = device_type == DEV and bool(physical())
        init(self, "cpu" if self._sim_cuda else device_type, *args, **kwargs)

    enter, exit_ = autocast_mode.autocast.__enter__, autocast_mode.autocast.__exit__

    @functools.wraps(enter)
    def enter_(self):
        _cuda_autocast[0] += getattr(self, "_sim_cuda", False)
        return enter(self)

    @functools.wraps(exit_)
    def exit__(self, *exc):
        _cuda_autocast[0] -= getattr(self, "_sim_cuda", False)
        return exit_(self, *exc)

    autocast_mode.autocast.__init__ = init_
    autocast_mode.autocast.__enter__, autocast_mode.autocast.__exit__ = enter_, exit__
    enabled, dtype = torch.is_autocast_enabled, torch.get_autocast_dtype

    def is_autocast_enabled(device_type=None):
        if device_type is None or device_type == DEV:
            return enabled("cpu") if physical() else enabled(DEV)
        return enabled(device_type)

    torch.is_autocast_enabled = is_autocast_enabled
    torch.get_autocast_dtype = lambda device_type: dtype("cpu" if device_type == DEV and physical() else
                                                         device_type)


def _patch_profiler(torch) -> None:
    """The profiler without CUDA activity: the simulated GPU runs no kernels to trace (and CUPTI, asked to trace a
    GPU that is not there, takes minutes to give up)."""
    import torch.profiler

    init = torch.profiler.profile.__init__

    @functools.wraps(init)
    def init_(self, *args, activities=None, **kwargs):
        if activities is not None:
            gpu = (torch.profiler.ProfilerActivity.CUDA, getattr(torch.profiler.ProfilerActivity, "XPU", None))
            activities = [a for a in activities if a not in gpu] or None
        init(self, *args, activities=activities, **kwargs)

    torch.profiler.profile.__init__ = init_


def _patch_compile(torch) -> None:
    """torch.compile runs the function as it is: the simulation has no GPU to generate kernels for (and dynamo would
    trace the simulation itself). Compiling for a GPU is gpu-check's."""

    def compile_(model=None, **kwargs):
        return model if model is not None else (lambda fn: fn)

    torch.compile = compile_

    def patch_explain(dynamo):
        explain = dynamo.explain

        def explain_(fn, *args, **kwargs):  # dynamo's report on a function, made outside the simulation's mode
            inner = explain(fn, *args, **kwargs)

            def run(*a, **k):
                depth = len(torch.overrides._get_current_function_mode_stack())
                popped = [torch._C._pop_torch_function_stack() for _ in range(depth)]
                try:
                    return inner(*a, **k)
                finally:
                    for mode in reversed(popped):
                        torch._C._push_on_torch_function_stack(mode)
            return run

        dynamo.explain = explain_

    # Patched when something imports dynamo, not before: importing it costs 1.7 s of CPU in every process of the lane
    # (the kernel, each engine and rank), where a plain `import torch` costs 2.5 s.
    _after_import("torch._dynamo", patch_explain)


def _patch_checkpoint(torch) -> None:
    """Activation checkpointing compares what the recomputation saved with what the forward saved, device included;
    intermediates that autograd saves without handing them to Python are plain CPU tensors here, so the simulation
    compares shapes and dtypes only."""
    import torch.utils.checkpoint as checkpoint

    checkpoint._allowed_determinism_checks_to_fns[checkpoint._DEFAULT_DETERMINISM_MODE] = \
        lambda x: {"shape": x.shape, "dtype": x.dtype}


# Storages written by torch.save from simulated CUDA tensors (data_ptr -> index) while a save runs: torch.save asks
# location_tag() for each storage's device, and the file says "cuda:<index>" as a real GPU's file would.
_saving: dict = {}


def _patch_load(torch) -> None:
    """torch.save writes a simulated CUDA tensor's device in the file; torch.load puts it back there: on the saved
    device when no map_location is given (so every rank of a node that resumes without one piles onto the device
    rank 0 saved from, as on a GPU node), on the mapped one otherwise."""
    import torch.serialization as serialization
    from torch.utils._pytree import tree_map_only

    restored = threading.local()

    def tag(storage):
        index = _saving.get(storage.data_ptr()) if storage.device.type == "cpu" and storage.nbytes() else None
        return None if index is None else f"{DEV}:{index}"

    def deserialize(storage, location):
        if not location.startswith(DEV):
            return None
        index = torch.device(location).index or 0
        if index >= len(physical()):
            raise RuntimeError(f"Attempting to deserialize object on {DEV.upper()} device {index} but "
                               f"torch.{DEV}.device_count() "
                               f"is {len(physical())}. Please use torch.load with map_location to map your storages "
                               f"to an existing device. (simulated GPUs)")
        lazy_init()
        getattr(restored, "placed", {})[storage.data_ptr()] = index
        return storage

    serialization.register_package(1, tag, deserialize)  # before torch's own "cuda" (20), which needs a driver

    save = torch.save

    @functools.wraps(save)
    def save_(*args, **kwargs):
        _saving.clear()
        try:
            return save(*args, **kwargs)
        finally:
            _saving.clear()

    load = torch.load

    @functools.wraps(load)
    def load_(f, map_location=None, *args, **kwargs):
        index = _where(map_location) if isinstance(map_location, (str, torch.device)) else None
        if index is not None and index is not False:
            return tree_map_only(torch.Tensor, lambda t: _move(t, index), load(f, "cpu", *args, **kwargs))
        if map_location is not None:
            return load(f, map_location, *args, **kwargs)
        restored.placed = placed = {}
        try:
            out = load(f, None, *args, **kwargs)
        finally:
            del restored.placed

        def place(t):
            where = placed.get(t.untyped_storage().data_ptr()) if t.device.type == "cpu" else None
            return t if where is None else _tag(t, where)
        return tree_map_only(torch.Tensor, place, out) if placed else out

    torch.save, torch.load = save_, load_


def _transfer(torch, name, args, kwargs):
    """Tensor.to / .cuda / .cpu: a copy that says where it went (the tensor itself where it is there already)."""
    t, rest, kwargs = args[0], list(args[1:]), dict(kwargs)
    index = False  # False: no device named (a dtype change only)
    if name == "cpu":
        index = None
    elif name in ("cuda", "xpu"):
        device = rest[0] if rest else kwargs.get("device")
        index = _where(torch.device(name, device) if isinstance(device, int) else device if device is not None
                       else name)
        rest = []
        kwargs.pop("device", None)
    else:
        for i, a in enumerate(rest):
            if isinstance(a, torch.Tensor):
                index, rest[i] = on(a), a.dtype
                break
            if not isinstance(a, torch.dtype) and _where(a) is not False:
                index, rest[i] = _where(a), "cpu"
                break
        if kwargs.get("device") is not None:
            index, kwargs["device"] = _where(kwargs["device"]), "cpu"
    with torch._C.DisableTorchFunction():
        out = torch.Tensor.to(t, *rest, **kwargs)
    if index is False:
        index = on(t)
    if on(out) == index and out is t:
        return t
    if out is t:  # a real move: a new tensor (a copy, as a transfer between devices makes)
        with torch._C.DisableTorchFunction():
            out = t.clone()
    if index is None:
        if type(out) is SimCuda:
            out.__class__ = torch.Tensor
        return _on_cpu(out)
    if type(out) is SimCuda:
        out._sim_index = index
        _track(out, index)
        return out
    return _tag(out, index)


_mode = None
# Whether this process follows tensors through the mode. A process that sees no GPU when torch is imported (a rank the
# allocation moved to the CPU: CUDA_VISIBLE_DEVICES= ) can make no GPU tensor, so it runs torch as it is: the mode
# costs every operation a Python call (a 4-rank torchrun of train_2d took 50 s of CPU under it, 33 without it, 35
# without the simulation, 2026-11-30). torch.cuda's answers and the process-group checks are patches, not the mode:
# they hold either way. Should its GPUs appear later (the variable set before the first CUDA call), the mode starts
# at the first question about them (is_available, device_count, set_device, ...: visible()) or CUDA's initialisation,
# in that thread and every thread started after; CPU tensors made before are not marked as the CPU's (_on_cpu), so
# mixing one with a GPU tensor goes unrefused there, and a thread already running never follows.
_following = [False]


def enter_mode() -> None:
    """The mode is per thread (torch keeps its stack per thread): every thread this process starts enters it."""
    import torch

    if _following[0] and not any(type(m).__name__ == "Mode" and type(m).__module__ == __name__
               for m in torch.overrides._get_current_function_mode_stack()):
        _mode.__enter__()


def _patch_threads() -> None:
    run = threading.Thread.run

    @functools.wraps(run)
    def run_in_mode(self):
        enter_mode()
        return run(self)

    threading.Thread.run = run_in_mode


# -- NCCL, simulated over gloo, and the record -------------------------------------------------------------------

# id(process group) -> the group, for the groups made as NCCL (xccl on an Intel node). The group itself is kept:
# once a destroyed group is freed, a new (gloo) group can get its address, and an id alone would call it NCCL (10's
# checker, 2 GPUs).
NCCL_GROUPS: dict = {}


def record(entry: dict) -> None:
    path = os.environ.get("TUTORIAL_SIMGPU_RECORD")
    if not path:
        return
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    entry = dict(entry, pid=os.getpid(), host=socket.gethostname(), time=time.time(), node_gpus=int(os.environ[
        "TUTORIAL_SIMGPU"]), visible=_visible_variables(), uuids=[uuid(i) for i in range(
        len(physical()))], current=current_device(), env=env, argv=sys.argv[:3])
    with open(path, "a") as f:  # one write of one line: lines from many processes do not interleave
        f.write(json.dumps(entry, default=str) + "\n")


def _visible_variables():
    """CUDA_VISIBLE_DEVICES as it is set (or None); on ROCm and XPU each variable that picks the GPUs, as NAME=value."""
    if not (ROCM or XPU):
        return os.environ.get("CUDA_VISIBLE_DEVICES")
    names = ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR") if XPU else \
        ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    return " ".join(f"{n}={os.environ[n]}" for n in names if n in os.environ) or None


def _caller() -> str:
    """The module that asked for the process group: the package's code (a trainer, a helper) decides the backend by
    the allocation; a cell's own init_process_group("gloo") is the lesson's choice (a gloo-only feature, say)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith(("torch", "lightning", "deepspeed", "functools", "contextlib")) or name == __name__):
            return name or "?"
        frame = frame.f_back
    return "?"


def _wants_library(backend, device_id) -> bool:
    """Whether a group is asked of the GPUs' library (NCCL; oneCCL's xccl on Intel), which gloo stands in for."""
    text = str(backend or "").lower()
    if XPU and "nccl" in text:
        raise RuntimeError("Distributed package doesn't have NCCL built in (simulated Intel GPUs: an XPU build of "
                           "torch has xccl)")
    if LIBRARY in text:
        return True
    if backend in (None, "", "undefined"):
        import torch

        if device_id is not None:
            return torch.device(device_id).type == DEV if not isinstance(device_id, int) else True
        return False  # torch's default with no device_id: gloo for CPU tensors, NCCL for CUDA ones: gloo stands in
    return False


def _patch_distributed(torch) -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    init = c10d.init_process_group
    new_group = c10d.new_group
    get_backend = c10d.get_backend

    made = [0]

    def described(group, backend, kind):
        """Record a new group (one line per rank, the group named alike on all its ranks); refuse it where NCCL
        would: a rank with no GPU, or two ranks on one GPU."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        mine = uuid(current_device()) if physical() else None
        made[0] += 1
        seen = [None] * world
        dist.all_gather_object(seen, (mine, socket.gethostname(), os.getpid(), made[0]), group=group)
        refusal = None
        if backend == LIBRARY and mine is None:
            refusal = "NCCL: no CUDA GPU visible to this rank (simulated GPUs)" if not XPU else \
                "oneCCL (xccl): no XPU visible to this rank (simulated Intel GPUs)"
        elif backend == "nccl":  # oneCCL's answer to two ranks on one tile is not known here: the lane's table holds it
            for other, (theirs, host, _, _) in enumerate(seen):
                if other != rank and theirs == mine and host == socket.gethostname():
                    refusal = (f"NCCL error: invalid usage: Duplicate GPU detected : rank {rank} and rank {other} "
                               f"both on CUDA device {mine} (simulated GPUs)")
                    break
        record(dict(kind=kind, backend=backend, rank=rank, world=world, group=f"{seen[0][2]}-{seen[0][3]}",
                    refused=refusal, caller=_caller()))
        if refusal:
            # the gloo group under the refused one goes now: left to the interpreter's exit, its teardown aborts
            # (SIGABRT, 2 runs in 10 of the shared-GPU test) while the other rank's sockets close
            dist.destroy_process_group(group)
            raise dist.DistBackendError(refusal)
        if backend == LIBRARY:
            NCCL_GROUPS[id(group)] = group

    @functools.wraps(init)
    def init_process_group(backend=None, *args, **kwargs):
        nccl = False
        try:
            nccl = _wants_library(backend, kwargs.get("device_id"))
            if nccl:
                backend, kwargs = "gloo", {k: v for k, v in kwargs.items() if k not in ("device_id", "pg_options")}
            init(backend, *args, **kwargs)
        except Exception as exc:
            record(dict(kind="init_process_group", backend=LIBRARY if nccl else str(backend), failed=str(exc)[:300]))
            raise
        described(c10d._get_default_group(), LIBRARY if nccl else str(backend or "gloo"), "init_process_group")

    @functools.wraps(new_group)
    def new_group_(ranks=None, timeout=None, backend=None, *args, **kwargs):
        nccl = _wants_library(backend, None) or (backend is None and id(c10d._get_default_group())
                                                         in NCCL_GROUPS)
        group = new_group(ranks, timeout, "gloo" if nccl else backend, *args,
                          **{k: v for k, v in kwargs.items() if not (nccl and k == "pg_options")})
        if group not in (None, c10d.GroupMember.NON_GROUP_MEMBER):
            described(group, LIBRARY if nccl else str(backend or get_backend(None)), "new_group")
        return group

    @functools.wraps(get_backend)
    def get_backend_(group=None):
        found = group if group is not None else c10d._get_default_group()
        return LIBRARY if id(found) in NCCL_GROUPS else get_backend(group)

    object_device = c10d._get_object_coll_device

    def object_device_(group=None):  # object collectives and barrier stage their bytes on the group's device
        return DEV if id(group or c10d._get_default_group()) in NCCL_GROUPS else object_device(group)

    c10d._get_object_coll_device = object_device_
    c10d._get_pg_default_device = lambda group=None: torch.device(object_device_(group))
    for module in (c10d, dist):
        module.init_process_group, module.new_group, module.get_backend = init_process_group, new_group_, \
            get_backend_
    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter",
                 "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
                 "gather", "scatter"):
        if hasattr(c10d, name):
            wrapped = _checked(torch, name, getattr(c10d, name))
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)


def _checked(torch, name, collective):
    """A collective that fails, as NCCL does, when an NCCL group is given a CPU tensor."""

    @functools.wraps(collective)
    def call(*args, **kwargs):
        import torch.distributed.distributed_c10d as c10d

        group = kwargs.get("group")
        if group is None:
            group = next((a for a in args if isinstance(a, torch.distributed.ProcessGroup)), None)
        if group is None and c10d.is_initialized():
            group = c10d._get_default_group()
        if id(group) in NCCL_GROUPS:
            flat = _tensors((args, kwargs), torch.Tensor)
            # Only a tensor that Python code made on the CPU is a CPU tensor here: one made below Python (DDP's bucket
            # handed to a comm hook, autograd's gradients) is on the GPU of its inputs on a real node (03a's hooks).
            cpu = [t for t in flat if on(t) is None and getattr(t, "_sim_cpu", False)]
            if cpu:
                raise RuntimeError(f"No backend type associated with device type cpu (simulated {LIBRARY.upper()}: "
                                   f"{name} was given a CPU tensor of shape {tuple(cpu[0].shape)} on an "
                                   f"{LIBRARY.upper()} process group)")
            op = kwargs.get("op", args[1] if len(args) > 1 and name == "all_reduce" else None)
            if name == "all_reduce" and op == torch.distributed.ReduceOp.AVG:  # NCCL averages; gloo cannot
                tensor = kwargs.get("tensor", args[0] if args else None)
                work = collective(tensor, torch.distributed.ReduceOp.SUM, group=group)
                with torch._C.DisableTorchFunction():
                    world = torch.distributed.get_world_size(group)
                    tensor.copy_(tensor / world if tensor.is_floating_point() else tensor // world)
                return work
        return collective(*args, **kwargs)

    return call


# -- installation ------------------------------------------------------------------------------------------------


def install() -> None:
    global SimCuda, _Tensor, _Parameter, _mode
    import torch

    if SimCuda is not None:
        return
    SimCuda, _Tensor, _Parameter = _tensor_classes(torch), torch.Tensor, torch.nn.Parameter
    if ROCM:  # what a ROCm build says of itself: core.accelerator tells AMD from NVIDIA by torch.version.hip alone
        torch.version.hip, torch.version.cuda = "6.2.41133-simulated", None
    if XPU:  # an XPU build: no CUDA, the SYCL compiler's date, xccl
        import torch.distributed as dist

        torch.version.cuda, torch.version.xpu = None, "20250101-simulated"
        import torch.distributed.distributed_c10d as c10d

        for module in (dist, c10d):
            module.is_xccl_available, module.is_nccl_available = (lambda: True), (lambda: False)
        _patch_cuda_on_intel(torch)
    _mode = _mode_class(torch)()
    _patch_cuda(torch)
    _patch_distributed(torch)
    _patch_load(torch)
    _patch_autocast(torch)
    _patch_profiler(torch)
    _patch_compile(torch)
    _patch_checkpoint(torch)
    for name, kernel in SYNC_BN_KERNELS.items():
        setattr(torch, name, kernel)
    _patch_threads()
    _following[0] = bool(physical())
    enter_mode()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls then(module) right after module `name` is first imported, whoever imports it."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then(module):
            exec_module(module)
            self.then(module)

        spec.loader.exec_module = exec_then
        return spec


def _after_import(name: str, then) -> None:
    if name in sys.modules:
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


def install_when_torch_is_imported() -> None:
    _after_import("torch", lambda torch: install())

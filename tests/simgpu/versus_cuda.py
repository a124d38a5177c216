"""The simulation's answers beside CUDA's: one probe per thing CUDA refuses, measures or changes, run the same way on a
real GPU and on simulated ones, so that each of the simulation's claims can be held to what a GPU answered.

    python tests/simgpu/versus_cuda.py --out answers.json          # on a GPU node (plain python3 and torch)
    TUTORIAL_SIMGPU=1 PYTHONPATH=tests/simgpu python tests/simgpu/versus_cuda.py --out sim.json

Each probe's answer is either {"ok": <what it gave>} or {"error": <exception class>, "message": <its first line>}.
results/simgpu_vs_cuda.json holds a GPU's answers (hardware and date inside); tests/test_simulated_gpus.py compares
the simulation's answers with them, probe by probe.
"""
from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import socket
import subprocess
import sys
import warnings

# A fresh process's answers to torch.cuda.is_initialized() after each call, in order: torch initialises CUDA lazily,
# at the first call that needs a context, and a fork guard depends on knowing which calls those are.
LAZY_INIT = """
import json, torch
seen = {"import torch": torch.cuda.is_initialized()}
for name, call in [("is_available()", torch.cuda.is_available), ("device_count()", torch.cuda.device_count),
                   ("get_device_capability(0)", lambda: torch.cuda.get_device_capability(0)),
                   ("get_device_properties(0)", lambda: torch.cuda.get_device_properties(0)),
                   ("current_device()", torch.cuda.current_device),
                   ("torch.ones(1, device='cuda')", lambda: torch.ones(1, device="cuda"))]:
    call()
    seen[name] = torch.cuda.is_initialized()
print(json.dumps(seen))
"""


def answer(fn):
    try:
        return {"ok": fn()}
    except Exception as e:  # the probe records what was refused and how
        return {"error": type(e).__name__, "message": str(e).strip().splitlines()[0][:240]}


def sync_count(fn) -> int:
    """How many host syncs fn makes: CUDA's sync debug mode on a GPU, the simulation's counter under it."""
    import torch
    sim = sys.modules.get("simgpu")
    if sim is not None:
        sim.reset_host_syncs()
        fn()
        return sum(sim.host_syncs().values())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def refusals(torch) -> dict:
    import numpy as np
    gpu = torch.arange(4.0, device="cuda")
    out = {
        "np.asarray(cuda tensor)": answer(lambda: np.asarray(gpu).tolist()),
        "cuda tensor .numpy()": answer(lambda: gpu.numpy().tolist()),
        "cuda tensor .pin_memory()": answer(lambda: str(gpu.pin_memory().device)),
        "cpu vector + cuda vector": answer(lambda: str((torch.ones(4) + gpu).device)),
        "0-dim cpu tensor * cuda vector": answer(lambda: str((torch.tensor(2.0) * gpu).device)),
        "torch.mm(cpu, cuda)": answer(lambda: str(torch.mm(torch.ones(2, 4), gpu.view(4, 1)).device)),
        "cpu tensor indexed by cuda indices": answer(lambda: str(torch.ones(4)[torch.tensor([1], device="cuda")].device)),
        "cuda tensor indexed by cpu indices": answer(lambda: str(gpu[torch.tensor([1])].device)),
        "torch.where(cuda cond, cpu, cpu)": answer(lambda: str(torch.where(gpu > 1, torch.ones(4), torch.zeros(4)).device)),
    }
    buf = io.BytesIO()
    torch.save({"w": gpu}, buf)
    out["torch.load without map_location"] = answer(
        lambda: str(torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["w"].device))
    out["torch.load map_location='cpu'"] = answer(
        lambda: str(torch.load(io.BytesIO(buf.getvalue()), map_location="cpu", weights_only=True)["w"].device))
    out["fork after CUDA init, child uses CUDA"] = forked(torch)
    return out


def forked(torch) -> dict:
    """A child forked after the parent used CUDA touches CUDA: what it is told (sent back through a pipe)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        got = answer(lambda: str(torch.ones(1, device="cuda").device))
        os.write(write, json.dumps(got).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        got = json.loads(pipe.read() or '{"error": "none", "message": "the child wrote nothing"}')
    os.waitpid(pid, 0)
    return got


def dtypes(torch) -> dict:
    """What autocast("cuda", dtype) gives per op, for fp32 inputs on the GPU."""
    import torch.nn.functional as F
    x = torch.randn(8, 16, device="cuda")
    w = torch.randn(4, 16, device="cuda")
    img = torch.randn(2, 3, 8, 8, device="cuda")
    kernel = torch.randn(4, 3, 3, 3, device="cuda")
    target = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3], device="cuda")
    ops = {
        "matmul": lambda: x @ x.T, "linear": lambda: F.linear(x, w), "conv2d": lambda: F.conv2d(img, kernel),
        "x + x": lambda: x + x, "relu": lambda: F.relu(x), "softmax": lambda: F.softmax(x, dim=1),
        "log_softmax": lambda: F.log_softmax(x, dim=1), "layer_norm": lambda: F.layer_norm(x, (16,)),
        "cross_entropy": lambda: F.cross_entropy(F.linear(x, w), target), "sum of matmul": lambda: (x @ x.T).sum(),
        "mse_loss": lambda: F.mse_loss(F.linear(x, w), torch.zeros(8, 4, device="cuda")),
    }
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cuda", dtype=dtype):
            out[str(dtype)] = {name: str(op().dtype) for name, op in ops.items()}
    return out


def memory(torch) -> dict:
    """What the caching allocator counts: sizes rounded, segments reserved, a training step's phases and peak."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    out = {}
    for n in (1, 1000, 2**18, 3 * 2**18 + 5):  # floats: 4 B, 4 kB, 1 MiB, 3 MiB + 20 B
        t = torch.empty(n, device="cuda")
        out[f"empty({n}) float32"] = {"allocated": torch.cuda.memory_allocated() - base,
                                      "reserved": torch.cuda.memory_reserved()}
        del t
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(256, 512, device="cuda"), torch.randint(0, 10, (256,), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    phases = {"model, batch": torch.cuda.memory_allocated() - base}
    for step in range(2):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        phases[f"step {step} after forward"] = torch.cuda.memory_allocated() - base
        loss.backward()
        phases[f"step {step} after backward"] = torch.cuda.memory_allocated() - base
        opt.step()
        opt.zero_grad(set_to_none=True)
        phases[f"step {step} after step"] = torch.cuda.memory_allocated() - base
        del loss
    phases["peak"] = torch.cuda.max_memory_allocated() - base
    out["MLP 512-1024-10, SGD momentum, batch 256"] = phases
    del model, opt, x, y
    return out


def syncs(torch) -> dict:
    t = torch.arange(6.0, device="cuda")
    ops = {
        "t.sum().item()": lambda: t.sum().item(), "t.tolist()": lambda: t.tolist(),
        "bool(t.sum() > 0)": lambda: bool(t.sum() > 0), "float(t.sum())": lambda: float(t.sum()),
        "repr(t)": lambda: repr(t), "t.cpu()": lambda: t.cpu(), "t.to('cpu', non_blocking=True)":
            lambda: t.to("cpu", non_blocking=True), "torch.nonzero(t)": lambda: torch.nonzero(t),
        "t[t > 2] (mask)": lambda: t[t > 2], "t.max()": lambda: t.max(), "t * 2 + 1": lambda: t * 2 + 1,
        "t.sum() / len(t)": lambda: t.sum() / len(t), "torch.isfinite(t).all()": lambda: torch.isfinite(t).all(),
    }
    return {name: answer(lambda op=op: sync_count(op)) for name, op in ops.items()}


def collectives(torch) -> dict:
    """A world of one NCCL rank: what a collective on a CPU tensor is told, and DDP's gradient copy in bytes."""
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        out = {"backend": dist.get_backend(),
               "all_reduce(cpu tensor)": answer(lambda: dist.all_reduce(torch.ones(2)) and None),
               "all_reduce(cuda tensor)": answer(lambda: dist.all_reduce(torch.ones(2, device="cuda")) or "done")}
        for view in (False, True):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).cuda()
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=view)
            wrapped = torch.cuda.memory_allocated() - before
            ddp(torch.randn(64, 512, device="cuda")).sum().backward()
            torch.cuda.synchronize()
            out[f"DDP gradient_as_bucket_view={view}"] = {
                "parameters B": sum(p.numel() * p.element_size() for p in model.parameters()),
                "after wrapping": wrapped, "after backward": torch.cuda.memory_allocated() - before}
            del ddp, model
        return out
    finally:
        dist.destroy_process_group()


# What the simulation leaves out of memory_allocated (its docstring): cuBLAS's workspaces, which torch takes from the
# caching allocator. On the H200 (2026-11-29) the first forward's matmul added 1 MiB (cuBLASLt's) and the first
# backward 32 MiB more (cuBLAS's): the GPU's counts were the simulation's plus 0, 1 or 33 MiB at every point.
WORKSPACES = (0, 2**20, 33 * 2**20)
# Known and written down (simgpu's host syncs): printing a tensor is one read here, many on a GPU.
SYNC_COUNTS_DIFFER = {"repr(t)"}


def same_refusal(gpu: dict, sim: dict) -> bool:
    """The same outcome: the same value, or the same exception class with CUDA's words first (the simulation adds
    where it is, and may say a device mismatch in the generic words CUDA uses for most ops)."""
    if "ok" in gpu or "ok" in sim:
        return gpu == sim
    words = lambda m: m.split()[:8]  # noqa: E731
    return gpu["error"] == sim["error"] and words(gpu["message"]) == words(sim["message"])


def problems(gpu: dict, sim: dict) -> list[str]:
    """Where the simulation's answers (sim) differ from a GPU's (gpu) beyond what it says it leaves out."""
    found = []
    if gpu["is_initialized after"] != sim["is_initialized after"]:
        found.append(f"is_initialized: GPU {gpu['is_initialized after']}, simulated {sim['is_initialized after']}")
    for name, answer in gpu["refusals"].items():
        if not same_refusal(answer, sim["refusals"].get(name, {})):
            found.append(f"{name}: GPU {answer}, simulated {sim['refusals'].get(name)}")
    for dtype, ops in gpu["autocast dtypes"].items():
        for op, got in ops.items():
            if sim["autocast dtypes"][dtype].get(op) != got:
                found.append(f"autocast {dtype} {op}: GPU {got}, simulated {sim['autocast dtypes'][dtype].get(op)}")
    for op, answer in gpu["host syncs"].items():
        ours = sim["host syncs"].get(op, {}).get("ok")
        if ours != answer.get("ok") and (op not in SYNC_COUNTS_DIFFER or not ours or not answer.get("ok")):
            found.append(f"host syncs of {op}: GPU {answer.get('ok')}, simulated {ours}")
    for probe, phases in gpu["memory"].items():
        for phase, value in phases.items():
            if phase == "reserved":
                continue  # a model here (2 MiB segments); CUDA's pools and the workspaces' segments are not
            ours = sim["memory"][probe][phase]
            # a peak inside backward is a lower bound here (backward's temporaries are not seen)
            fits = value - ours >= WORKSPACES[-1] if phase == "peak" else value - ours in WORKSPACES
            if not fits:
                found.append(f"memory {probe} {phase}: GPU {value}, simulated {ours}")
    for name, answer in gpu["nccl"].items():
        ours = sim["nccl"].get(name)
        outcome = isinstance(answer, dict) and ("error" in answer or "ok" in answer)  # else a value or bytes
        if not (same_refusal(answer, ours or {}) if outcome else answer == ours):
            found.append(f"nccl {name}: GPU {answer}, simulated {ours}")
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="where the JSON answers go")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("versus_cuda: no CUDA device here (and no simulation: TUTORIAL_SIMGPU unset)", file=sys.stderr)
        return 2
    lazy = subprocess.run([sys.executable, "-c", LAZY_INIT], capture_output=True, text=True, timeout=120)
    result = {
        "simulated": "simgpu" in sys.modules,
        "hardware": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
        "host": platform.node(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "is_initialized after": json.loads(lazy.stdout) if lazy.returncode == 0 else {"error": lazy.stderr[-400:]},
    }
    for name, probe in [("refusals", refusals), ("autocast dtypes", dtypes), ("memory", memory),
                        ("host syncs", syncs), ("nccl", collectives)]:
        result[name] = answer(lambda probe=probe: probe(torch))
        result[name] = result[name].get("ok", result[name])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The simulated GPUs (tests/simgpu) and the allocations the notebooks' lane does not run: the simulation fails where
CUDA and NCCL would (else the lane could not fail), the rows of README's allocation table executed under it (a full
node, a shared node's subset, a GPU bound per task), and the exercise checkers on their GPU branch.

The lane itself (the numbered notebooks under one simulated GPU but 04, 06, 09 and 12, whose reasons the
Makefile gives; 00, 01, 03a, 03b, 07, 08 and 10 on a full node of 8) is `make test`'s
SIMGPU_LANE; tests/simgpu/simgpu.py says what is simulated and what is not."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT, agent_store, env

SIMGPU = ROOT / "tests" / "simgpu"
sys.path.insert(0, str(SIMGPU))
import lane  # noqa: E402  (the lane's checker, a plain module in tests/simgpu)


def simulated(gpus: int, record=None, **extra) -> dict:
    e = env(PYTHONPATH=str(SIMGPU), TUTORIAL_SIMGPU=str(gpus), **extra)
    e.pop("CUDA_VISIBLE_DEVICES", None)
    # a GPU node names no DeepSpeed accelerator (the package picks cuda there); a cpu left in this process's
    # environment by an earlier test would make DeepSpeed run as on a CPU
    e.pop("DS_ACCELERATOR", None)
    e.update(extra)
    if record is not None:
        e["TUTORIAL_SIMGPU_RECORD"] = str(record)
    return e


def python(code: str, gpus: int, record=None, timeout=120, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=simulated(gpus, record, **extra))


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_process_that_sees_no_gpu_runs_torch_as_it_is_until_its_gpus_appear():
    """A rank moved to the CPU (CUDA_VISIBLE_DEVICES=) runs without the simulation's mode, which would cost every
    operation a Python call; GPUs made visible in the process before its first CUDA call are followed from the first
    question about them, refusals included. Control: the CPU tensor mixed in is refused once the mode follows."""
    out = python("""
        import os, torch
        import simgpu
        plain = torch.ones(2) + 1
        print("before", torch.cuda.is_available(), simgpu._following[0], type(plain).__name__)
        os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # as an engine's code may set it before its first CUDA call
        print("after", torch.cuda.is_available(), simgpu._following[0])
        x = torch.zeros(2, device="cuda")
        try:
            x + torch.ones(2)
        except RuntimeError as exc:
            print("refused", "same device" in str(exc))
        print(x.device, (x + 1).device)
    """, gpus=1, CUDA_VISIBLE_DEVICES="")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:4] == ["before False False Tensor", "after True True", "refused True",
                                           "cuda:0 cuda:0"], out.stdout


def test_the_simulation_fails_where_cuda_would():
    out = python("""
        import torch, torch.nn as nn
        print(torch.cuda.is_available(), torch.cuda.device_count(), torch.cuda.get_device_properties(1).uuid)
        net = nn.Linear(4, 2).cuda()
        print(next(net.parameters()).device, isinstance(next(net.parameters()), nn.Parameter))
        for name, call in [("mixed", lambda: net(torch.randn(3, 4))), ("numpy", lambda: net.weight.numpy()),
                           ("two GPUs", lambda: net(torch.randn(3, 4, device="cuda:1")))]:
            try:
                call()
                print(name, "passed")
            except (RuntimeError, TypeError) as exc:
                print(name, "failed:", str(exc).splitlines()[0])
        x = torch.randn(3, 4, device="cuda:1")
        print(net.to(x)(x).device, torch.load.__wrapped__ is not None)
    """, gpus=2)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "True 2 GPU-5133d001-0000-4000-8000-000000000001"
    assert lines[1] == "cuda:0 True"
    assert lines[2].startswith("mixed failed: Expected all tensors to be on the same device") and "cpu" in lines[2]
    assert lines[3].startswith("numpy failed: can't convert cuda:0 device type tensor to numpy")
    assert lines[4].startswith("two GPUs failed: Expected all tensors") and "cuda:0 and cuda:1" in lines[4]
    assert lines[5] == "cuda:1 True"


REFUSALS = """
    import os, tempfile, numpy as np, torch
    print("initialised before any CUDA call:", torch.cuda.is_initialized())
    t = torch.ones(3, device="cuda:1")
    print("initialised after one:", torch.cuda.is_initialized())
    for name, call in [("asarray", lambda: np.asarray(t)), ("pin_memory", lambda: t.pin_memory()),
                       ("cpu pin_memory", lambda: torch.ones(2).pin_memory())]:
        try:
            call()
            print(name, "passed")
        except (RuntimeError, TypeError) as exc:
            print(name, "failed:", str(exc).splitlines()[0])
    path = os.path.join(tempfile.mkdtemp(), "saved.pt")
    torch.save({"weight": t, "step": torch.zeros(1)}, path)
    print("loaded on", torch.load(path)["weight"].device, torch.load(path)["step"].device,
          torch.load(path, map_location="cpu")["weight"].device,
          torch.load(path, map_location="cuda:0")["weight"].device)
    pid = os.fork()
    if pid == 0:
        try:
            torch.ones(1, device="cuda")
            print("forked child passed")
        except RuntimeError as exc:
            print("forked child failed:", str(exc)[:46])
        os._exit(0)
    os.waitpid(pid, 0)
"""


def test_the_simulation_refuses_what_cuda_refuses_beyond_devices(tmp_path):
    """What CUDA refuses that the simulation once accepted (review 6 §4): a CUDA tensor to numpy through
    np.asarray (what matplotlib and pandas do with a metric left on the GPU), pin_memory of a CUDA tensor (a loader
    pinning batches already on the GPU), CUDA in a child forked after CUDA was initialised; is_initialized() is False
    until the first call that needs a context; torch.load without map_location puts a tensor back on the GPU it was
    saved from (so ranks resuming without one pile onto rank 0's GPU), with map_location where it says."""
    out = python(REFUSALS, gpus=2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "initialised before any CUDA call: False", "initialised after one: True",
        "asarray failed: can't convert cuda:1 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host "
        "memory first. (simulated GPUs)",
        "pin_memory failed: cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned (simulated GPUs)",
        "cpu pin_memory passed", "loaded on cuda:1 cpu cpu cuda:0",
        "forked child failed: Cannot re-initialize CUDA in forked subprocess"], out.stdout
    saved = tmp_path / "saved_on_1.pt"
    fewer = python(f"""
        import torch
        torch.save(torch.ones(1, device="cuda:1"), {str(saved)!r})
    """, gpus=2)
    assert fewer.returncode == 0, fewer.stderr[-2000:]
    one = python(f"""
        import torch
        try:
            torch.load({str(saved)!r})
        except RuntimeError as exc:
            print(str(exc).split(". ")[0])
        print(torch.load({str(saved)!r}, map_location="cuda").device)
    """, gpus=1)
    assert one.stdout.splitlines() == ["Attempting to deserialize object on CUDA device 1 but "
                                       "torch.cuda.device_count() is 1", "cuda:0"], one.stdout + one.stderr[-2000:]


PRECISIONS = r"""
    import json, math, sys, tempfile
    sys.path.insert(0, sys.argv[1])
    from observe import run_observed
    from tutorial import train_single
    from tutorial.core import precision as amp
    from tutorial.core.config import TrainConfig
    seen = {}
    for name, precision in (("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp16"), ("planted", "fp16")):
        if name == "planted":  # the planted bug: an fp16 step that never unscales (optimizer.step on scaled gradients)
            amp.Precision.step = lambda self, optimizer, parameters, clip_grad=0.0: optimizer.step()
        cfg = TrainConfig.preset("smoke").replace(epochs=1, max_steps=6, quiet=True, precision=precision,
                                                  out=tempfile.mkdtemp())
        metrics = run_observed(train_single.main, cfg)
        loss = metrics["epochs"][-1]["train_loss"]
        seen[name] = [metrics["observed"]["dtypes"], loss if math.isfinite(loss) else str(loss)]
    print(json.dumps(seen))
"""


def test_autocast_on_a_simulated_gpu_computes_in_the_dtype_a_gpu_gives():
    """--precision bf16 and fp16 on a simulated GPU compute in bfloat16 and float16 (autocast("cuda") as CPU
    autocast with that dtype), so their branches, GradScaler's included, run as on a GPU: fp16 with its loss scale
    trains as fp32 does over 6 steps; fp32 is the dtype control. Control of the scaler: an fp16 step that never
    unscales (the gradients 65536 times too large) leaves a loss far from fp32's, or none."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(PRECISIONS), str(ROOT / "tests")], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env=simulated(1))
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert {name: dtypes for name, (dtypes, _) in seen.items()} == \
        {"fp32": ["float32"], "bf16": ["bfloat16"], "fp16": ["float16"], "planted": ["float16"]}, seen
    fp32, fp16, planted = seen["fp32"][1], seen["fp16"][1], seen["planted"][1]
    assert abs(fp16 - fp32) < 0.05 * fp32, seen
    assert isinstance(planted, str) or abs(planted - fp32) > fp32, seen


HOST_SYNCS = r"""
    import importlib.util, json, pathlib, sys
    import host_syncs
    from tutorial import train_single
    rows = {stage: host_syncs.measure(importlib.import_module(f"tutorial.train_{stage}").main, host_syncs.config(stage))
            for stage in host_syncs.STAGES}
    # the planted bug: the loss read on the host at every step, as a progress print would
    source = pathlib.Path(train_single.__file__).read_text()
    assert source.count("        totals[SAMPLES] += len(y)\n") == 1
    doctored = pathlib.Path(sys.argv[1]) / "train_single_item.py"
    doctored.write_text(source.replace("        totals[SAMPLES] += len(y)\n",
                                       "        totals[SAMPLES] += len(y)\n        print(f'loss {loss.item():.3f}')\n"))
    spec = importlib.util.spec_from_file_location("tutorial.train_single_item", doctored)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    rows["planted"] = host_syncs.measure(module.main, host_syncs.config("single"))
    print(json.dumps({stage: [row["per_step"], sorted(row["added"])] for stage, row in rows.items()}))
"""


def test_no_trainer_reads_the_gpu_at_every_step(tmp_path):
    """Host syncs per training step (tests/simgpu/host_syncs.py; `make host-syncs` records them in results/): every
    trainer that runs in one process reads the GPU's values only at log steps and epoch ends, 0 per step. Control: a
    train_single that prints loss.item() at every step makes 1 per step, named by its caller."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(HOST_SYNCS), str(tmp_path)], capture_output=True,
                         text=True, timeout=600, cwd=ROOT, env=simulated(1))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.splitlines()[-1])
    assert {stage: row for stage, row in rows.items() if stage != "planted"} == \
        {stage: [0.0, []] for stage in ("single", "dp", "ddp", "fsdp", "gpt")}, rows
    per_step, callers = rows["planted"]
    assert per_step == 1.0 and callers[0].startswith("tutorial.train_single_item:train_one_epoch:") \
        and callers[0].endswith(" item"), rows["planted"]


MEMORY = """
    import torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
    cuda, acc = torch.cuda, torch.accelerator
    print("before CUDA", cuda.memory_allocated(), acc.memory_allocated())
    net = nn.Linear(1000, 1000).cuda()
    x = torch.randn(8, 1000, device="cuda")
    print("parameters and input", cuda.memory_allocated(), cuda.memory_allocated(1))
    net(x).square().mean().backward()
    print("gradients", cuda.memory_allocated())
    opt = torch.optim.Adam(net.parameters())  # foreach: its states made by _foreach kernels
    opt.step()
    print("optimizer state", cuda.memory_allocated(), acc.memory_allocated(0),
          cuda.max_memory_allocated() == acc.max_memory_allocated() > cuda.memory_allocated())
    z = torch.randn(64, 1000, device="cuda:1", requires_grad=True)
    loss = F.cross_entropy(z, torch.zeros(64, dtype=torch.long, device="cuda:1"))
    print("cross entropy", cuda.memory_allocated(1))
    loss.backward()
    print("its backward", cuda.memory_allocated(1))
    del net, x, opt, loss, z
    print("freed", cuda.memory_allocated(), cuda.memory_allocated(1), cuda.max_memory_allocated() > 0)
    cuda.reset_peak_memory_stats(), acc.reset_peak_memory_stats(1)
    free, total = cuda.mem_get_info()
    print("peak reset", cuda.max_memory_allocated(), acc.max_memory_allocated(1), cuda.memory_reserved() % 2**21,
          total - free == cuda.memory_reserved() > 0, total == cuda.get_device_properties(0).total_memory)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    net = nn.Linear(1000, 1000).cuda()
    before = cuda.memory_allocated()
    ddp = nn.parallel.DistributedDataParallel(net)
    print("DDP's buckets", cuda.memory_allocated() - before)
    ddp(torch.randn(8, 1000, device="cuda")).sum().backward()
    print("and gradients", cuda.memory_allocated() - before)
    del ddp
    print("DDP gone", cuda.memory_allocated() - before)
    dist.destroy_process_group()
"""


def test_simulated_gpu_memory_is_what_the_caching_allocator_counts():
    """memory_allocated counts every live storage on its simulated GPU in the allocator's 512-byte blocks, those made
    below Python included (autograd's gradients, the log-softmax cross_entropy saves, DDP's buckets), until the
    storage is freed; a peak, reset_peak_memory_stats and torch.accelerator's calls answer from the same counters.
    The figures are arithmetic: Linear(1000, 1000)'s weight is 4,000,000 B (7,813 blocks: 4,000,256) and its bias
    4,000 B (4,096), 4,004,352 in all; the input 32,000 B (32,256). Before this, every figure was 0."""
    out = python(MEMORY, gpus=2)
    assert out.returncode == 0, out.stderr[-3000:]
    params, x, z = 4_004_352, 32_256, 256_000  # z: 64 x 1000 fp32, 500 blocks
    assert out.stdout.splitlines() == [
        "before CUDA 0 0",
        f"parameters and input {params + x} 0",
        f"gradients {2 * params + x}",
        f"optimizer state {4 * params + x} {4 * params + x} True",  # Adam's step counters stay on the CPU
        f"cross entropy {z + 512 + z + 512 + 512}",  # z, target, the saved log-softmax, loss, nll's total weight
        f"its backward {z + 512 + z}",  # z, loss, z.grad: the saved values and the target freed
        "freed 0 0 True",
        "peak reset 0 0 0 True True",
        f"DDP's buckets {params}", f"and gradients {2 * params}", f"DDP gone {params}"], out.stdout


LEAK = """
    import sys, contextlib, torch, torch.nn as nn
    net = nn.Linear(1024, 10).cuda()
    predictions = []
    try:
        with contextlib.nullcontext() if sys.argv[1] == "leak" else torch.no_grad():
            for batch in range(50):
                predictions.append(net(torch.randn(512, 1024, device="cuda")))  # 2 MiB a batch
        print("evaluated", batch + 1)
    except torch.cuda.OutOfMemoryError as exc:
        print("batch", batch, str(exc))
"""


def test_an_allocation_past_the_gpus_memory_fails_as_cuda_does():
    """Negative control: an evaluation loop that keeps its predictions without torch.no_grad() keeps every batch's
    graph, and with it every input (saved for the weight's gradient): on a 64 MiB simulated GPU it runs out of
    memory at the 32nd batch with CUDA's error and message, where the same loop under no_grad evaluates all 50."""
    runs = {kind: subprocess.run([sys.executable, "-c", textwrap.dedent(LEAK), kind], capture_output=True, text=True,
                                 timeout=120, cwd=ROOT, env=simulated(1, TUTORIAL_SIMGPU_MEMORY=str(64 * 2**20)))
            for kind in ("leak", "fixed")}
    assert all(r.returncode == 0 for r in runs.values()), [r.stderr[-2000:] for r in runs.values()]
    assert runs["fixed"].stdout.strip() == "evaluated 50"
    assert runs["leak"].stdout.startswith(
        "batch 31 CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 64.00 MiB of which "
        "0 bytes is free."), runs["leak"].stdout


LESSONS_MEMORY = """
    import json, os, torch, torch.distributed as dist
    from tutorial.core.config import TrainConfig
    from tutorial.lessons import data_parallel, mixed_precision, performance, sharded
    out, cuda = {}, torch.device("cuda")
    # 09's activation cell: the same checks, on the GPU branch
    X = torch.randn(128, 512, device=cuda)
    plain = sharded.activation_memory(sharded.mlp_blocks().to(cuda), X)
    ckpt = sharded.activation_memory(sharded.checkpoint_solution(sharded.mlp_blocks().to(cuda)), X)
    same = all(torch.allclose(ckpt["grads"][n], g, rtol=1e-5, atol=1e-6) for n, g in plain["grads"].items())
    out["activations"] = [plain["peak_bytes"], ckpt["saved_bytes"] < plain["saved_bytes"] / 4, same]
    del X, plain, ckpt  # their gradients' copies would be in every peak below, as on a GPU
    cfg = TrainConfig.preset("smoke")
    out["precision"] = [r["peak MiB"] for r in mixed_precision.precision_benchmark(cfg, ("fp32", "bf16"), steps=2)]
    out["dp"] = [r["peak MiB per GPU"] for r in data_parallel.dp_throughput(cfg, steps=2)]
    # 09's table: memory per rank, built as the DDP trainer builds it
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # a lone rank holds a port
    big = cfg.replace(dataset="cifar10", synthetic=True, model="resnet18", batch_size=4, precision="fp32")
    out["ddp"] = sharded.memory_per_rank(big, "ddp")
    # 12's table: the planner against what the GPU's allocator measured
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    runs = [[performance.measure_memory(s) for s in ("ddp", "ddp+checkpointing")]]
    out["activations measured"] = [r["activations"] for r in runs[0]]
    out["planner"] = [r["within"] for r in performance.memory_table(runs, states=performance.solution_states_per_rank)]
    out["skeleton"] = [r["within"] for r in performance.memory_table(runs, states=performance.states_per_rank)]
    alone = performance.measure_memory("single", device=cuda)  # 12's one-rank cell on an attendee's own GPU
    out["single"] = performance.memory_table([[alone]], states=performance.solution_states_per_rank)[0]["within"]
    out["buckets"] = [r["gradients"] for r in runs[0]] + [alone["gradients"]]
    print(json.dumps(out))
"""


def test_the_lessons_gpu_memory_measurements_on_a_simulated_gpu():
    """The lessons' GPU memory branches (09's activation and per-rank cells, 12's planner table, 04's and 02's peak
    columns) measure nonzero, plausible figures on simulated GPUs, and the notebooks' asserts hold on them: 12's
    planner is within 10% of the allocator on every row (activations included, which it measures by
    memory_allocated on a GPU) and its skeleton, without optimizer state, on none; DDP's GPU peak holds at least its
    parameters, gradients, optimizer state and buckets; bf16 peaks below fp32."""
    out = python(LESSONS_MEMORY, gpus=2, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    peak, fewer, same = got["activations"]
    assert peak > 4 * 8 * 512 * 2048 and fewer and same  # the 4 blocks' gradients at least (2 x 512 x 2048 each)
    fp32, bf16 = got["precision"]
    assert 0 < bf16 < fp32, got["precision"]
    assert got["dp"][0] != "0" and all(int(mib) > 0 for mib in got["dp"][1].split()), got["dp"]
    ddp = got["ddp"]
    assert ddp["gpu_peak"] >= ddp["parameters"] * 2 + ddp["gradients"] + ddp["optimizer_state"], ddp  # + buckets
    assert all(a > 0 for a in got["activations measured"]) and got["planner"] == [True, True], got
    assert got["skeleton"] == [False, False], got
    # the allocator's DDP holds its buckets beside the gradients (within the caching allocator's rounding)
    ddp, checkpointed, alone = got["buckets"]
    assert got["single"] and ddp == checkpointed and 1.98 < ddp / alone < 2.02, got


NCCL_PAIR = """
    import os, sys, torch, torch.distributed as dist
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    try:
        dist.init_process_group("nccl")
    except dist.DistBackendError as exc:
        print("refused:", exc)
        sys.exit(3)
    print("backend", dist.get_backend())
    try:
        dist.all_reduce(torch.ones(1))
        print("cpu tensor passed")
    except RuntimeError as exc:
        print("cpu tensor failed:", str(exc).splitlines()[0])
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    print("cuda tensor", t.item(), t.device)
    # DDP's buckets are made below Python: a comm hook hands them to NCCL, as on a GPU (03a's hooks)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = DDP(torch.nn.Linear(16, 4).cuda(), device_ids=[torch.cuda.current_device()])
    model.register_comm_hook(None, default_hooks.allreduce_hook)
    model(torch.randn(8, 16, device="cuda")).sum().backward()
    print("comm hook", model.module.weight.grad.device)
    # SyncBatchNorm (kernels CUDA has and the CPU lacks): each rank normalises its half of the batch with the whole
    # batch's statistics, so outputs, input gradients, running statistics and the ranks' summed weight gradients are
    # one BatchNorm2d's over the whole batch
    whole, half = torch.randn(8, 3, 4, 4, generator=torch.Generator().manual_seed(0)), slice(4 * dist.get_rank(), None)
    half = slice(4 * dist.get_rank(), 4 * dist.get_rank() + 4)
    sync, ref = torch.nn.SyncBatchNorm(3).cuda(), torch.nn.BatchNorm2d(3)
    x, x_ref = whole[half].cuda().requires_grad_(), whole.clone().requires_grad_()
    out, out_ref = sync(x), ref(x_ref)
    (out * out.detach().cos()).sum().backward()
    (out_ref * out_ref.detach().cos()).sum().backward()
    grads = torch.stack([sync.weight.grad.cpu(), sync.bias.grad.cpu()])
    dist.all_reduce(grads := grads.cuda())
    errors = [(out.cpu() - out_ref[half]).abs().max(), (x.grad.cpu() - x_ref.grad[half]).abs().max(),
              (sync.running_mean.cpu() - ref.running_mean).abs().max(), (sync.running_var.cpu() - ref.running_var).abs().max(),
              (grads.cpu() - torch.stack([ref.weight.grad, ref.bias.grad])).abs().max()]
    print("sync bn", out.device, max(e.item() for e in errors))
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("gpus", [2, 1])
def test_simulated_nccl_refuses_a_shared_gpu_and_cpu_tensors(tmp_path, gpus):
    """NCCL's two refusals that CPU tests never meet: two ranks on one GPU, and a CPU tensor on an NCCL group; and
    no false refusal of DDP's buckets, which a comm hook hands to NCCL (review 6: 03a [13]-[14] on 8 GPUs)."""
    script, record = tmp_path / "pair.py", tmp_path / "record.jsonl"
    script.write_text(textwrap.dedent(NCCL_PAIR))
    with agent_store() as rendezvous:
        procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, cwd=ROOT, env=simulated(gpus, record, RANK=str(r), LOCAL_RANK=str(r),
                                                                     WORLD_SIZE="2", **rendezvous))
                 for r in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
    seen = records(record)
    if gpus == 2:
        assert [p.returncode for p in procs] == [0, 0], outs
        for out, _ in outs:
            assert "backend nccl" in out and "cpu tensor failed: No backend type associated with device type cpu" \
                in out and "cuda tensor 2.0 cuda:" in out and "comm hook cuda:" in out
            sync_bn = next(line.split() for line in out.splitlines() if line.startswith("sync bn"))
            assert sync_bn[2].startswith("cuda:") and float(sync_bn[3]) < 1e-4, out
        assert sorted(r["uuids"][r["current"]][-1] for r in seen) == ["0", "1"]
    else:
        assert [p.returncode for p in procs] == [3, 3], outs
        assert all("Duplicate GPU detected" in out for out, _ in outs)
        assert all(r["refused"] and r["backend"] == "nccl" for r in seen) and len(seen) == 2


ROW = """
    import json, os, sys
    from tutorial.launch import engines
    from tutorial.lessons import notebook
    from tutorial import train_ddp
    from tutorial.core.config import TrainConfig
    alloc = notebook.allocation(2, TrainConfig.preset("smoke").replace(epochs=1, out=sys.argv[1], quiet=True))
    cluster = engines.start(n=2, device=alloc.device, gpus=alloc.gpus, show=False)
    try:
        metrics = cluster.run(train_ddp.main, alloc.cfg)
        print("identical", metrics["replicas_identical"])
    finally:
        cluster.stop()
"""


@pytest.mark.parametrize("row", ["full node", "shared node"])
def test_readme_rows_run_as_the_table_says(tmp_path, row):
    """README: 2 or more GPUs: one rank per GPU, NCCL; a shared node (CUDA_VISIBLE_DEVICES=2,3 of 8): those two."""
    record = tmp_path / "record.jsonl"
    gpus, extra = (2, {}) if row == "full node" else (8, {"CUDA_VISIBLE_DEVICES": "2,3"})
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(ROW), str(tmp_path / "out")], capture_output=True,
                         text=True, timeout=240, cwd=ROOT, env=simulated(gpus, record, **extra))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert re.search(r"allocation: 2 rank\(s\) on GPU\(s\) (0,1|2,3), one per GPU, NCCL", out.stdout)
    assert "identical True" in out.stdout
    groups = [r for r in records(record) if r["kind"] == "init_process_group"]
    assert len(groups) == 2 and {r["backend"] for r in groups} == {"nccl"}
    physical = sorted(r["uuids"][r["current"]] for r in groups)
    want = ["0", "1"] if row == "full node" else ["2", "3"]
    assert [u[-1] for u in physical] == want, physical  # the attendee's GPUs, one per rank


def test_a_gpu_bound_per_task_is_one_gpu_per_rank_for_nccl(tmp_path):
    """Slurm --gpus-per-task=1: each rank sees one GPU, its own, as cuda:0; the trainers compare UUIDs, so NCCL runs.
    The control: the same launch with both ranks bound to GPU 0 is refused by the trainer, before NCCL."""
    record = tmp_path / "record.jsonl"

    def launch(visible: list[str]):
        with agent_store() as rendezvous:
            procs = [subprocess.Popen([sys.executable, "-m", "tutorial.train_ddp", "--preset", "smoke", "--epochs",
                                       "1", "--out", str(tmp_path / f"out{r}"), "--backend", "nccl"],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                      env=simulated(2, record, RANK=str(r), LOCAL_RANK="0", WORLD_SIZE="2",
                                                    CUDA_VISIBLE_DEVICES=visible[r], **rendezvous))
                     for r in range(2)]
            return [p.communicate(timeout=180)[0] for p in procs], [p.returncode for p in procs]

    outs, codes = launch(["0", "1"])
    assert codes == [0, 0], outs
    seen = [r for r in records(record) if r["kind"] == "init_process_group"]
    assert {r["backend"] for r in seen} == {"nccl"} and {r["current"] for r in seen} == {0}
    assert len({r["uuids"][0] for r in seen}) == 2
    outs, codes = launch(["0", "0"])
    assert codes == [2, 2] and all("would use the same GPU" in o for o in outs), outs


# The exercise tests whose checkers run in the test's own process: those that start no engines (the others start
# CPU engines of their own, which a simulated GPU would only refuse to share; the notebooks' checkers on engines run
# in the lane).
IN_PROCESS_EXERCISES = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/test_exercises_*.py")
                              if not re.search(r"\bcluster\b|engines\.start", p.read_text()))


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_exercise_checkers_on_their_gpu_branch(gpus):
    """Every checker that runs in-process accepts its solution and rejects the wrong answers on a GPU node too. 02's
    exercise 2 checker builds its problem where nn.DataParallel puts the module (4e6582a's did not, and called the
    package's own solution wrong on any GPU node: 2 of test_exercises_02's tests fail here under 1 and 2 simulated
    GPUs, "module must have its parameters and buffers on device cuda:0")."""
    assert [p[-5:-3] for p in IN_PROCESS_EXERCISES] == ["01", "02", "04", "06", "07"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *IN_PROCESS_EXERCISES],
                         capture_output=True, text=True, timeout=240, cwd=ROOT, env=simulated(gpus))
    assert out.returncode == 0, out.stdout[-4000:]


def group_of(backend: str, gpus_seen: list, node_gpus: int, caller="tutorial.train_ddp") -> list[dict]:
    """The record of one trainer's 2-rank process group: what each rank's current GPU is (None: it sees none)."""
    return [dict(kind="init_process_group", group="g", world=2, rank=r, backend=backend, caller=caller, env={},
                 node_gpus=node_gpus, current=0, uuids=[] if gpu is None else [f"GPU-{gpu}"], cell=7)
            for r, gpu in enumerate(gpus_seen)]


def test_the_lanes_check_is_readmes_allocation_table():
    """README's three rows, each as the lane's checker reads a record: what the row says passes, and the other
    backend is named as a problem (the checker's own negative controls)."""
    rows = {line.split("|")[1].strip(): line.split("|")[2] for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith(("| 2 or more", "| 1 (one GPU", "| none |"))}
    assert "one rank per GPU, NCCL" in rows["2 or more (a full node)"]
    assert "both ranks on that GPU over gloo" in rows["1 (one GPU per attendee)"]
    assert "the CPU over gloo" in rows["none"]
    full, shared, cpu = ([0, 1], 2), ([0, 0], 1), ([None, None], 0)
    assert lane.table_problems(group_of("nccl", *full)) == []
    assert lane.table_problems(group_of("gloo", *full)) == [
        "cell 7: init_process_group of 2 ranks: every rank has a GPU of its own (2 on the node), but the backend is "
        "gloo (README: one rank per GPU, NCCL, or xccl on Intel), made by tutorial.train_ddp"]
    assert lane.table_problems(group_of("gloo", *shared)) == []
    assert lane.table_problems(group_of("nccl", *shared)) == ["cell 7: init_process_group of 2 ranks: nccl with ranks "
                                                              "sharing a GPU"]
    assert lane.table_problems(group_of("gloo", *cpu)) == []
    assert lane.table_problems(group_of("nccl", *cpu)) == ["cell 7: init_process_group of 2 ranks: nccl on a rank "
                                                           "that sees no GPU"]
    # an Intel node's row: oneCCL's xccl in NCCL's place, held to the same rules
    assert lane.table_problems(group_of("xccl", *full)) == []
    assert lane.table_problems(group_of("xccl", *shared)) == ["cell 7: init_process_group of 2 ranks: xccl with ranks "
                                                              "sharing a GPU"]
    # a cell's own group (its lesson chose gloo) is not the table's business; a trainer's is
    assert lane.table_problems(group_of("gloo", *full, caller="__main__")) == []
    # a lesson helper's group is the table's business too, unless the lane names it as gloo on purpose
    assert lane.table_problems(group_of("gloo", *full, caller="tutorial.lessons.lightning")) != []
    assert lane.table_problems(group_of("gloo", *full, caller="tutorial.lessons.ranks")) == []


def test_the_lanes_check_cannot_pass_empty_or_half_recorded():
    """A notebook that allocates ranks but recorded no group (its launches lost the simulation), and a group that
    only some of its ranks recorded (a rank that did not run the simulation is unchecked), fail the lane."""
    assert lane.problems_of("03b_ddp_trainer", [], allocates=True) == [
        "its cells allocate ranks, but no process group was recorded: the launches did not run under the simulation "
        "(PYTHONPATH, TUTORIAL_SIMGPU or TUTORIAL_SIMGPU_RECORD lost?)"]
    assert lane.problems_of("02_data_parallel", [], allocates=False) == []
    half = group_of("nccl", [0, 1], 2)[:1]
    assert lane.table_problems(half) == ["cell 7: init_process_group of 2 ranks: only rank(s) [0] recorded it (every "
                                         "rank of a group must run the simulation)"]
    assert lane.problems_of("03b_ddp_trainer", group_of("nccl", [0, 1], 2), allocates=True) == []
    # torch's fake process group is one process playing every rank (11's and 12's layout dry runs): not a half record
    assert lane.table_problems([dict(e, backend="fake") for e in half]) == []


def test_the_full_node_cells_are_the_notebooks_cells():
    """FULL_NODE_CELLS are indices into notebooks that change: each named notebook is in the full-node lane, each
    index is one of its cells, and the last code cell kept stops what the kept cells started (an index that a new
    cell shifted would leave engines or loader workers running, or run a cell without the one it needs)."""
    listed = subprocess.run(["make", "-s", "--no-print-directory", "--eval", "print-%: ; @echo $($*)",
                             "print-FULL_NODE_NOTEBOOKS"], cwd=ROOT, capture_output=True, text=True).stdout
    full_node = {p.split("/")[-1].removesuffix(".ipynb") for p in listed.split()}
    assert set(lane.FULL_NODE_CELLS) <= full_node and set(lane.FULL_NODE_PRESET) <= full_node
    for notebook, kept in lane.FULL_NODE_CELLS.items():
        cells = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text())["cells"]
        assert max(kept) < len(cells), notebook
        last = "".join(cells[max(i for i in kept if cells[i]["cell_type"] == "code")]["source"])
        assert "cluster.stop()" in last or "child_processes()" in last, (notebook, last)


HIDES_THE_GPU = ("CUDA_VISIBLE_DEVICES=", "{cpu_only}", "sharded.launch(", "lesson.walltime(")
ASSIGNED = re.compile(r"^(?:global\s+)?([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*=(?!=)", re.M)


def test_the_one_gpu_run_leaves_out_only_launches_hidden_from_the_gpu():
    """Each cell ONE_GPU_HIDDEN leaves out hides its launch from the GPU, reads a name such a cell made (their output,
    metrics or config) or makes one that only they read (their folder, a killer thread's target); and no cell the one-GPU run keeps reads a name that only a left-out cell made, so a
    new cell that needs one, or an index a new cell shifted, fails here instead of as a NameError in the lane."""
    listed = subprocess.run(["make", "-s", "--no-print-directory", "--eval", "print-%: ; @echo $($*)",
                             "print-ONE_GPU_NOTEBOOKS"], cwd=ROOT, capture_output=True, text=True).stdout
    assert set(lane.ONE_GPU_HIDDEN) <= {p.split("/")[-1].removesuffix(".ipynb") for p in listed.split()}
    for notebook, hidden in lane.ONE_GPU_HIDDEN.items():
        cells = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text())["cells"]
        code = {i: "".join(c["source"]) for i, c in enumerate(cells) if c["cell_type"] == "code"}
        assert set(hidden) <= set(code), (notebook, sorted(set(hidden) - set(code)))
        names = lambda i: {n.strip() for m in ASSIGNED.findall(code[i]) for n in m.split(",")}
        reads = lambda i, made: {n for n in made if re.search(rf"\b{n}\b", code[i])}
        made_hidden = set()
        for i in sorted(hidden):  # a hidden launch, a cell that reads what one made, or one that prepares it
            prepares = any(reads(j, names(i)) for j in hidden if j > i)
            assert any(m in code[i] for m in HIDES_THE_GPU) or reads(i, made_hidden) or prepares, \
                f"{notebook} [{i}] is left out of the one-GPU run but launches nothing hidden from the GPU: {code[i]!r}"
            made_hidden |= names(i)
        made_kept = set().union(*(names(i) for i in code if i not in hidden))
        for i in (i for i in code if i not in hidden):
            only_hidden = set().union(*(names(j) for j in hidden if j < i)) - made_kept
            assert not reads(i, only_hidden), \
                f"{notebook} [{i}] runs on one GPU but reads {sorted(reads(i, only_hidden))} from a left-out cell"


def test_tensors_made_below_python_are_not_refused_as_cpu_tensors():
    """A DTensor op's local result is made by DTensor's dispatch, below the simulation's reach, as a plain CPU tensor:
    what Python computes from it is of unknown device, not the CPU (12's tensor-parallel attention added it to the
    residual stream on the GPU and was refused, falsely: 22e90d0 fails the first line). A CPU tensor Python made is
    still refused beside a GPU one. DTensor's backward runs its Python inside autograd's engine, which the simulation
    now starts itself (simgpu._backward): 22e90d0 reached the real CUDA there ("CUDA driver version is insufficient")."""
    out = python("""
        import torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
        dt = DTensor.from_local(torch.ones(4, 4, device="cuda"), init_device_mesh("cuda", (1,)), [Replicate()])
        local = (dt @ dt).to_local()
        print("the local result plus a GPU tensor:", (local * 2 + torch.ones(4, 4, device="cuda")).device)
        try:
            torch.ones(4) * 2 + torch.ones(4, device="cuda")
        except RuntimeError as exc:
            print("a CPU tensor Python made:", str(exc).split(",")[0])
        w = torch.ones(4, 4, device="cuda", requires_grad=True)
        (DTensor.from_local(w, dt.device_mesh, [Replicate()]) @ dt).to_local().sum().backward()
        print("the gradient through DTensor's backward:", w.grad.device, float(w.grad.sum()))
        dist.destroy_process_group()
    """, gpus=1)
    assert out.stdout.splitlines() == ["the local result plus a GPU tensor: cuda:0",
                                       "a CPU tensor Python made: Expected all tensors to be on the same device",
                                       "the gradient through DTensor's backward: cuda:0 64.0"], \
        out.stdout + out.stderr[-3000:]


def test_the_simulation_answers_as_an_h200_did(tmp_path):
    """tests/simgpu/versus_cuda.py's probes (refusals, autocast dtypes, memory, host syncs, NCCL, lazy init) under
    one simulated GPU, held to what an H200 answered to the same probes (results/simgpu_vs_cuda.json, 2026-11-29).
    The simulation before this test differed in 7 answers (an index on the other device, the sum under autocast, nonzero's
    and a mask's host syncs, DDP's buckets with gradient_as_bucket_view); the controls below change one answer of
    each kind and must be caught."""
    import versus_cuda
    gpu = json.loads((ROOT / "results" / "simgpu_vs_cuda.json").read_text())
    assert not gpu["simulated"] and gpu["hardware"] and gpu["date"]
    out = subprocess.run([sys.executable, str(SIMGPU / "versus_cuda.py"), "--out", str(tmp_path / "sim.json")],
                         capture_output=True, text=True, timeout=180, cwd=ROOT, env=simulated(1))
    assert out.returncode == 0, out.stderr[-3000:]
    sim = json.loads((tmp_path / "sim.json").read_text())
    assert sim["simulated"]
    assert versus_cuda.problems(gpu, sim) == []
    # controls: one answer of each kind changed, each must be reported
    for path, value in [(("refusals", "cuda tensor indexed by cpu indices"), {"error": "RuntimeError",
                                                                              "message": "Expected all tensors"}),
                        (("autocast dtypes", "torch.bfloat16", "sum of matmul"), "torch.bfloat16"),
                        (("host syncs", "torch.nonzero(t)"), {"ok": 0}),
                        (("memory", "MLP 512-1024-10, SGD momentum, batch 256", "step 0 after step"), 4812288 + 512),
                        (("nccl", "DDP gradient_as_bucket_view=True"), {"parameters B": 2142248, "after wrapping": 0,
                                                                        "after backward": 2142720}),
                        (("is_initialized after", "device_count()"), True)]:
        changed = json.loads(json.dumps(sim))
        where = changed
        for key in path[:-1]:
            where = where[key]
        where[path[-1]] = value
        assert versus_cuda.problems(gpu, changed), path


def test_deepspeed_computes_in_bf16_on_a_simulated_gpu(tmp_path):
    """DeepSpeed's engine turns off an autocast("cuda") opened around it unless its own torch_autocast is declared:
    on an H200 (2026-11-29) its "bf16" run computed in fp32. On the CPU (test_matrix) the engine leaves CPU autocast
    alone, so only a (simulated) GPU shows it. Control: the trainer's earlier config (no torch_autocast) observed
    ['float32'] here."""
    out = python(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from observe import run_observed
        from tutorial import train_deepspeed
        from tutorial.core.config import TrainConfig
        cfg = TrainConfig.preset("workshop-cpu", precision="bf16", max_steps=1, out={str(tmp_path)!r})
        m = run_observed(train_deepspeed.main, cfg)
        print("observed", m["device"], m["observed"]["dtypes"])
    """, gpus=1, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "observed cuda:0 ['bfloat16']" in out.stdout, out.stdout[-2000:]


def test_a_simulated_amd_node_takes_and_hides_its_gpus_by_rocr_and_hip():
    """TUTORIAL_SIMGPU_VENDOR=rocm: a ROCm build on an AMD node, whose GPUs ROCR_VISIBLE_DEVICES picks and
    HIP_VISIBLE_DEVICES (or its alias CUDA_VISIBLE_DEVICES) picks among; an empty ROCR list hides them, an empty HIP or
    CUDA one hides nothing. The engines that the allocation sends to the CPU see no GPU there, and those it gives a
    GPU see theirs (ROCR_VISIBLE_DEVICES, core.accelerator.showing). Control: the spelling f7f8195 used everywhere,
    CUDA_VISIBLE_DEVICES=, leaves the GPU visible on this node."""
    out = python("""
        import os, subprocess, sys
        from tutorial.core import accelerator
        from tutorial.launch import engines
        from tutorial.lessons import notebook
        print(accelerator.vendor().company, accelerator.runtime(), accelerator.device_names()[0])
        code = "import torch; print(torch.cuda.device_count())"
        for hide in ({"CUDA_VISIBLE_DEVICES": ""}, {"HIP_VISIBLE_DEVICES": ""}, accelerator.showing(())):
            seen = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **hide), capture_output=True,
                                  text=True).stdout.strip()
            print(sorted(hide), seen)
        os.environ.update(ROCR_VISIBLE_DEVICES="4,5,6", HIP_VISIBLE_DEVICES="1,2")  # this attendee's: GPUs 5 and 6
        alloc = notebook.allocation(2, None, trainer="ddp")
        with engines.start(n=2, device=alloc.device, gpus=alloc.gpus) as cluster:
            print([(e.device.split()[0], e.gpu[-2:]) for e in cluster.engines])
        moved = notebook.allocation(3, None, trainer="fsdp")
        with engines.start(n=3, device=moved.device, gpus=moved.gpus) as cluster:
            print([e.device for e in cluster.engines])
    """, gpus=8, timeout=240, TUTORIAL_SIMGPU_VENDOR="rocm")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "AMD ROCm 6.2 AMD Instinct MI250X (simulated)", out.stdout
    assert lines[1:4] == ["['CUDA_VISIBLE_DEVICES'] 8", "['HIP_VISIBLE_DEVICES'] 8",
                          "['HIP_VISIBLE_DEVICES', 'ROCR_VISIBLE_DEVICES'] 0"], out.stdout
    assert "2 rank(s) on GPU(s) 1,2, one per GPU, RCCL" in out.stdout
    assert "[('cuda:0', '05'), ('cuda:1', '06')]" in out.stdout  # HIP's 1 and 2 of ROCR's 4,5,6: GPUs 5 and 6
    assert "3 ranks on the CPU with gloo" in out.stdout and "['cpu', 'cpu', 'cpu']" in out.stdout


def test_a_simulated_intel_node_uses_xpu_and_xccl_and_hides_its_tiles_by_the_selector(tmp_path):
    """TUTORIAL_SIMGPU_VENDOR=xpu: an XPU build on an Intel node (Aurora's: 12 tiles, each a device to torch): tensors
    are "xpu", collectives oneCCL's xccl, ZE_AFFINITY_MASK picks the tiles and ONEAPI_DEVICE_SELECTOR=opencl:cpu hides
    them all (an empty mask is no mask). Engines given a tile each see theirs and make an xccl group; ranks the
    allocation sends to the CPU see none. Controls: code that names "cuda" fails on this node, as it does on Aurora;
    the spelling f7f8195 used everywhere, CUDA_VISIBLE_DEVICES=, hides nothing here; NCCL is not built in; the question
    f7f8195's cells asked, torch.cuda.is_available(), is recorded and fails the lane (it answers False on Aurora, and
    the cell's work went to the CPU without a word), while torch's own calls to torch.cuda are not."""
    record = tmp_path / "record.jsonl"
    out = python("""
        import os, subprocess, sys, torch, torch.distributed as dist
        print("asked", torch.cuda.is_available())  # f7f8195's way to find the GPU
        torch.manual_seed(0)  # torch.random calls torch.cuda.manual_seed_all itself: not the course's question
        with torch.autocast("cuda", dtype=torch.bfloat16):  # f7f8195's 04: disabled there, with a warning only
            pass
        import simgpu  # which tiles the mask and the selector leave of 12 (FLAT: a tile is a device; "c.t" = 2c + t)
        print([simgpu._indices(mask, list(range(12)), tiles=True) for mask in ("4,5", "2.1,3.0", "0,x,1")],
              [simgpu._selected(sel, [4, 5, 6]) for sel in ("opencl:cpu", "level_zero:gpu", "level_zero:1,2",
                                                         "!level_zero:*", "!opencl:*", "*:cpu", "!level_zero:0")])
        from tutorial.core import accelerator
        from tutorial.launch import engines
        from tutorial.lessons import notebook
        print(accelerator.vendor().company, accelerator.runtime(), accelerator.backend(), accelerator.device_names()[0])
        code = "import torch; print(torch.accelerator.device_count())"
        for hide in ({"CUDA_VISIBLE_DEVICES": ""}, {"ZE_AFFINITY_MASK": ""}, accelerator.showing(())):
            seen = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **hide), capture_output=True,
                                  text=True).stdout.strip()
            print(sorted(hide), seen)
        for bad in (lambda: torch.ones(1, device="cuda"), lambda: torch.ones(1).cuda(),
                    lambda: dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)):
            try:
                bad()
            except (AssertionError, RuntimeError) as exc:
                print("refused:", str(exc).split(" (simulated")[0])
        os.environ["ZE_AFFINITY_MASK"] = "4,5,6"  # this attendee's three tiles
        alloc = notebook.allocation(2, None, trainer="ddp")
        with engines.start(n=2, device=alloc.device, gpus=alloc.gpus) as cluster:
            print([(e.device.split()[0], e.gpu[-2:]) for e in cluster.engines])
            def pair():
                import torch, torch.distributed as dist
                from tutorial.core import distributed
                world = distributed.world_from_env()
                device = distributed.pick_device(world.local_rank, world.local_world_size)
                distributed.init_process_group(world, device)
                t = torch.ones(1, device=device)
                dist.all_reduce(t)
                return dist.get_backend(), str(t.device), t.item()
            print(cluster.run(pair))
        moved = notebook.allocation(4, None, trainer="ddp")  # more ranks than tiles: no sharing over gloo on XPU
        from tutorial.launch import engine_options  # what its engines get (hidden as the subprocess above was)
        request = engine_options.check(4, "local", device=moved.device, gpus=moved.gpus, timeout=30, run_timeout=30,
                                       on_failure="restart", activate=False, where={})
        env = engine_options.ipp_config(request, "t").EngineLauncher.environment
        print("hidden", request.use_cuda, {k: v for k, v in env.items() if k in ("ONEAPI_DEVICE_SELECTOR",
                                                                                 "ZE_AFFINITY_MASK")})
    """, gpus=12, record=record, timeout=240, TUTORIAL_SIMGPU_VENDOR="xpu")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines.pop(0) == "asked False"
    asked = [dict(e, cell=3) for e in records(record) if e["kind"] == "cuda asked"]
    assert [(e["asked"], e["where"]) for e in asked] == [("torch.cuda.is_available", "__main__:<module>:3"),
                                                         ('torch.autocast("cuda")', "__main__:<module>:5")]
    assert lane.problems_of("00_setup", asked[:1]) == [
        "cell 3: torch.cuda.is_available() asked on an Intel node, where it answers as a build without CUDA (no GPU), "
        "so the work runs on the CPU unawares; ask torch.accelerator (__main__:<module>:3)"]
    assert lines.pop(0) == "[[4, 5], [5, 6], [0]] [[], [4, 5, 6], [5, 6], [], [4, 5, 6], [], [5, 6]]"
    assert lines[0] == "Intel XPU on Level Zero, SYCL 20250101-simulated xccl Intel(R) Data Center GPU Max 1550 " \
                       "(simulated)", out.stdout
    assert lines[1:4] == ["['CUDA_VISIBLE_DEVICES'] 12", "['ZE_AFFINITY_MASK'] 12", "['ONEAPI_DEVICE_SELECTOR'] 0"], \
        out.stdout
    assert lines[4:7] == ["refused: Torch not compiled with CUDA enabled"] * 2 + [
        "refused: Distributed package doesn't have NCCL built in"], out.stdout
    assert "2 rank(s) on GPU(s) 4,5, one per GPU, oneCCL" in out.stdout, out.stdout
    assert "[('xpu:0', '04'), ('xpu:1', '05')]" in out.stdout, out.stdout  # the engines see both, use one each
    assert "('xccl', 'xpu:0', 2.0)" in out.stdout, out.stdout
    assert "4 ranks on the CPU with gloo" in out.stdout, out.stdout
    assert lines[-1] == "hidden False {'ONEAPI_DEVICE_SELECTOR': 'opencl:cpu'}", out.stdout

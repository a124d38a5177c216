"""What notebook 09_sharded_training needs besides the trainers: memory per rank, loading every trainer's checkpoint
as one parameter vector, the ZeRO arithmetic, and the exercises' checkers and solutions."""
from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..core.accelerator import AllocatorWindow
from ..core.config import TrainConfig, first_line
from ..core.deepspeed_compat import join_group
from ..core.distributed import init_process_group, teardown, world_from_env

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp")

# Loading a DCP checkpoint without a process group is what notebook 09 does on purpose; torch warns about it.
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
# torch 2.14 renamed two collectives; FSDP and DeepSpeed still call the old names, and the warning is for them, not
# for the learner measuring memory.
warnings.filterwarnings("ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
                        FutureWarning)


# ------------------------------------------------------------------------------------------------- memory per rank
def _bytes(t) -> int:
    if t is None or not torch.is_tensor(t):
        return 0
    t = t.to_local() if hasattr(t, "to_local") else t  # FSDP's DTensor: only this rank's shard is in memory here
    return t.numel() * t.element_size()


def _tensors(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def held_bytes(module, optimizer) -> dict:
    """Bytes this rank holds, in four kinds: parameters, gradients, optimizer state (SGD's momentum), and the fp32
    master copy that DeepSpeed's ZeRO optimizers keep of their partition. Call it after a backward pass."""
    params = sum(_bytes(getattr(p, "ds_tensor", None)) + _bytes(p.data) for p in module.parameters())
    grads = sum(_bytes(p.grad) for p in module.parameters())
    grads += sum(_bytes(t) for t in _tensors(getattr(optimizer, "averaged_gradients", None)))  # ZeRO's partitions
    base = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed wraps the torch optimizer
    state = sum(_bytes(t) for s in base.state.values() for t in _tensors(s))
    master = sum(_bytes(t) for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
                 for t in _tensors(getattr(optimizer, name, None)))
    return dict(parameters=params, gradients=grads, optimizer_state=state, master_copy=master)


def memory_per_rank(cfg: TrainConfig, strategy: str) -> dict:
    """Run on every engine: build the model exactly as the trainer does (its setup and build), take one optimizer
    step (so the optimizer state exists), run one more forward and backward (so the gradients exist), and return
    the bytes this rank holds (tensor bytes, on any device). On a GPU rank also `gpu_peak`, what
    torch.accelerator.max_memory_allocated saw from the build to the last backward (activations, buckets and the
    allocator's blocks included: what an out-of-memory error is about); None on a CPU rank. strategy: ddp, zero1,
    zero2, zero3 or fsdp."""
    from .. import train_ddp, train_deepspeed, train_fsdp
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r} is not one of: {', '.join(STRATEGIES)}")
    trainer = {"ddp": train_ddp, "fsdp": train_fsdp}.get(strategy, train_deepspeed)
    deepspeed = strategy.startswith("zero")
    if deepspeed:
        cfg = cfg.replace(zero_stage=int(strategy[-1]))
    device, precision = trainer.setup(cfg)
    created = init_process_group(world_from_env(), device, cfg.timeout, cfg.backend)  # as the trainer's main joins
    try:
        if deepspeed:
            join_group(device, created)
        with AllocatorWindow(device) as memory:  # a GPU of any vendor: the allocator's counters; None on the CPU
            built = trainer.build(cfg, device, precision) if strategy == "fsdp" else trainer.build(cfg, device)
            model, optimizer, loader, _, _ = built
            X, y = (t.to(device) for t in next(iter(loader)))
            for step in range(2):
                loss = F.cross_entropy(model(X), y)
                model.backward(loss) if deepspeed else loss.backward()
                if step == 0:
                    model.step() if deepspeed else (optimizer.step(), optimizer.zero_grad())
        module = model.module if hasattr(model, "module") else model
        held = held_bytes(module, optimizer)
        full = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in module.parameters())
        return dict(strategy=strategy, rank=dist.get_rank(), world_size=dist.get_world_size(), parameter_count=full,
                    gpu_peak=memory.max, **held)
    finally:
        teardown(created)


def memory_table(rows: list[dict]) -> list[dict]:
    """The measurements as a table in MB, with the total and its share of DDP's; measured on GPU ranks, their peak
    allocated memory beside the tensor bytes."""
    ddp = next(sum(r[k] for k in ("parameters", "gradients", "optimizer_state", "master_copy"))
               for r in rows if r["strategy"] == "ddp")
    table = []
    for r in rows:
        total = r["parameters"] + r["gradients"] + r["optimizer_state"] + r["master_copy"]
        table.append({"strategy": r["strategy"], "parameters MB": r["parameters"] / 1e6,
                      "gradients MB": r["gradients"] / 1e6, "optimizer MB": r["optimizer_state"] / 1e6,
                      "fp32 copy MB": r["master_copy"] / 1e6, "total MB": total / 1e6, "of DDP": total / ddp})
        if any(row.get("gpu_peak") is not None for row in rows):
            table[-1]["GPU peak MB"] = r["gpu_peak"] / 1e6 if r.get("gpu_peak") is not None else None
    return table


def zero_bytes_per_parameter(stage: int, world_size: int, param_bytes: int = 2, grad_bytes: int = 2,
                             optimizer_bytes: int = 12) -> float:
    """The ZeRO paper's count of bytes per parameter on each GPU (Rajbhandari et al. 2020): mixed-precision Adam
    keeps 2 (bf16/fp16 weights) + 2 (their gradients) + 12 (fp32 master weights, momentum, variance). Stage 1
    shards the optimizer's 12, stage 2 also the gradients, stage 3 also the weights; FSDP is stage 3."""
    n = world_size
    shard = [(1, 1, 1), (1, 1, n), (1, n, n), (n, n, n)][stage]
    return param_bytes / shard[0] + grad_bytes / shard[1] + optimizer_bytes / shard[2]


# ------------------------------------------------------------------------------------------ checkpoints as vectors
def load_parameters(out: str) -> dict[str, torch.Tensor]:
    """The model's parameters by name from any trainer's output folder: checkpoint.pt (single, DDP, Horovod),
    checkpoint/ written by DCP (FSDP) or by DeepSpeed, or Lightning's checkpoint.ckpt. Runs in one process."""
    ckpt = os.path.join(out, "checkpoint")
    if os.path.isfile(ckpt + ".pt"):
        return torch.load(ckpt + ".pt", map_location="cpu", weights_only=True)["model"]
    if os.path.isfile(ckpt + ".ckpt"):
        state = torch.load(ckpt + ".ckpt", map_location="cpu", weights_only=False)["state_dict"]
        return {k.removeprefix("model."): v for k, v in state.items()}
    if os.path.isfile(os.path.join(ckpt, ".metadata")):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        target = os.path.join(out, "consolidated.pt")
        dcp_to_torch_save(ckpt, target)  # every shard read back into whole tensors, no process group needed
        return torch.load(target, map_location="cpu", weights_only=False)["model"]
    if os.path.isfile(os.path.join(ckpt, "latest")):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress
            return get_fp32_state_dict_from_zero_checkpoint(ckpt)  # the fp32 partitions of every rank, stitched
    raise FileNotFoundError(f"no checkpoint in {out!r}")


def max_difference(a: str, b: str) -> float:
    """The largest difference between two runs' parameters, from their output folders (0.0: bitwise the same)."""
    first, second = load_parameters(a), load_parameters(b)
    return max((first[k].float() - second[k].float()).abs().max().item() for k in sorted(first))


def checkpoint_files(out: str) -> list[str]:
    """What a sharded checkpoint wrote, relative to out/checkpoint (each rank its own files)."""
    root = os.path.join(out, "checkpoint")
    return sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "**", "*"), recursive=True)
                  if os.path.isfile(p) and not p.endswith(".py")) + \
        sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, ".metadata")))


# ----------------------------------------------------------------------------------------------------- exercises
def check_bytes_per_parameter(fn) -> bool:
    """Exercise 1: compare your bytes_per_parameter(stage, world_size) with the ZeRO paper's, and say where it
    goes wrong first."""
    why = {0: "stage 0 is plain data parallelism: every rank keeps all 2 + 2 + 12 bytes",
           1: "stage 1 shards only the optimizer's 12 bytes (fp32 master copy, momentum, variance)",
           2: "stage 2 shards the optimizer state and the gradients; every rank keeps whole bf16 weights",
           3: "stage 3 (and FSDP) shards weights, gradients and optimizer state: 16 / world_size"}
    for stage in range(4):
        for n in (1, 2, 8, 64):
            got, want = fn(stage, n), zero_bytes_per_parameter(stage, n)
            if abs(got - want) > 1e-9:
                print(f"  - stage {stage}, {n} ranks: you have {got:g} bytes per parameter, expected {want:g}: "
                      f"{why[stage]}")
                print("bytes per parameter right for every stage: False")
                return False
    print("bytes per parameter right for every stage: True")
    return True


def fully_shard_solution(model):
    """Exercise 2: one FSDP unit per layer (per block, in a bigger model) with parameters, then the root, which owns
    what no layer took and starts the first all-gather; as train_fsdp shards its blocks."""
    from torch.distributed.fsdp import fully_shard
    for layer in model:
        if any(True for _ in layer.parameters(recurse=False)):
            fully_shard(layer)
    fully_shard(model)
    return model


def check_fully_shard(shard_fn) -> dict:
    """Exercise 2, on every engine: shard a small MLP with shard_fn(model), then check that every parameter is a
    DTensor holding 1/world_size of the tensor, that the root is sharded, and that the output equals the unsharded
    model's. Rank 0 prints what is wrong."""
    from torch import nn
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from ..core.distributed import init_process_group, pick_device, world_from_env
    world = world_from_env()
    device = pick_device(world.local_rank, world.local_world_size)
    created = init_process_group(world, device)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        # On this rank's device from the start: fully_shard would move the parameters there anyway, and a reference
        # computed on the CPU would compare a GPU's rounding with the CPU's (same random numbers: drawn on the CPU).
        model.to(device)
        plain = [p.detach().clone() for p in model.parameters()]
        X = torch.randn(8, 64).to(device)
        expected = model(X).detach()
        sharded_model = shard_fn(model) or model
        problems = []
        names = [n for n, p in sharded_model.named_parameters() if not isinstance(p, DTensor)]
        if names:
            problems.append(f"not sharded: {', '.join(names)} (call fully_shard on every layer with parameters)")
        layers = [name for name, child in sharded_model.named_children() if any(True for _ in child.parameters())]
        whole = [name for name in layers if not isinstance(getattr(sharded_model, name), FSDPModule)]
        if whole and isinstance(sharded_model, FSDPModule) and len(whole) == len(layers):
            problems.append("the whole model is one FSDP unit: its forward gathers every parameter at once and holds "
                            "them all until backward, so no rank ever holds less than the whole model; call "
                            "fully_shard on each layer (or block) first, then on the model")
        elif whole:
            problems.append(f"layers {', '.join(whole)} are not FSDP units of their own: call fully_shard on each "
                            "layer with parameters, so that each is gathered only while it runs")
        if not isinstance(sharded_model, FSDPModule):
            problems.append("the root is not sharded: end with fully_shard(model), so that one root unit starts the "
                            "all-gathers and frees the layers after use")
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in sharded_model.parameters())
        share = local / sum(p.numel() for p in plain)
        if share > 0.6 and world.world_size > 1:
            problems.append(f"this rank holds {share:.0%} of the parameters, not about 1/{world.world_size}")
        if not problems and not torch.allclose(sharded_model(X).detach().float(), expected, atol=1e-5):
            problems.append("the sharded model computes something else than the original")
        if world.rank == 0:
            for p in problems:
                print("  -", p)
            print(f"every layer and the root sharded, same output: {not problems}")
        dist.barrier()
        return {"ok": not problems, "share": share, "problems": problems}
    finally:
        if created:
            dist.destroy_process_group()


# ------------------------------------------------------------------------- activation checkpointing (measured)
def mlp_blocks(depth: int = 4, width: int = 512, seed: int = 0) -> torch.nn.Sequential:
    """The model 09's activation-checkpointing cells use: `depth` transformer-like MLP blocks (width -> 4 width ->
    width), the repeated unit that one would checkpoint (and shard) one by one. The same weights for a seed."""
    from torch import nn
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                           for _ in range(depth)])


def activation_memory(model, X, blocks=None) -> dict:
    """One forward and backward of model on X, measured three ways:
    - saved_bytes: what autograd keeps for backward, in bytes: every tensor handed to saved_tensors_hooks' pack hook
      during forward, each storage counted once and the parameters left out (they are held anyway). Runs anywhere;
      it is tensor bytes, not what an allocator reports.
    - peak_bytes: on a GPU, torch.accelerator.max_memory_allocated during forward and backward above what was
      allocated before (weights, input); None on the CPU, which has no such counter.
    - at_once: the most blocks recomputed during backward whose backward had not yet run (1 when each block is
      checkpointed on its own; all of them when the whole model is one checkpoint; 0 without checkpointing).
    blocks: the modules to watch (default: model's children, or the children of its `blocks`/first child)."""
    blocks = list(blocks if blocks is not None else model.children())
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    state = {"backward": False, "live": set(), "at_once": 0}

    def recomputed(module, args, i):
        if state["backward"]:  # a block's forward during backward is checkpointing's recomputation
            state["live"].add(i)
            state["at_once"] = max(state["at_once"], len(state["live"]))

    def through(param, i):
        state["live"].discard(i)  # this block's backward ran: its recomputed activations can go

    handles = [b.register_forward_pre_hook(lambda m, a, i=i: recomputed(m, a, i)) for i, b in enumerate(blocks)]
    handles += [p.register_post_accumulate_grad_hook(lambda p, i=i: through(p, i))
                for i, b in enumerate(blocks) for p in b.parameters()]
    try:
        with AllocatorWindow(X.device) as memory:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(X).square().mean()
            state["backward"] = True
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    peak = memory.peak
    grads = {name: None if p.grad is None else p.grad.detach().clone() for name, p in _named_block_parameters(blocks)}
    return {"saved_bytes": sum(saved.values()), "peak_bytes": peak, "at_once": state["at_once"], "grads": grads}


def _named_block_parameters(blocks):
    for i, block in enumerate(blocks):
        for name, p in block.named_parameters():
            yield f"{i}.{name}", p


def checkpoint_solution(model):
    """Exercise 3: checkpoint each block of a model one cannot edit. apply_activation_checkpointing wraps every
    module check_fn accepts in a CheckpointWrapper whose default is the non-reentrant checkpoint."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    blocks = set(model.children())
    apply_activation_checkpointing(model, check_fn=lambda module: module in blocks)
    return model


def check_checkpointing(checkpoint_fn, depth: int = 4) -> bool:
    """Exercise 3: checkpoint_fn(model) must return mlp_blocks() with each block checkpointed. Compared with the
    same model unwrapped: the same gradients (within 1e-6), less than half the saved activations, and one block
    recomputed at a time during backward. Prints what is wrong, on the CPU."""
    X = torch.randn(64, 512, generator=torch.Generator().manual_seed(1))
    reference = activation_memory(mlp_blocks(depth), X)
    model = mlp_blocks(depth)
    blocks = list(model.children())  # the learner's wrappers call these same modules
    problems = []
    try:
        wrapped = checkpoint_fn(model)
        wrapped = model if wrapped is None else wrapped
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the reentrant checkpoint's "None of the inputs..."
            got = activation_memory(wrapped, X, blocks)
    except RuntimeError as exc:
        if "does not require grad" in str(exc):
            problems.append("backward has nothing to differentiate: a reentrant checkpoint (use_reentrant=True, "
                            "CheckpointImpl.REENTRANT) passes gradients only through inputs that require grad, and "
                            "the data going into the first block does not; use the non-reentrant one "
                            "(use_reentrant=False, CheckpointImpl.NO_REENTRANT, apply_activation_checkpointing's "
                            "default)")
        else:
            problems.append(f"forward or backward failed: {type(exc).__name__}: {first_line(exc)}")
        got = None
    if got is not None:
        missing = [n for n, g in got["grads"].items() if g is None]
        wrong = [n for n, g in got["grads"].items()
                 if g is not None and not torch.allclose(g, reference["grads"][n], rtol=1e-5, atol=1e-6)]
        if missing:
            problems.append(f"no gradient for {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: "
                            "those blocks were cut out of the graph")
        elif wrong:
            problems.append(f"gradients differ from the plain model's for {', '.join(wrong[:3])}")
        if got["saved_bytes"] > reference["saved_bytes"] / 2:
            problems.append(f"saved activations {got['saved_bytes']:,} bytes against {reference['saved_bytes']:,} "
                            "without checkpointing: not every block is checkpointed")
        elif got["at_once"] > 1:
            problems.append(f"backward recomputed {got['at_once']} blocks at once: the whole model is one "
                            "checkpoint, so its recomputation holds every block's activations again and the peak "
                            "stays the plain model's; checkpoint each block on its own")
    for p in problems:
        print("  -", p)
    print(f"each block checkpointed, same gradients: {not problems}")
    return not problems


# -------------------------------------------------------------------------------------------- launch from a cell
RUN_LINE = re.compile(r"^(\S+: world size \d|epoch \d+:|target accuracy|Epoch \d+:|`Trainer\.fit` stopped)")


def launch(stage: str, cfg: TrainConfig, out: str, launcher: str = "torchrun", nproc: int = 2,
           timeout: float = 600) -> dict:
    """Run `tutorial.train_<stage>` as from a terminal (torchrun, mpirun or DeepSpeed's `deepspeed` launcher) with
    cfg's flags, print the command and rank 0's training lines (not the launchers' dated log lines), and return the
    metrics.json rank 0 wrote. Whatever the launch started is stopped on a failure or a timeout."""
    from ..core.config import to_argv
    from ..core.process import free_port, threads_per_process
    from ..launch.commands import _tool, display
    from ..launch.child_processes import launch as start, launcher_env
    program = ["-m", f"tutorial.train_{stage}", *to_argv(cfg.replace(out=out))]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *program]
    elif launcher == "mpirun":
        cmd = [_tool("mpirun"), "-np", str(nproc), sys.executable, *program]
    elif launcher == "deepspeed":  # its launcher passes --local_rank unless told not to; -m needs --module
        # and rendezvous on 29500 unless given a port: a second job on the node (a neighbour's) would collide
        cmd = [_tool("deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), "--no_local_rank",
               "--module", program[1], *program[2:]]
    else:
        raise ValueError(f"launcher {launcher!r} is not one of: torchrun, mpirun, deepspeed")
    shown = ["deepspeed", *cmd[1:]] if launcher == "deepspeed" else cmd
    print("$ " + display(shown).replace(sys.executable, "python"), flush=True)
    run = start(cmd, out=out, timeout=timeout, check=False,
                env=launcher_env(threads=threads_per_process(nproc), cpu=True, DS_ACCELERATOR="cpu"))
    if not run.ok:
        raise RuntimeError(f"{launcher} exited with code {run.returncodes[0]}:\n{run.outputs[0][-3000:]}")
    for line in run.outputs[0].splitlines():
        line = re.sub(r"^\[\d+\]<stdout>:|^\d+: ", "", line)  # launchers that prefix every line with its rank
        if RUN_LINE.match(line):
            print(line)
    return run.metrics


def memory_plot(table: list[dict]):
    """Stacked bars: what one rank holds under each strategy (MB)."""
    import matplotlib.pyplot as plt
    kinds = ["parameters MB", "gradients MB", "optimizer MB", "fp32 copy MB"]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    bottom = [0.0] * len(table)
    for kind in kinds:
        values = [r[kind] for r in table]
        ax.bar([r["strategy"] for r in table], values, bottom=bottom, label=kind.replace(" MB", ""))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("MB held by one rank (of 2)")
    ax.set_title("ResNet-18, fp32, SGD with momentum")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def show_mpi_discovery() -> None:
    """The lines of DeepSpeed's mpi_discovery() that pick rank 0's address (seed 003 patched them)."""
    import inspect
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.comm import comm
    lines = inspect.getsource(comm.mpi_discovery).splitlines()
    start = next(i for i, line in enumerate(lines) if "master_addr = None" in line)
    end = next(i for i, line in enumerate(lines) if "comm.bcast(master_addr" in line)
    print("\n".join(lines[start:end + 1]))

"""Demonstrations for notebook 05_horovod: what runs on every rank, launching the Horovod trainer with horovodrun
or mpirun from a cell, and the table of seed 002's ThetaGPU results.

The functions that run on the engines live in a module (as the trainers do) so that the notebook shows one line
per demonstration; ipyparallel would also run a self-contained function defined in a notebook cell.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.config import TrainConfig
from ..core.process import threads_per_process
from ..launch import commands, processes
from .measure import model_and_batch

# Seed 002 (ALCF's Horovod + PyTorch workshop module on ThetaGPU, 8x A100 per node): seconds for 32 epochs.
SEED_002_SECONDS = {  # GPUs: (cifar10, MNIST)
    1: (522.3, 499.8), 2: (318.8, 283.9), 4: (121.4, 100.4), 8: (73.5, 58.8), 16: (79.1, 63.8), 32: (81.1, 55.7),
}


def seed002_scaling(dataset: str = "MNIST", max_gpus: int = 32) -> list[dict]:
    """Seed 002's results with the speed-up over one GPU and the parallel efficiency (speed-up / GPUs)."""
    column = {"cifar10": 0, "mnist": 1}.get(dataset.lower())
    if column is None:
        raise ValueError(f"dataset {dataset!r} is not one of: cifar10, MNIST")
    one = SEED_002_SECONDS[1][column]
    rows = []
    for gpus, times in SEED_002_SECONDS.items():
        if gpus <= max_gpus:
            speedup = one / times[column]
            rows.append({"GPUs": gpus, "nodes": max(1, gpus // 8), "seconds": times[column],
                         "speed-up": round(speedup, 1), "efficiency %": round(100 * speedup / gpus)})
    return rows


# ------------------------------------------------------------------------------------------- run on the ranks
def broadcast_demo(cfg: TrainConfig) -> dict:
    """Step 5 on every rank: build the model with a different seed per rank (as if nobody had seeded), then
    hvd.broadcast_parameters from rank 0. Returns every rank's weight digest before and after the broadcast."""
    import horovod.torch as hvd
    from ..core.models import checksum
    hvd.init()
    model, _, _ = model_and_batch(cfg.replace(seed=cfg.seed + 1000 * hvd.rank()), batch_size=1, real=False)
    before = hvd.allgather_object(checksum(model))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    after = hvd.allgather_object(checksum(model))
    return dict(rank=hvd.rank(), world_size=hvd.size(), before=before, after=after)


def fp16_compression(cfg: TrainConfig) -> dict:
    """What --fp16-allreduce does to one real gradient of the preset's model: hvd.Compression.fp16 casts it to
    half precision before the all-reduce and back afterwards. Returns sizes and the rounding error it adds."""
    import horovod.torch as hvd
    model, X, y = model_and_batch(cfg, batch_size=cfg.batch_size, real=False)
    F.cross_entropy(model(X), y).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    sent, ctx = hvd.Compression.fp16.compress(grad)   # what travels over the network
    received = hvd.Compression.fp16.decompress(sent, ctx)
    return dict(parameters=grad.numel(), fp32_bytes=grad.numel() * grad.element_size(),
                fp16_bytes=sent.numel() * sent.element_size(), sent_dtype=str(sent.dtype).replace("torch.", ""),
                received_dtype=str(received.dtype).replace("torch.", ""),
                relative_error=((received - grad).norm() / grad.norm()).item(),
                flushed_to_zero=((received == 0) & (grad != 0)).float().mean().item())


# -------------------------------------------------------------------------------------------- launchers
LAUNCHERS = ("horovodrun", "mpirun")


def launch(launcher: str, cfg: TrainConfig, out: str, np: int = 2, extra: tuple = (),
           timeout: float = 600) -> processes.Launch:
    """Run train_horovod with `horovodrun -np N -H localhost:N --gloo` or `mpirun -np N -H localhost:N` (05_horovod).

    The command line carries cfg's preset name and `extra` flags (e.g. ("--fp16-allreduce",)); the other fields of
    cfg are not passed. Uses tutorial.launch.processes.launch: Open MPI's root and oversubscription variables where
    needed, a timeout, and no process left behind. The returned Launch holds rank 0's metrics.json.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r} is not one of: {', '.join(LAUNCHERS)}")
    hosts = f"localhost:{np}"
    if launcher == "horovodrun":
        # Gloo needs neither ssh nor an MPI launcher on one host; --mpi would run mpirun underneath.
        command = commands.horovodrun_command(out, np, hosts, "--gloo", cfg.preset_name)
    else:
        command = commands.mpirun_command(out, np, hosts, "horovod", cfg.preset_name)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = processes.launcher_env(threads=threads_per_process(np), cpu=gpus < np)
    return processes.launch(command + list(extra), out=out, timeout=timeout, env=env)


def compare(runs: dict) -> list[dict]:
    """One row per run (name -> metrics): what a side-by-side table of strategies needs."""
    return [{"run": name, "strategy": m["strategy"], "world size": m["world_size"],
             "global batch": m["global_batch_size"], "test accuracy": round(m["test_accuracy"], 4),
             "seconds": round(m["wall_seconds"], 1), "weights": m["replica_checksums"][0][:8]}
            for name, m in runs.items()]

"""The all-reduce measured: 00_setup's first collective and `tutorial bench allreduce` (07_scaling_study), with the
bus bandwidth nccl-tests reports. Benchmark code, so in bench/, not in the core the trainers import."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..core.distributed import init_process_group, pick_device, teardown, world_from_env


def bus_bandwidth(size_bytes: float, seconds: float, nproc: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce, in bytes/s: algbw x 2(n-1)/n. A ring all-reduce moves
    2(n-1)/n of the buffer over every link, so busbw is comparable with the link's peak whatever n is."""
    return size_bytes / seconds * 2 * (nproc - 1) / nproc


def allreduce_check(megabytes: float = 16.0, repeats: int = 5, iters: int = 0, device: torch.device | None = None) \
        -> dict:
    """00_setup's first collective, and one message size of `tutorial bench allreduce` (07_scaling_study): every
    rank contributes its rank, so every element must sum to n(n-1)/2 on every rank; then `repeats` timings of `iters`
    all-reduces of `megabytes` MiB (0: about 50 ms worth) and the bus bandwidth of their median. Joins a process
    group unless one exists (then it is left as it was)."""
    from statistics import median
    world = world_from_env()
    device = device or pick_device(world.local_rank, world.local_world_size)
    created = init_process_group(world, device)
    try:
        n, rank = dist.get_world_size(), dist.get_rank()
        x = torch.full((max(1, round(megabytes * 2**20) // 4),), float(rank), device=device)
        dist.all_reduce(x)  # also the first call, which sets up connections and buffers: correct before fast
        sum_correct = bool((x == n * (n - 1) / 2).all())
        x.zero_()  # zeros stay zeros however often they are summed

        def slowest(number: int) -> float:
            """Seconds per all-reduce over `number` of them: the slowest rank's, as a collective waits for it. (Not
            torch.utils.benchmark.Timer: importing it warns on CUDA builds without a GPU, in notebook outputs.)"""
            if device.type != "cpu":  # kernels run asynchronously: time them, not their launch
                getattr(torch, device.type).synchronize(device)
            start = time.perf_counter()
            for _ in range(number):
                dist.all_reduce(x)
            if device.type != "cpu":
                getattr(torch, device.type).synchronize(device)
            t = torch.tensor([(time.perf_counter() - start) / number], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.item()

        # Every rank must call all_reduce equally often, so all take their count from the slowest rank's first try.
        first = slowest(1)
        iters = iters or int(min(1000, max(5, 0.05 / max(first, 1e-7))))
        seconds = [slowest(iters) for _ in range(repeats)]
        return dict(rank=rank, world_size=n, backend=dist.get_backend(), device=str(device), sum_correct=sum_correct,
                    megabytes=megabytes, bytes=x.numel() * 4, iterations=iters, seconds=median(seconds),
                    repeat_seconds=seconds, bus_gbytes_per_s=bus_bandwidth(x.numel() * 4, median(seconds), n) / 1e9)
    finally:
        teardown(created)

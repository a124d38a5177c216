"""Notebook 05_horovod: the table of seed 002's ThetaGPU results, the exercises' checkers and solutions, and the
comparison table. The Horovod code itself is typed in the notebook's cells."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .ranks import first_line, on_every_rank


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


# ------------------------------------------------------------------------------------------------ exercises
BASE_LR = 0.1


def _run(cluster, fn, *args, inputs=None) -> str:
    """cluster.run(on_every_rank, fn, *args, inputs=inputs) under Horovod, bounded; "" or the verdict for a rank that died or
    hung."""
    from ..launch.engines import EngineTimeout, RankError
    try:
        cluster.run(on_every_rank, fn, *args, inputs=inputs, join="horovod", timeout=60)
    except EngineTimeout as exc:
        return (f"wrong: {first_line(exc)} -- a collective that only some ranks call waits for the "
                "others in vain: call every hvd collective on every rank")
    except RankError as exc:
        return f"wrong: {first_line(exc, 200)}"
    return ""


def _tiny_model(rank: int, size: int) -> tuple:
    """A small model whose weights depend on the rank (as if nobody had seeded) and a plain SGD optimizer."""
    torch.manual_seed(1000 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=0.9)


def _one_step(prepare) -> dict:
    """On every rank: build _tiny_model, optimizer = prepare(model, optimizer), one training step on the rank's own
    batch; report the optimizer's kind, its lr and the weights' digest after the step."""
    import horovod.torch as hvd
    from ..core.models import checksum
    model, optimizer = _tiny_model(hvd.rank(), hvd.size())
    optimizer = prepare(model, optimizer)
    if not isinstance(optimizer, torch.optim.Optimizer):
        return dict(kind=type(optimizer).__name__, distributed=False, lr=None, after=None)
    gen = torch.Generator().manual_seed(hvd.rank())
    X, y = torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)
    optimizer.zero_grad()
    F.cross_entropy(model(X), y).backward()
    optimizer.step()
    distributed = hasattr(optimizer, "synchronize")  # hvd.DistributedOptimizer's class is made on the fly
    return dict(kind=type(optimizer).__name__, distributed=distributed, lr=optimizer.param_groups[0]["lr"],
                after=checksum(model))


def check_prepare(cluster, prepare) -> str:
    """Exercise 1: prepare(model, optimizer) must do steps 3-5 (scale the lr, DistributedOptimizer, broadcast);
    every rank builds its model with its own seed, then one step, then the replicas must agree."""
    failed = _run(cluster, _one_step, prepare)
    if failed:
        return failed
    reports = cluster.results
    for rank, (status, value) in enumerate(reports):
        if status == "error":
            return f"wrong: rank {rank} raised {value[:160]}"
    seen = [value for _, value in reports]
    problems = []
    if not seen[0]["distributed"]:
        problems.append(f"prepare returned a {seen[0]['kind']}, not hvd.DistributedOptimizer(optimizer, "
                        "named_parameters=model.named_parameters()): nothing averages the gradients (step 4)")
    if seen[0]["lr"] is not None and abs(seen[0]["lr"] - BASE_LR * cluster.n) > 1e-12:
        problems.append(f"the learning rate is {seen[0]['lr']:g}, not {BASE_LR:g} x hvd.size() = "
                        f"{BASE_LR * cluster.n:g}: the global batch is {cluster.n} times larger, so is the step (step 3)")
    digests = [s["after"] for s in seen]
    if seen[0]["distributed"] and len(set(digests)) > 1:
        # Which ranks differ, not the digests: trained weights' last bits depend on the CPU's math kernels.
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        problems.append(
            f"after one step the replicas differ (rank {', '.join(map(str, differ))} against rank 0): every rank "
            "started from its own random weights, and averaged gradients never make them equal; call "
            "hvd.broadcast_parameters(model.state_dict(), root_rank=0) and "
            "hvd.broadcast_optimizer_state(optimizer, root_rank=0) (step 5)")
    if problems:
        return "wrong: " + "; ".join(problems)
    return (f"correct: lr {seen[0]['lr']:g} for {cluster.n} ranks, and after one step every replica holds "
            "the same weights")


def _counts(rank: int, size: int) -> tuple:
    """Rank r's shard of a test set: shards of different sizes (100, 150, 200, ...) and accuracies."""
    return 90 - 20 * rank, 100 + 50 * rank


def check_test_accuracy(cluster, test_accuracy) -> str:
    """Exercise 2: every rank calls test_accuracy(correct, total) with its own shard's counts and must get the
    accuracy over the whole test set."""
    failed = _run(cluster, test_accuracy, inputs=_counts)
    if failed:
        return failed
    counts = [_counts(r, cluster.n) for r in range(cluster.n)]
    expected = sum(c for c, _ in counts) / sum(t for _, t in counts)
    mean_of_shards = sum(c / t for c, t in counts) / cluster.n
    got = []
    for rank, (status, value) in enumerate(cluster.results):
        if status == "error":
            return f"wrong: rank {rank} raised {value[:160]}"
        try:
            got.append(float(value))
        except (TypeError, ValueError):
            return f"wrong: rank {rank} returned {value!r}, not a number"
    if all(abs(g - c / t) < 1e-6 for g, (c, t) in zip(got, counts)):
        return ("wrong: every rank returned its own shard's accuracy (" + ", ".join(
            f"rank {r}: {g:.4f}" for r, g in enumerate(got)) + f"), not the test set's {expected:.4f}: "
            "sum correct and total over the ranks with hvd.allreduce(..., op=hvd.Sum), then divide (step 8)")
    if all(abs(g - mean_of_shards) < 1e-6 for g in got):
        return (f"wrong: every rank returned {mean_of_shards:.4f}, the mean of the shards' accuracies; the shards "
                f"differ in size, so the test set's accuracy is {expected:.4f}: sum the counts with op=hvd.Sum "
                "and divide once")
    wrong = [(r, g) for r, g in enumerate(got) if abs(g - expected) > 1e-6]
    if wrong:
        return (f"wrong: rank {wrong[0][0]} returned {wrong[0][1]:.4f}; every rank should get the test set's "
                f"accuracy {expected:.4f}")
    return f"correct: every rank got the test set's accuracy {expected:.4f}"


# The solutions; tests/test_exercises_05.py checks that each checker accepts its solution and rejects the
# skeleton the notebook starts from.
def solution_prepare(model, optimizer):
    import horovod.torch as hvd
    for group in optimizer.param_groups:
        group["lr"] *= hvd.size()  # step 3: a global batch size() times larger
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())  # step 4
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # step 5: rank 0's weights on every rank
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # and its optimizer state (when resuming)
    return optimizer


def solution_test_accuracy(correct, total):
    import horovod.torch as hvd
    sums = hvd.allreduce(torch.tensor([float(correct), float(total)]), op=hvd.Sum, name="accuracy_counts")
    accuracy = (sums[0] / sums[1]).item()  # the test set's accuracy, the same on every rank
    if hvd.rank() == 0:
        print(f"test accuracy {accuracy:.4f}")
    return accuracy


def compare(runs: dict) -> list[dict]:
    """One row per run (name -> metrics): what a side-by-side table of strategies needs."""
    return [{"run": name, "strategy": m["strategy"], "world size": m["world_size"],
             "global batch": m["global_batch_size"], "test accuracy": round(m["test_accuracy"], 4),
             "seconds": round(m["wall_seconds"], 1), "weights": m["replica_checksums"][0][:8]}
            for name, m in runs.items()]

"""What the recorder watches in a rank: one patcher per recorded API, registered with the API it replaces.

A patcher takes the rank's Recorder and the original function and returns the function installed in its place, which
notes what the call did in `rec.report` and calls the original with the same arguments, so the script runs as it
would. install() below puts PATCHERS in place, in order; the optimizer's steps are watched by torch's global step hooks
(Recorder.before_step, after_step) instead. Nothing here imports torch before install: the launcher imports this.
"""
from __future__ import annotations

import hashlib
import importlib
import os
import re
import sys
from collections.abc import Callable

KEEP_EPOCHS = 3  # a loader's or sampler's order is kept for its first epochs (enough to compare two)
KEEP_ITERATIONS = 50  # a sampler's iterations recorded (epochs and peeks)
KEEP_LINES = 200  # printed metric lines kept per rank
FETCHES_WATCHED = 20  # batches per process whose fetch is watched for random draws (augmentation draws in each)
METRIC = re.compile(r"\b(loss|acc|accuracy|top-?[15]|perplexity|ppl|f1|mse|mae|rmse)\b[^\d\n]{0,16}?"
                    r"[-+]?\d*\.\d+|\b(loss|acc|accuracy)\b[^\d\n]{0,16}?\d+(\.\d+)?\s*%", re.I)
REDUCING = ("all_reduce", "reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "gather",
            "gather_object", "reduce_scatter", "reduce_scatter_tensor", "all_reduce_coalesced")

PATCHERS: list[tuple[str, str, bool, Callable]] = []  # (module, attribute path, optional, patcher), in install order


def patches(*targets: str, optional: bool = False):
    """Register the decorated patcher for each target, "module:Class.attribute"; an optional one may be missing."""
    def register(patcher):
        PATCHERS.extend((*target.split(":"), optional, patcher) for target in targets)
        return patcher
    return register


def install(rec) -> None:
    """Put every registered patcher's function in place of the original it wraps."""
    for module, path, optional, patcher in PATCHERS:
        owner = importlib.import_module(module)
        *owners, name = path.split(".")
        for attribute in owners:
            owner = getattr(owner, attribute)
        if optional and not hasattr(owner, name):
            continue
        setattr(owner, name, patcher(rec, getattr(owner, name)))


# -------------------------------------------------------------------------------------------------------- process group
@patches("torch.distributed:init_process_group", "torch.distributed.distributed_c10d:init_process_group")
def init_process_group(rec, original):
    import torch.distributed as dist

    def recording(*args, **kwargs):
        where = rec.where()
        result = original(*args, **kwargs)
        rec.report["init"].append({"where": where, "backend": str(dist.get_backend())})
        rec.report["world_size"] = dist.get_world_size()
        return result
    return recording


@patches("torch.distributed:destroy_process_group", "torch.distributed.distributed_c10d:destroy_process_group")
def destroy_process_group(rec, original):
    def recording(*args, **kwargs):
        rec.report["destroyed"] += 1
        return original(*args, **kwargs)
    return recording


@patches(*(f"torch.distributed:{name}" for name in REDUCING), optional=True)
def collective(rec, original):
    def recording(*args, **kwargs):
        if rec.user_called():
            rec.report["reductions"] += 1
        return original(*args, **kwargs)
    return recording


# ------------------------------------------------------------------------------------------------- samplers and loaders
@patches("torch.utils.data.distributed:DistributedSampler.__iter__")
def sampler_order(rec, original):
    def recording(sampler):
        order = list(original(sampler))
        entry = rec.report["samplers"].setdefault(rec.key(rec.sampler_keys, sampler), {
            "shuffle": bool(sampler.shuffle), "orders": [], "epochs": 0, "set_epoch_calls": 0, "iterations": [],
            "where": []})
        entry["epochs"] += 1
        entry["set_epoch_calls"] = getattr(sampler, "_check_ddp_set_epoch_calls", 0)
        if len(entry["orders"]) < KEEP_EPOCHS:
            entry["orders"].append(order)
        if len(entry["iterations"]) >= KEEP_ITERATIONS:
            return iter(order)
        # An iteration that reaches its end is an epoch; a peek (next(iter(loader))) is not.
        this = {"epoch": sampler.epoch, "order": hash(tuple(order)), "complete": False, "where": rec.where()}
        entry["iterations"].append(this)

        def watched():
            yield from order
            this["complete"] = True
        return watched()
    return recording


@patches("torch.utils.data.distributed:DistributedSampler.set_epoch")
def set_epoch(rec, original):
    def recording(sampler, epoch):
        sampler._check_ddp_set_epoch_calls = getattr(sampler, "_check_ddp_set_epoch_calls", 0) + 1
        return original(sampler, epoch)
    return recording


@patches("torch.utils.data:DataLoader.__iter__")
def loader_epoch(rec, original):
    def recording(loader):
        it = original(loader)
        key = rec.key(rec.loader_keys, loader)
        entry = rec.report["loaders"].get(key)
        if entry is None:
            entry = rec.report["loaders"][key] = {
                "sampler": type(loader.sampler).__name__, "dataset": fingerprint(loader.dataset), "epochs": [],
                "n_epochs": 0, "trained": False, "where": rec.where(), **sharding(loader)}
        entry["n_epochs"] += 1
        indices = [] if len(entry["epochs"]) < KEEP_EPOCHS else None
        if indices is not None:
            entry["epochs"].append(indices)
        it._check_ddp = (key, indices)
        return it
    return recording


@patches("torch.utils.data.dataloader:_BaseDataLoaderIter._next_index")
def loader_indices(rec, original):
    def recording(it):
        index = original(it)
        _, indices = getattr(it, "_check_ddp", (None, None))
        if indices is not None:
            indices.extend(index if isinstance(index, list) else [index])
        return index
    return recording


@patches("torch.utils.data.dataloader:_BaseDataLoaderIter.__next__")
def loader_batch(rec, original):
    def recording(it):
        batch = original(it)
        key, _ = getattr(it, "_check_ddp", (None, None))
        rec.last_loader, rec.batches, rec.reductions_at_batch = key, rec.batches + 1, rec.report["reductions"]
        return batch
    return recording


@patches("torch.utils.data._utils.fetch:_MapDatasetFetcher.fetch")
def batch_fetch(rec, original):  # a random draw while fetching a batch is augmentation
    def recording(fetcher, index):
        if rec.fetches_left <= 0:  # seen (or augmentation would have drawn in the first batches)
            return original(fetcher, index)
        rec.fetches_left -= 1
        before = rng_states()
        data = original(fetcher, index)
        after = rng_states()
        if before != after:  # the states of the generators it drew from, before the draw
            rec.fetches_left = 0
            rec.note_augmentation("/".join(hashlib.sha256(repr(b).encode()).hexdigest()[:16]
                                           for b, a in zip(before, after) if a != b))
        return data
    return recording


# ------------------------------------------------------------------------------------------------ DDP and the optimizer
@patches("torch.nn.parallel:DistributedDataParallel.__init__")
def ddp_wrap(rec, original):
    def recording(ddp, module, *args, **kwargs):
        original(ddp, module, *args, **kwargs)
        rec.ddp_models.append(ddp)
        rec.report["ddp"].append({"where": rec.where(), "parameters": sum(1 for _ in module.parameters())})
    return recording


@patches("torch.nn.parallel:DistributedDataParallel.forward")
def ddp_forward(rec, original):
    import torch

    def recording(ddp, *args, **kwargs):
        if torch.is_grad_enabled() and ddp.training:
            rec.report["train_forwards"] += 1
        if torch.is_grad_enabled() and ddp.training and ddp.require_backward_grad_sync:
            rec.forwards_since_step += 1
            if rec.report["forward_where"] is None:
                rec.report["forward_where"] = rec.where()
        return original(ddp, *args, **kwargs)
    return recording


@patches("torch.optim.optimizer:Optimizer.__init__")
def optimizer_made(rec, original):
    def recording(optimizer, *args, **kwargs):
        original(optimizer, *args, **kwargs)
        rec.optimizers[id(optimizer)] = {"where": rec.where(), "object": optimizer, "index": None}
    return recording


# --------------------------------------------------------------------------------------------------- files and printing
@patches("torch:save")
def save(rec, original):
    def recording(obj, f, *args, **kwargs):
        rec.note_write(f, "w")
        if wrapper_keys(obj):
            rec.report["wrapper_saves"].append({"path": path_of(f), "where": rec.where()})
        return original(obj, f, *args, **kwargs)
    return recording


@patches("builtins:open", "io:open")  # pathlib's write_text goes through io.open
def file_open(rec, original):
    def recording(file, mode="r", *args, **kwargs):
        rec.note_write(file, mode)
        return original(file, mode, *args, **kwargs)
    return recording


@patches("builtins:print")
def metric_print(rec, original):
    def recording(*args, **kwargs):
        report = rec.report
        if kwargs.get("file") in (None, sys.stdout, sys.stderr) and len(report["metric_lines"]) < KEEP_LINES:
            text = " ".join(str(a) for a in args)
            if METRIC.search(text):  # from a shard of the data (the last batch was), not reduced since?
                loader = report["loaders"].get(rec.last_loader) or {}
                report["metric_lines"].append({
                    "text": text[:200], "where": rec.where(), "sharded": bool(loader.get("distributed")),
                    "reduced_since_batch": report["reductions"] > rec.reductions_at_batch})
        return original(*args, **kwargs)
    return recording


# ------------------------------------------------------------------------------------------------------- what they note
def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def path_of(f) -> str | None:
    return os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else None


def sharding(loader) -> dict:
    """A DistributedSampler's rank and world size, and how many samples it repeats to even out the ranks."""
    from torch.utils.data.distributed import DistributedSampler
    s = next((s for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None))
              if isinstance(s, DistributedSampler)), None)
    if s is None:
        return {"distributed": False, "padding": 0}
    return {"distributed": True, "padding": max(0, s.total_size - len(s.dataset)), "sampler_rank": s.rank,
            "num_replicas": s.num_replicas}


def fingerprint(dataset) -> list:
    """What tells the ranks' datasets apart without reading a sample (which could draw random numbers)."""
    from torch.utils.data import Subset
    try:
        size = len(dataset)
    except TypeError:
        size = None
    if isinstance(dataset, Subset):
        indices = list(dataset.indices)
        return ["Subset", size, hashlib.sha256(repr(indices).encode()).hexdigest()[:16], fingerprint(dataset.dataset)]
    tensors = getattr(dataset, "tensors", None)
    if tensors is None and hasattr(dataset, "data") and hasattr(dataset.data, "__len__"):
        tensors = (dataset.data,)
    digested = None
    try:
        import torch
        if tensors is not None:
            tensors = [torch.as_tensor(t) for t in tensors]
            digested = digest([t[:: max(1, len(t) // 64)] for t in tensors])
    except Exception:  # noqa: BLE001 - a dataset we cannot read cheaply is told apart by type and size only
        digested = None
    return [type(dataset).__name__, size, digested]


def rng_states() -> tuple:
    """The global generators' states (torch, random, numpy if imported), compared raw: hashed only on a draw."""
    import random

    import torch
    states = [torch.random.get_rng_state().numpy().tobytes(), random.getstate()]
    if "numpy" in sys.modules:
        state = sys.modules["numpy"].random.get_state()
        states.append((state[1].tobytes(), state[2]))
    return tuple(states)


def wrapper_keys(obj, depth: int = 0) -> bool:
    """A state_dict of the DDP wrapper (every key starts with 'module.'), or a dict holding one."""
    if not isinstance(obj, dict) or not obj or depth > 2:
        return False
    if all(isinstance(k, str) and k.startswith("module.") for k in obj):
        return True
    return any(wrapper_keys(v, depth + 1) for v in obj.values())

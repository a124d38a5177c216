"""Checkpoints of sharded training, written by every rank (09_sharded_training).

With FSDP or ZeRO no rank holds the whole model and optimizer, so no rank can write them alone (core.checkpoint's
rank-0 file). Each rank writes its own shards in parallel instead:

- FSDP: `torch.distributed.checkpoint` (DCP). The files say which slice of which tensor each holds, so a checkpoint
  written by N ranks loads at any world size, even into one plain, unsharded model in a process without a group.
- DeepSpeed: the engine's own `save_checkpoint`/`load_checkpoint` (one file of model states, one of optimizer
  state per rank). It resumes at the world size that wrote it; `zero_to_fp32.py`, written beside it, rebuilds
  the full fp32 weights at any size.

Both live in out/checkpoint/ and hold the same State (epoch, step, history) as core.checkpoint. In core, not beside
one trainer: train_fsdp and train_deepspeed both use it, and lessons.sharded reads what both wrote.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil

import torch
import torch.distributed as dist

from .checkpoint import State, agree_on_resume, starting_fresh
from .config import ConfigError, TrainConfig, first_line


def checkpoint_dir(cfg: TrainConfig) -> str:
    """out/checkpoint for `--resume` (auto) and for saving; a path given to --resume otherwise."""
    if cfg.resume and cfg.resume != "auto":
        return cfg.resume
    return os.path.join(cfg.out, "checkpoint") if cfg.out else ""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


# ------------------------------------------------------------------------------------------------------------- DCP
def save_dcp(cfg: TrainConfig, model, optimizer, state: State) -> None:
    """Every rank writes its shards of the model and optimizer into out/checkpoint/ (call it on all ranks).
    Written beside the old checkpoint and renamed over it, so a crash mid-write leaves the old one readable."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_state_dict
    if not cfg.out:
        return
    path = os.path.join(cfg.out, "checkpoint")
    model_state, optimizer_state = get_state_dict(model, optimizer)  # parameter names, not wrapper internals
    if _is_main():
        shutil.rmtree(path + ".tmp", ignore_errors=True)
    _barrier()
    save({"model": model_state, "optimizer": optimizer_state, "state": json.dumps(dataclasses.asdict(state))},
         checkpoint_id=path + ".tmp")
    if _is_main():  # every rank has written (save ends with a collective): swap the directories
        if os.path.isdir(path):
            os.replace(path, path + ".old")
        os.replace(path + ".tmp", path)
        shutil.rmtree(path + ".old", ignore_errors=True)
    _barrier()


def resume_dcp(cfg: TrainConfig, model, optimizer) -> State:
    """Load a DCP checkpoint into a (sharded or plain) model and its optimizer, at any world size; a fresh State
    when not resuming. Every rank reads only the slices its shards need."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    path = _existing(cfg, "DCP", marker=".metadata")
    if not path:
        return State()
    model_state, optimizer_state = get_state_dict(model, optimizer)  # the layout to fill: this run's shards
    loaded = {"model": model_state, "optimizer": optimizer_state, "state": ""}
    try:
        load(loaded, checkpoint_id=path)
    except Exception as exc:  # noqa: BLE001 - another model, missing or truncated files: one line for a person
        raise ConfigError(f"checkpoint {path!r} does not fit this model and optimizer: {first_line(exc) or type(exc).__name__}") from None
    set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    return State(**json.loads(loaded["state"]))


# ------------------------------------------------------------------------------------------------------- DeepSpeed
def save_deepspeed(cfg: TrainConfig, engine, state: State) -> None:
    """The engine writes out/checkpoint/<tag>/ (every rank its optimizer partition), then the file `latest` naming
    the tag; the previous tag is removed after that, so `latest` always names a complete checkpoint."""
    if not cfg.out:
        return
    path = os.path.join(cfg.out, "checkpoint")
    previous = _latest_tag(path)
    tag = f"step{state.step}"
    engine.save_checkpoint(path, tag=tag, client_state=dataclasses.asdict(state))
    _barrier()
    if _is_main() and previous and previous != tag:
        shutil.rmtree(os.path.join(path, previous), ignore_errors=True)


def resume_deepspeed(cfg: TrainConfig, engine) -> State:
    """Load the engine's checkpoint (weights, optimizer partitions, loss scale) on every rank."""
    path = _existing(cfg, "DeepSpeed", marker="latest")
    if not path:
        return State()
    with open(os.path.join(path, "latest")) as f:
        tag = f.read().strip()
    try:  # the rank count that wrote it, read before the engine meets partitions that do not fit
        states = sorted(glob.glob(os.path.join(path, tag, "*model_states.pt")))  # ZeRO-3 writes one per rank
        saved = torch.load(states[0], map_location="cpu", weights_only=False).get("dp_world_size")
    except (IndexError, OSError, RuntimeError, EOFError) as exc:
        raise ConfigError(f"checkpoint {path!r} cannot be read: {first_line(exc) or type(exc).__name__}") from None
    here = dist.get_world_size() if dist.is_initialized() else 1
    if saved and saved != here:
        raise ConfigError(f"checkpoint {path!r} was written by {saved} ranks and DeepSpeed resumes its optimizer "
                          f"partitions at the same world size; run with {saved} processes, or rebuild the fp32 "
                          f"weights with {path}/zero_to_fp32.py")
    _, client = engine.load_checkpoint(path, tag=tag)
    return State(client["epoch"], client["step"], client["history"], client.get("batch", 0))


# --------------------------------------------------------------------------------------------------------- helpers
def _existing(cfg: TrainConfig, kind: str, marker: str) -> str:
    """The checkpoint directory to resume from, or "" to start fresh (resume=auto before the first save)."""
    path = checkpoint_dir(cfg) if cfg.resume else ""
    if not path:
        return ""
    marked = os.path.join(path, marker)  # written last: it names a complete checkpoint
    agree_on_resume(marked)
    if not os.path.exists(marked):
        if cfg.resume == "auto" and not os.path.exists(path):
            starting_fresh(path)
            return ""
        what = "a file" if os.path.isfile(path) else "a directory without " + marker
        raise ConfigError(f"resume checkpoint {path!r} is not a {kind} checkpoint ({what}); the sharded "
                          f"trainers resume from the directory they write, out/checkpoint")
    return path


def _latest_tag(path: str) -> str:
    try:
        with open(os.path.join(path, "latest")) as f:
            return f.read().strip()
    except OSError:
        return ""

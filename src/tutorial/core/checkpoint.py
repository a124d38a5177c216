"""Checkpoints: written by rank 0 only, atomically; read by every rank (03_distributed_data_parallel).

A checkpoint holds the unwrapped model (no "module." prefixes), so a run saved by DDP resumes in one process, under
Horovod or with another world size.
"""
from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass, field

import torch

from .config import ConfigError, TrainConfig
from .models import unwrap


@dataclass
class State:
    epoch: int = 0          # epochs completed
    step: int = 0           # optimizer steps taken
    history: list = field(default_factory=list)  # per-epoch metrics so far


def save(cfg: TrainConfig, model, optimizer, scaler, state: State) -> None:
    """Write out/checkpoint.pt. Call it on rank 0 only. A crash mid-write never leaves a truncated checkpoint:
    the file is written beside the old one and renamed over it."""
    if not cfg.out:
        return
    path = os.path.join(cfg.out, "checkpoint.pt")
    tmp = path + ".tmp"
    torch.save({
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": state.epoch,
        "step": state.step,
        "history": state.history,
        "config": cfg.to_dict(),
    }, tmp)
    os.replace(tmp, path)


def resume(cfg: TrainConfig, model, optimizer, scaler, device: torch.device) -> State:
    """Load cfg.resume_path into model, optimizer and scaler on every rank; a fresh State when not resuming."""
    path = cfg.resume_path
    if not path:
        return State()
    if not os.path.isfile(path):
        if cfg.resume == "auto":
            return State()  # nothing to resume yet: the first run of a resumable job
        raise ConfigError(f"resume checkpoint {path!r} does not exist")
    # map_location: a checkpoint saved on GPU 0 must load onto this rank's device, not pile up on GPU 0.
    # weights_only: a checkpoint holds tensors and plain Python values only, so loading one can never run code.
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; anything else cannot be a checkpoint
        raise ConfigError(f"checkpoint {path!r} cannot be read: not a file written by torch.save "
                          "(truncated, or another kind of file)")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
        keys = ("model", "optimizer", "scaler", "epoch", "step", "history")
        missing = [k for k in keys if k not in ckpt] if isinstance(ckpt, dict) else list(keys)
        if missing:
            raise ValueError(f"not a training checkpoint (no {', '.join(missing)})")
    except Exception as exc:  # noqa: BLE001 - truncated, corrupt or foreign files all mean the same to the user
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"checkpoint {path!r} cannot be read: {reason}") from None
    try:
        unwrap(model).load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0][:160]
        raise ConfigError(f"checkpoint {path!r} does not fit this model and optimizer "
                          f"(saved with model {ckpt.get('config', {}).get('model')!r}): {first}") from None
    if ckpt["scaler"]:  # empty when the run that saved it had no loss scaling (fp32, bf16)
        scaler.load_state_dict(ckpt["scaler"])
    return State(ckpt["epoch"], ckpt["step"], ckpt["history"])

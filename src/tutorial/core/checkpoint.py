"""Checkpoints: written by rank 0 only, atomically; read by every rank (03b_ddp_trainer).

A checkpoint holds the unwrapped model (no "module." prefixes), so a run saved by DDP resumes in one process, under
Horovod or with another world size.
"""
from __future__ import annotations

import hashlib
import os
import zipfile
from dataclasses import dataclass, field

import torch

from . import accelerator
from .config import ConfigError, TrainConfig, first_line
from .distributed import current_rank, gather_over_ranks
from .models import unwrap
from .process import Stopped
from .tracking import Agreement


@dataclass
class State:
    """What a checkpoint saves of the run's progress (what only the running loop needs lives on core.loop.Loop)."""
    epoch: int = 0          # epochs completed
    step: int = 0           # optimizer steps taken
    history: list = field(default_factory=list)  # per-epoch metrics so far
    batch: int = 0          # batches of epoch `epoch` trained before a SIGTERM stopped the run (0: between epochs)


def stop_requested(agreed: Agreement | None) -> bool:
    """After an optimizer step: True on every rank at the same step once any rank got SIGTERM (a walltime kill).
    `agreed` is what RunLog.step returned for this step: the ranks compare their flags at logged steps only (in
    the one all-reduce that also checks the loss), so they act within log_every steps and never stop at different
    steps, which would leave one waiting in a collective. None (a step that was not logged) is never a stop."""
    return agreed is not None and agreed.sigterm


def stop_exception(state: State, out: str) -> Stopped:
    """The exception a trainer raises once a SIGTERM stop is saved: where it stopped and how to go on (exit 143)."""
    where = f"epoch {state.epoch} at batch {state.batch}" if state.batch else f"the end of epoch {state.epoch - 1}"
    return Stopped(f"SIGTERM: saved {where} (step {state.step}) in {out}; "
                   "run the same command with --resume to go on from there")


def take_resume_offset(state: State) -> int:
    """The batches of this epoch that a run stopped by SIGTERM trained before it stopped, for the resumed run to
    skip (the loader yields the same order again: the shuffle depends on the seed and the epoch only); state.batch
    is 0 afterwards, since from there on the epoch is trained as usual. 0 when not resuming mid-epoch."""
    skip, state.batch = state.batch, 0
    return skip


def save(cfg: TrainConfig, model, optimizer, scaler, state: State) -> None:
    """Write out/checkpoint.pt. Call it on rank 0 only. A crash mid-write never leaves a truncated checkpoint:
    the file is written beside the old one and renamed over it."""
    gpu = accelerator.device_module()  # torch.cuda or torch.xpu: the GPU's random stream is saved beside the CPU's
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
        "batch": state.batch,
        # Rank 0's RNG, so that a resumed one-process run draws what the uninterrupted one would (dropout, random
        # crops in the main process). Not restored: other ranks' streams (each rank draws its own augmentation) and
        # loader workers' (seeded anew when the resumed run starts them), so with random augmentation a resumed run
        # is a correct continuation, not a bitwise copy of the uninterrupted one.
        "rng": {"cpu": torch.get_rng_state(),
                # the GPU's stream under "cuda" whatever the vendor, with the device type it belongs to
                "cuda": gpu.get_rng_state() if gpu is not None and gpu.is_initialized() else None,
                "gpu_type": accelerator.gpu_type() if gpu is not None else None},
        "config": cfg.to_dict(),
    }, tmp)
    os.replace(tmp, path)


def starting_fresh(path: str) -> State:
    """--resume found nothing to resume: say so (rank 0, one line), since a mistyped --out would otherwise throw the
    run being resumed away without a word; then start from scratch, as a resumable job's first run does."""
    if current_rank() == 0:
        print(f"resume: no checkpoint at {path}; starting from scratch", flush=True)
    return State()


def agree_on_resume(path: str) -> None:
    """With --resume every rank reads `path` from its own view of the file system. Where out/ is on node-local disks,
    one rank may resume while another starts fresh, or two load different checkpoints: replicas that silently
    differ. So the ranks compare what they found there, its size and content digest (one small all-gather), and all
    stop together when they disagree."""
    found = "no checkpoint"
    if os.path.isfile(path):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        found = f"a checkpoint of {os.path.getsize(path)} bytes, sha256 {digest.hexdigest()[:12]}"
    seen = gather_over_ranks(found)
    if len(set(seen)) > 1:
        ranks: dict[str, list[str]] = {}
        for rank, what in enumerate(seen):
            ranks.setdefault(what, []).append(str(rank))
        said = "; ".join(f"rank{'s' * (len(r) > 1)} {', '.join(r)}: {what}" for what, r in ranks.items())
        raise ConfigError(f"--resume: the ranks found different things at {path} ({said}); every rank must resume "
                          f"from the same checkpoint: put --out on a file system that all nodes share")


def resume(cfg: TrainConfig, model, optimizer, scaler, device: torch.device) -> State:
    """Load cfg.resume_path into model, optimizer and scaler on every rank; a fresh State when not resuming."""
    path = cfg.resume_path
    if not path:
        return State()
    agree_on_resume(path)
    if not os.path.isfile(path):
        if cfg.resume == "auto":
            return starting_fresh(path)
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
        reason = first_line(exc) or type(exc).__name__
        raise ConfigError(f"checkpoint {path!r} cannot be read: {reason}") from None
    try:
        unwrap(model).load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        first = first_line(exc)
        raise ConfigError(f"checkpoint {path!r} does not fit this model and optimizer "
                          f"(saved with model {ckpt.get('config', {}).get('model')!r}): {first}") from None
    if ckpt["scaler"]:  # empty when the run that saved it had no loss scaling (fp32, bf16)
        scaler.load_state_dict(ckpt["scaler"])
    rng = ckpt.get("rng") or {}
    if current_rank() != 0:  # the other ranks keep their own streams (the saved one is rank 0's)
        rng = {}
    if rng.get("cpu") is not None:
        torch.set_rng_state(rng["cpu"].cpu())
    if rng.get("cuda") is not None and device.type == rng.get("gpu_type", "cuda"):  # the same kind of GPU
        getattr(torch, device.type).set_rng_state(rng["cuda"].cpu(), device)
    return State(ckpt["epoch"], ckpt["step"], ckpt["history"], ckpt.get("batch", 0))

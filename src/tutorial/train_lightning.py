"""Stage 8: PyTorch Lightning, the same training with the loop written for us (08_lightning).

The model, data, optimizer and schedule are the other trainers' (same TrainConfig, same core);
Lightning's Trainer runs the loop and does what train_ddp.py spells out: the DistributedSampler and
set_epoch, the DDP wrapper, metric averaging, rank-0 checkpoints and logging, precision, clipping,
accumulation; also early stopping and profiling (seed 000). Launch it with any of:

    torchrun --standalone --nproc_per_node 2 -m tutorial.train_lightning --preset smoke
    mpirun -np 2 python -m tutorial.train_lightning --preset smoke    (also mpiexec/PALS, srun;
                                              seed 000's horovodrun -np 8 -H node1:4,node2:4)
    tutorial.launch.engines.start(n=2).run(tutorial.train_lightning.main, cfg)  (from a notebook)
"""
from __future__ import annotations

import math
import os

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.optim.lr_scheduler import LambdaLR

from .core import checkpoint, tracking
from .core.lightning_glue import LaunchedDDP, RunRecord, WorldEnvironment, quiet_lightning
from .core.metrics import top5_correct
from .core.config import TrainConfig, parse_args
from .core.data import build_datasets, make_loader
from .core.distributed import (init_process_group, pick_device, replica_checksums, teardown,
                               world_from_env)
from .core.models import build_model
from .core.optim import build_optimizer, lr_at, micro_batch_weight, scaled_lr
from .core.process import run_main

STAGE = "lightning"  # its options (parse_args)
PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}  # ours -> Lightning's


class Classifier(L.LightningModule):
    """What is left of train_one_epoch and evaluate: a batch's loss, the metrics, the optimizer."""

    def __init__(self, cfg: TrainConfig, info, peak_lr: float, steps_per_epoch: int):
        super().__init__()
        self.cfg, self.peak_lr, self.steps_per_epoch = cfg, peak_lr, steps_per_epoch
        self.model = build_model(cfg.model, info)
        if cfg.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)

    def forward(self, X):
        if self.cfg.channels_last:
            X = X.contiguous(memory_format=torch.channels_last)
        return self.model(X)

    def training_step(self, batch, batch_idx):
        X, y = batch  # already on this rank's device, from this rank's shard
        loss = F.cross_entropy(self(X), y)
        # the epoch's mean over all ranks
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        # Lightning divides what we return by accumulate_grad_batches, which under-weights an
        # epoch's last, shorter accumulation group; this makes each micro-batch count by its share
        # of its group's samples instead.
        loader, accumulation = self.trainer.train_dataloader, self.cfg.grad_accum
        weight = micro_batch_weight(loader, batch_idx, len(y), accumulation)
        return loss * weight * accumulation  # Lightning calls backward, steps, zeroes the gradients

    def on_validation_epoch_start(self):
        # loss sum, correct, correct in the top 5, count
        self.test_sums = torch.zeros(4, device=self.device)

    def validation_step(self, batch, batch_idx):
        X, y = batch
        logits = self(X)
        self.test_sums += torch.stack([F.cross_entropy(logits.float(), y, reduction="sum"),
                                       (logits.argmax(1) == y).sum(), top5_correct(logits, y),
                                       torch.tensor(len(y), device=self.device)])

    def on_validation_epoch_end(self):
        # Sums over all ranks, as train_ddp's evaluate: self.log(..., sync_dist=True) of each
        # batch's mean would average the ranks' means, which is not the mean over the test set when
        # the shards differ in size (180 and 179).
        sums = self.trainer.strategy.reduce(self.test_sums, reduce_op="sum")
        loss_sum, correct, correct5, count = sums.tolist()
        if count:  # a subclass's own validation_step (08's exercise 2) logs its metrics itself
            # equal on every rank already
            self.log_dict({"test_loss": loss_sum / count, "test_accuracy": correct / count,
                           "test_top5_accuracy": correct5 / count}, sync_dist=True)

    def configure_optimizers(self):
        optimizer = build_optimizer(self.model, self.cfg, self.peak_lr)
        # The same warm-up and cosine curve as the other trainers (a function of epochs), stepped
        # every step.
        def factor(step: int) -> float:
            return lr_at(self.cfg, step / self.steps_per_epoch, self.peak_lr) / self.peak_lr

        schedule = LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def setup(cfg: TrainConfig):
    """Who we are, the device, the process group and the seed; bad options fail here, before any
    work."""
    world = world_from_env()
    device = pick_device(world.local_rank, world.local_world_size)
    cfg.check_stage(STAGE, device)  # options only other trainers read are refused, not ignored
    tracking.prepare_output(cfg)
    # bounded by cfg.timeout; Lightning adopts the group
    created = init_process_group(world, device, cfg.timeout, cfg.backend)
    # also the seed of the DistributedSampler Lightning puts in
    L.seed_everything(cfg.seed, verbose=False)
    return device, world, created


def devices_per_node(world, device: torch.device) -> int:
    """The ranks on this node, or fewer where each rank sees only its own GPU (a launcher's
    binding)."""
    if device.type != "cpu":
        return min(world.local_world_size, torch.accelerator.device_count())
    return world.local_world_size


def build(cfg: TrainConfig, device: torch.device, world):
    """Data, the LightningModule (model and optimizer) and the Trainer."""
    train_set, test_set, info = build_datasets(cfg)
    # A plain training loader: Lightning swaps in a DistributedSampler (shuffled, set_epoch every
    # epoch). For the test set it would pad too (359 digits to 360, one counted twice); a sampler
    # that splits it exactly, which Lightning keeps, makes the test metrics those of the other
    # trainers.
    shuffled = torch.utils.data.RandomSampler(train_set)
    train_loader = make_loader(train_set, cfg, device, sampler=shuffled)
    exact = UnrepeatedDistributedSampler(test_set, world.world_size, world.rank, shuffle=False)
    test_loader = make_loader(test_set, cfg, device, sampler=exact)
    per_rank = math.ceil(len(train_set) / world.world_size)
    steps_per_epoch = math.ceil(per_rank / cfg.batch_size / cfg.grad_accum)
    module = Classifier(cfg, info, scaled_lr(cfg, world.world_size), steps_per_epoch)
    # each rank its own random crops and flips; the weights were shared
    torch.manual_seed(cfg.seed + world.rank)
    log = tracking.RunLog(cfg, "lightning-ddp", device, world.rank, world.world_size)
    callbacks = [RunRecord(log, world.world_size)]
    if cfg.out:  # rank 0 writes out/checkpoint.ckpt after every epoch: weights, optimizer, loops
        callbacks.append(ModelCheckpoint(dirpath=cfg.out, filename="checkpoint",
                                         enable_version_counter=False))
    if cfg.patience:  # seed 000: stop when the test loss has not improved for `patience` epochs
        callbacks.append(EarlyStopping(monitor="test_loss", mode="min", patience=cfg.patience))
    if cfg.target_accuracy:
        callbacks.append(EarlyStopping(monitor="test_accuracy", mode="max",
                                       stopping_threshold=cfg.target_accuracy, patience=cfg.epochs))
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=devices_per_node(world, device),
        num_nodes=world.world_size // world.local_world_size,
        strategy=LaunchedDDP(cluster_environment=WorldEnvironment(world)),
        precision=PRECISION[cfg.precision], max_epochs=cfg.epochs, max_steps=cfg.max_steps or -1,
        accumulate_grad_batches=cfg.grad_accum, gradient_clip_val=cfg.clip_grad or None,
        sync_batchnorm=cfg.sync_bn, callbacks=callbacks, logger=False, num_sanity_val_steps=0,
        enable_progress_bar=bool(cfg.progress), enable_model_summary=False,
        enable_checkpointing=bool(cfg.out), default_root_dir=cfg.out or None)
    return module, trainer, train_loader, test_loader, log


def resume_path(cfg: TrainConfig) -> str | None:
    """Lightning's checkpoint to continue from: out/checkpoint.ckpt for --resume (auto), once it
    exists."""
    auto = cfg.resume == "auto"
    path = os.path.join(cfg.out, "checkpoint.ckpt") if auto and cfg.out else cfg.resume
    if path:  # every rank must find the same file (node-local disks would let them differ)
        checkpoint.agree_on_resume(path)
    if auto and not os.path.isfile(path or ""):
        checkpoint.starting_fresh(path or "(no --out)")
        return None
    return path or None


def main(cfg: TrainConfig, build=build) -> dict:
    """Train cfg; returns the run's metrics (also in cfg.out/metrics.json). build is a hook for
    lessons, as in the other trainers: a function with build's arguments and results."""
    device, world, created = setup(cfg)
    try:
        with quiet_lightning():  # Lightning's advice that does not apply here, hidden while it runs
            module, trainer, train_loader, test_loader, log = build(cfg, device, world)
            # torch.compile of the whole LightningModule: Lightning compiles its forward.
            trainer.fit(torch.compile(module) if cfg.compile else module, train_loader, test_loader,
                        ckpt_path=resume_path(cfg))
            record = next(c for c in trainer.callbacks if isinstance(c, RunRecord))
            # --max-steps ended an epoch before Lightning's evaluation
            if getattr(record, "pending", None):
                trainer.validate(module, test_loader, verbose=False)
                record.record_epoch(trainer)
        # every rank's parameter digest, to prove the replicas agree
        digests = replica_checksums(module.model)
        return log.finish(steps=trainer.global_step, replica_checksums=digests,
                          replicas_identical=len(set(digests)) == 1,
                          stopped_early=trainer.should_stop)
    finally:
        teardown(created)


if __name__ == "__main__":
    run_main(main, parse_args("Train with PyTorch Lightning (DDP), one process per GPU.",
                              stage=STAGE))

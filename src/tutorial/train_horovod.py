"""Stage 5: Horovod, one process per GPU (notebook 05_horovod; seed 002's eight steps).

train_single.py plus the lines tagged "# Horovod:". Launch it with any of:

    horovodrun -np 2 -H localhost:2 python -m tutorial.train_horovod --preset smoke --out runs/hvd   (--gloo or --mpi)
    mpirun -np 2 python -m tutorial.train_horovod --preset smoke
    horovod.run(tutorial.train_horovod.main, args=(cfg,), np=2)
    tutorial.launch.engines.start(n=2, engines="mpi").run(tutorial.train_horovod.main, cfg)

Horovod is left initialised when main returns, so a notebook can run it again on the same engines (its shutdown
runs at process exit; after an MPI_Finalize it could not start again).
"""
from __future__ import annotations

import time

import horovod.torch as hvd  # Horovod
import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler  # Horovod: step 6, shard the data

from .core import checkpoint, tracking
from .core.config import TrainConfig, parse_args
from .core.data import build_datasets, make_loader, shard  # Horovod: shard
from .core.distributed import pick_device  # Horovod
from .core.metrics import patience_exhausted, top5_correct
from .core.models import build_model, checksum, convert_batchnorm  # Horovod: convert_batchnorm
from .core.optim import (build_optimizer, epoch_progress, lr_at, micro_batch_weight, scaled_lr,  # Horovod: scaled_lr
                         set_lr)
from .core.precision import Precision
from .core.process import run_main


def setup(cfg: TrainConfig):
    """The device, the precision policy and the seed; bad options fail here, before any work."""
    hvd.init()  # Horovod: step 1, start the background thread that negotiates and runs collectives
    device = pick_device(hvd.local_rank(), hvd.local_size())  # Horovod: step 2, pin one GPU per process by local rank
    amp = Precision(cfg.precision, device)
    cfg.check_stage("horovod", device)  # Horovod: --backend and --timeout are refused here (horovodrun has its own)
    tracking.prepare_output(cfg)
    torch.manual_seed(cfg.seed)
    return device, amp


def build(cfg: TrainConfig, device: torch.device):
    """Data, model and optimizer."""
    train_set, test_set, info = build_datasets(cfg)
    # Horovod: each rank reads its own 1/size of a shuffled order; set_epoch(epoch) reshuffles it every epoch.
    sampler = DistributedSampler(train_set, hvd.size(), hvd.rank(), shuffle=True, seed=cfg.seed)
    # Horovod: loader workers come from a fork server. Forking this process, which runs MPI and Horovod's
    # background thread, can leave a worker deadlocked on a lock it inherited (seen in the workshop-cpu lane: rank
    # 1's first test batch never came); Horovod's own PyTorch examples do the same.
    train_loader = make_loader(train_set, cfg, device, sampler=sampler, start_method="forkserver")  # Horovod
    test_loader = make_loader(shard(test_set, hvd.rank(), hvd.size()), cfg, device,  # Horovod: exact shards
                              start_method="forkserver")  # Horovod
    model = build_model(cfg.model, info).to(device)
    if cfg.sync_bn:  # Horovod: BatchNorm statistics over the global batch, not each rank's slice
        model = convert_batchnorm(model, hvd.SyncBatchNorm)  # Horovod
    # Horovod: --channels-last converts the inputs only; 0.28's all-reduce rejects channels_last (NHWC) gradients.
    lr = scaled_lr(cfg, hvd.size())  # Horovod: step 3, scale the lr with the number of workers
    optimizer = build_optimizer(model, cfg, lr)
    compression = hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none  # Horovod: step 4
    optimizer = hvd.DistributedOptimizer(  # Horovod: step 4, all-reduce gradients as backward produces them
        optimizer, named_parameters=model.named_parameters(), compression=compression,
        backward_passes_per_step=cfg.grad_accum)  # Horovod: all-reduce once per accumulated step
    torch.manual_seed(cfg.seed + hvd.rank())  # Horovod: each rank its own random crops and flips (weights: step 5)
    return model, optimizer, train_loader, test_loader, lr


def train_one_epoch(cfg, model, optimizer, amp, loader, device, epoch, peak_lr, state, log):
    model.train()
    loss_sum, samples, start = torch.zeros((), device=device), 0, time.perf_counter()
    for i, (X, y) in enumerate(log.bar(loader, epoch)):
        if checkpoint.trained_before(state, i):  # resumed after a SIGTERM stop: done before it
            continue
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if cfg.channels_last:
            X = X.contiguous(memory_format=torch.channels_last)
        last_micro_batch = (i + 1) % cfg.grad_accum == 0 or i + 1 == len(loader)
        with amp.autocast():
            loss = F.cross_entropy(model(X), y)
        amp.backward(loss * micro_batch_weight(loader, i, len(y), cfg.grad_accum))
        loss_sum += loss.detach() * len(y)
        samples += len(y)
        if last_micro_batch:
            lr = lr_at(cfg, epoch + epoch_progress(loader, i, cfg.grad_accum), peak_lr)
            set_lr(optimizer, lr)
            optimizer.synchronize()  # Horovod: wait for the averaged gradients before unscaling and clipping
            with optimizer.skip_synchronize():  # Horovod: step() must not wait for them a second time
                amp.step(optimizer, model.parameters(), cfg.clip_grad)  # Horovod
            optimizer.zero_grad()
            state.step += 1
            log.step(state.step, loss, lr, amp.loss_scale)
            if checkpoint.stop_requested(state, i, len(loader), cfg.log_every):  # SIGTERM on any rank
                break
            if cfg.max_steps and state.step >= cfg.max_steps:
                break
    seconds = time.perf_counter() - start
    return loss_sum.item() / samples, samples / seconds, seconds


@torch.no_grad()
def evaluate(cfg, model, amp, loader, device):
    """Loss, accuracy and top-5 accuracy over the whole test set."""
    model.eval()
    sums = torch.zeros(4, device=device)  # loss sum, correct, correct in the top 5, count
    for X, y in loader:
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if cfg.channels_last:
            X = X.contiguous(memory_format=torch.channels_last)
        with amp.autocast():
            logits = model(X)
        sums += torch.stack([F.cross_entropy(logits.float(), y, reduction="sum"), (logits.argmax(1) == y).sum(),
                             top5_correct(logits, y), torch.tensor(len(y), device=device)])
    sums = hvd.allreduce(sums, op=hvd.Sum, name="eval_sums")  # Horovod: step 8, sum over all ranks' shards
    loss_sum, correct, correct5, count = sums.tolist()
    return loss_sum / count, correct / count, correct5 / count


def main(cfg: TrainConfig) -> dict:
    device, amp = setup(cfg)
    model, optimizer, train_loader, test_loader, peak_lr = build(cfg, device)
    if cfg.compile:
        model = torch.compile(model)
    log = tracking.RunLog(cfg, "horovod", device, hvd.rank(), hvd.size())  # Horovod: rank 0 prints and writes
    state = checkpoint.resume(cfg, model, optimizer, amp.scaler, device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # Horovod: step 5, start from rank 0's weights
    if state.step:  # Horovod: step 5, and its optimizer state (a fresh optimizer has none to send)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # Horovod
    log.metrics["epochs"] = state.history
    for epoch in range(state.epoch, cfg.epochs):
        train_loader.sampler.set_epoch(epoch)  # Horovod: a new shuffle every epoch, the same on every rank
        train_loss, samples_per_second, seconds = train_one_epoch(
            cfg, model, optimizer, amp, train_loader, device, epoch, peak_lr, state, log)
        if state.batch:  # a SIGTERM stopped this epoch: save where it stopped, then exit (143)
            if hvd.rank() == 0:  # Horovod: step 7, checkpoints from rank 0 only
                checkpoint.save(cfg, model, optimizer, amp.scaler, state)  # Horovod
            raise checkpoint.stopped(state, cfg.out)
        train_loss = hvd.allreduce(torch.tensor(train_loss), name="train_loss").item()  # Horovod: step 8, average
        samples_per_second *= hvd.size()  # Horovod: every rank processes its own samples at the same time
        test_loss, test_accuracy, test_top5 = evaluate(cfg, model, amp, test_loader, device)
        log.epoch(dict(epoch=epoch, train_loss=train_loss, test_loss=test_loss, test_accuracy=test_accuracy,
                       samples_per_second=samples_per_second, epoch_seconds=seconds,
                       lr=optimizer.param_groups[0]["lr"], skipped_steps=amp.skipped_steps), state.step)
        log.metrics["test_top5_accuracy"] = test_top5  # seed 001: the label among the 5 highest scores
        state.epoch = epoch + 1
        if hvd.rank() == 0:  # Horovod: step 7, checkpoints from rank 0 only
            checkpoint.save(cfg, model, optimizer, amp.scaler, state)  # Horovod
        if state.stopping:  # the SIGTERM came at the epoch's last step: saved above, now exit (143)
            raise checkpoint.stopped(state, cfg.out)
        if cfg.max_steps and state.step >= cfg.max_steps:
            break
        if cfg.target_accuracy and test_accuracy >= cfg.target_accuracy:
            log.print(f"target accuracy {cfg.target_accuracy} reached after epoch {epoch}")
            break
        if patience_exhausted(cfg, log.metrics["epochs"]):  # seed 000: stop when the test loss stops improving
            log.print(f"no lower test loss for {cfg.patience} epochs: stopped after epoch {epoch}")
            break
    digests = hvd.allgather_object(checksum(model))  # Horovod: every rank's digest, to prove the replicas agree
    return log.finish(steps=state.step, replica_checksums=digests, replicas_identical=len(set(digests)) == 1)


if __name__ == "__main__":
    run_main(main, parse_args("Train with Horovod, one process per GPU.", stage="horovod"))  # Horovod

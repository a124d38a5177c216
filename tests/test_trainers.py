"""The trainers, launched as people launch them, checked by equivalence rather than by "it ran".

CPU, gloo, 2 processes. The smoke preset (digits, small CNN without BatchNorm) makes DDP and Horovod with 2 ranks x
batch B compute exactly the gradient of one process with batch 2B.
"""
from __future__ import annotations

import re
import threading

import pytest
import torch
from conftest import (horovodrun_cmd, metrics, mpirun_cmd, needs_horovod, needs_mpi, params, run, torchrun_cmd,
                      train_cmd)

from tutorial import train_dp, train_single
from tutorial.core.config import TrainConfig

# K optimizer steps inside the first epoch, constant lr, no lr scaling: the runs below must agree to float noise.
EQUIV = ["--epochs", "1", "--max-steps", "12", "--schedule", "constant", "--lr-scaling", "none", "--lr", "0.05"]


@pytest.fixture(scope="module")
def single_2b(tmp_path_factory):
    out = tmp_path_factory.mktemp("single_2b")
    run(train_cmd("single", *EQUIV, "--batch-size", "32", "--out", out))
    return out


def assert_same_params(a, b, tol=1e-5):
    pa, pb = params(a), params(b)
    assert pa.shape == pb.shape
    assert torch.allclose(pa, pb, rtol=tol, atol=tol), f"max difference {(pa - pb).abs().max():.3g}"
    assert not torch.equal(params(a), torch.zeros_like(pa))


def test_ddp_two_ranks_match_one_process_with_the_global_batch(single_2b, tmp_path):
    run(torchrun_cmd(2, "ddp", *EQUIV, "--batch-size", "16", "--out", tmp_path))
    assert_same_params(single_2b, tmp_path)
    m = metrics(tmp_path)
    assert m["world_size"] == 2 and m["global_batch_size"] == 32 and m["steps"] == 12
    assert m["replicas_identical"] and len(m["replica_checksums"]) == 2


@needs_horovod
def test_horovod_two_ranks_match_one_process_with_the_global_batch(single_2b, tmp_path):
    run(horovodrun_cmd(2, *EQUIV, "--batch-size", "16", "--out", tmp_path))
    assert_same_params(single_2b, tmp_path)
    m = metrics(tmp_path)
    assert m["strategy"] == "horovod" and m["world_size"] == 2 and m["replicas_identical"]


def test_a_different_batch_does_not_match(single_2b, tmp_path):
    """The equivalence check can fail: one process with batch B is a different run."""
    run(train_cmd("single", *EQUIV, "--batch-size", "16", "--out", tmp_path))
    assert not torch.allclose(params(single_2b), params(tmp_path), rtol=1e-5, atol=1e-5)


# DataParallel is not compared with one process here: on a CPU it is the module itself (no replicas, no scatter), so
# such a test compared a computation with itself. Its scatter/replicate/gather is checked by hand in
# test_exercises_02 and notebook 02, and on GPUs by make gpu-check (dp-* checks).


def test_smoke_single_reaches_95_percent(tmp_path):
    run(train_cmd("single", "--preset", "smoke", "--out", tmp_path))
    m = metrics(tmp_path)
    assert m["test_accuracy"] >= 0.95
    assert len(m["epochs"]) == TrainConfig.preset("smoke").epochs
    for key in ("train_loss", "test_loss", "test_accuracy", "samples_per_second", "epoch_seconds"):
        assert key in m["epochs"][-1]
    assert {"world_size", "strategy", "precision", "device", "global_batch_size"} <= m.keys()


def test_smoke_ddp_reaches_95_percent_with_identical_replicas(tmp_path):
    run(torchrun_cmd(2, "ddp", "--preset", "smoke", "--out", tmp_path))
    m = metrics(tmp_path)
    assert m["test_accuracy"] >= 0.95 and m["world_size"] == 2
    assert len(set(m["replica_checksums"])) == 1


@needs_mpi
def test_ddp_under_mpirun(tmp_path):
    run(mpirun_cmd(2, "ddp", "--preset", "smoke", "--out", tmp_path))
    m = metrics(tmp_path)
    assert m["world_size"] == 2 and m["test_accuracy"] >= 0.95 and m["replicas_identical"]


# Horovod under a real mpirun: tests/test_pbs_recipes.py runs the Open MPI recipe as written (2 ranks, >= 95 %,
# identical replicas).


def test_resume_equals_uninterrupted(tmp_path):
    cfg = TrainConfig.preset("smoke", epochs=2)
    whole = train_single.main(cfg.replace(out=str(tmp_path / "whole")))
    steps_per_epoch = whole["steps"] // 2
    first = train_single.main(cfg.replace(out=str(tmp_path / "parts"), max_steps=steps_per_epoch))
    assert len(first["epochs"]) == 1
    resumed = train_single.main(cfg.replace(out=str(tmp_path / "parts"), resume="auto"))
    assert [e["epoch"] for e in resumed["epochs"]] == [0, 1]
    assert resumed["steps"] == whole["steps"]
    assert torch.equal(params(tmp_path / "whole"), params(tmp_path / "parts"))


def test_resume_with_another_world_size(tmp_path):
    run(train_cmd("single", "--preset", "smoke", "--epochs", "4", "--max-steps", "45", "--out", tmp_path))
    assert len(metrics(tmp_path)["epochs"]) == 1
    run(torchrun_cmd(2, "ddp", "--preset", "smoke", "--epochs", "4", "--resume", "--out", tmp_path))
    m = metrics(tmp_path)
    assert [e["epoch"] for e in m["epochs"]] == [0, 1, 2, 3]
    assert m["world_size"] == 2 and m["test_accuracy"] >= 0.95


def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    train_single.main(TrainConfig.preset("smoke", epochs=2, log_every=5, out=str(tmp_path)))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/loss_scale", "epoch/test_accuracy", "epoch/train_loss",
            "epoch/samples_per_second"} <= tags
    assert len(acc.Scalars("epoch/test_accuracy")) == 2
    assert acc.Scalars("epoch/test_accuracy")[-1].value >= 0.9


def test_a_failed_run_stops_its_tensorboard_writer(tmp_path, monkeypatch):
    """A notebook engine runs trainer after trainer: a run that fails (here the loss diverges after a few steps)
    must not leave its TensorBoard writer's thread behind, one more per failed run, and the steps it logged are on
    disk. The control undoes main's close on the error path: the thread outlives the run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tutorial.core import tracking
    cfg = TrainConfig.preset("smoke", lr=100, warmup_epochs=0, log_every=1, quiet=True, out=str(tmp_path / "closed"))
    threads = threading.active_count()
    with pytest.raises(FloatingPointError, match=r"the training loss is nan at step") as failed:
        train_single.main(cfg)
    assert threading.active_count() == threads
    acc = EventAccumulator(str(tmp_path / "closed" / "tb"))
    acc.Reload()
    diverged_at = int(re.search(r"at step (\d+)", str(failed.value))[1])
    assert diverged_at > 2 and len(acc.Scalars("train/loss")) == diverged_at - 1  # every step before it

    kept, close = [], tracking.RunLog.close
    monkeypatch.setattr(tracking.RunLog, "close", lambda log: kept.append(log))
    with pytest.raises(FloatingPointError):
        train_single.main(cfg.replace(out=str(tmp_path / "unclosed")))
    try:
        assert threading.active_count() == threads + 1
    finally:
        close(kept[0])
    assert threading.active_count() == threads


def test_bf16_trains_on_cpu(tmp_path):
    """bf16 is applied (the layers compute in bfloat16) and still learns to the smoke bound."""
    from observe import run_observed
    m = run_observed(train_single.main, TrainConfig.preset("smoke", precision="bf16"))
    assert m["observed"]["dtypes"] == ["bfloat16"] and m["test_accuracy"] >= 0.95


def test_fsdp_bf16_with_batchnorm_runs_on_every_supported_torch(tmp_path):
    """FSDP's bf16 policy on the ResNet (BatchNorm units in fp32, each handing bf16 on). In the floor lane this runs
    on the lent GPU node's torch 2.11, whose output_dtype casts a unit of several modules only where the unit ends:
    there it failed as on the H200 (2026-11-29: "Input type (float) and weight type (bfloat16)") until each norm cast
    its own output."""
    run(torchrun_cmd(1, "fsdp", "--preset", "workshop-cpu", "--precision", "bf16", "--max-steps", "1",
                     "--out", tmp_path))
    assert metrics(tmp_path)["precision"] == "bf16" and metrics(tmp_path)["steps"] == 1


def test_accumulation_in_one_process_matches_the_whole_batch(tmp_path, monkeypatch):
    """Two micro-batches of 16 then a step (clipped) are one step on the batch of 32, under a warm-up and cosine lr:
    the same sample order, the same weighting, the same lr per optimizer step. Negative control: the same run with
    the lr read at the micro-batch's place in the epoch (as it was) parts from it."""
    args = ["--epochs", "1", "--max-steps", "12", "--lr", "0.05", "--warmup-epochs", "0.3", "--clip-grad", "1.0"]
    accum = [*args, "--batch-size", "16", "--grad-accum", "2"]
    run(train_cmd("single", *args, "--batch-size", "32", "--out", tmp_path / "whole"))
    run(train_cmd("single", *accum, "--out", tmp_path / "accum"))
    assert metrics(tmp_path / "accum")["global_batch_size"] == 32 and metrics(tmp_path / "accum")["steps"] == 12
    assert_same_params(tmp_path / "whole", tmp_path / "accum")
    from tutorial.core import optim
    loader = range(45)  # 45 micro-batches: 23 optimizer steps
    assert [optim.epoch_progress(loader, i, 2) for i in (0, 1, 2, 44)] == [0.0, 0.0, 1 / 23, 22 / 23]

    from tutorial.core.config import parse_args
    old_way = parse_args(argv=[*accum, "--out", str(tmp_path / "old_way")])  # the accum run's config, in process
    monkeypatch.setattr(train_single, "epoch_progress", lambda loader, i, grad_accum: i / len(loader))
    train_single.main(old_way)
    assert metrics(tmp_path / "old_way")["config"] == {**metrics(tmp_path / "accum")["config"], "out": old_way.out}
    difference = (params(tmp_path / "whole") - params(tmp_path / "old_way")).abs().max().item()
    print(f"accumulation with the lr read per micro-batch: {difference:.3g} from the whole batch")
    assert difference > 100 * 1e-5  # assert_same_params's tolerance


def test_target_accuracy_stops_early():
    m = train_single.main(TrainConfig.preset("smoke", epochs=10, target_accuracy=0.9))
    assert len(m["epochs"]) < 10 and m["test_accuracy"] >= 0.9


def test_quiet_prints_one_line_with_where_the_run_ended(capsys):
    """--quiet (a run a notebook repeats): no header and no epoch lines, one line at the end with the last epoch."""
    loud = train_single.main(TrainConfig.preset("smoke", epochs=2, max_steps=50))
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("single: world size 1") and sum(line.startswith("epoch ") for line in printed) == 2
    quiet = train_single.main(TrainConfig.preset("smoke", epochs=2, max_steps=50, quiet=True))
    [line] = capsys.readouterr().out.splitlines()
    last = quiet["epochs"][-1]
    assert line.startswith(printed[0] + "; after epoch 1: ") and f"test loss {last['test_loss']:.4f}" in line
    assert quiet["test_loss"] == loud["test_loss"]  # quiet changes what is printed, nothing else


def _syncs(monkeypatch) -> list:
    """Every Tensor.item() from now on: each one makes the host wait for the device (on a GPU)."""
    seen, item = [], torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: seen.append(1) or item(self))
    return seen


def test_an_fp16_step_adds_no_host_sync_and_still_counts_skipped_steps(monkeypatch):
    """fp16's dynamic loss scaling, with torch's GradScaler for the CPU standing in for the GPU's (the same
    arithmetic; Precision itself refuses fp16 on a CPU). GradScaler.step decides whether to step with one .item() of
    its own; Precision.step adds none (before: two get_scale() calls per step, each a .item(), three syncs in all),
    and the step whose gradients overflow is still counted, read once (skipped_steps)."""
    from tutorial.core.precision import Precision
    precision = Precision("fp32", torch.device("cpu"))
    precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    X = torch.ones(2, 4)
    syncs = _syncs(monkeypatch)
    for overflow in (False, True, False, False):
        optimizer.zero_grad()
        precision.backward(model(X).sum() * (float("inf") if overflow else 1.0))
        precision.step(optimizer, model.parameters())
    assert len(syncs) == 4  # GradScaler.step's own, one per step
    assert precision.skipped_steps == 1 and precision.loss_scale == 2.0 ** 15


def test_the_loss_scale_is_read_at_log_steps_only(tmp_path):
    """RunLog.step gets the trainer's Precision and reads its loss scale (a sync under fp16) every log_every steps
    only, as it reads the loss (before, every trainer evaluated precision.loss_scale for every step's call). The
    control logs every step and must read it every step."""
    from tutorial.core import tracking

    class Scaler:
        reads = 0

        @property
        def loss_scale(self):
            Scaler.reads += 1
            return 1024.0

    def reads(log_every: int) -> int:
        Scaler.reads = 0
        log = tracking.RunLog(TrainConfig.preset("smoke", log_every=log_every, out=str(tmp_path)), "single",
                              torch.device("cpu"))
        try:
            for step in range(1, 31):
                log.step(step, torch.tensor(1.0), 0.1, Scaler())
        finally:
            log.close()
        return Scaler.reads

    assert reads(10) == 3 and reads(1) == 30


def test_bf16_on_a_gpu_without_bf16_is_one_clear_error(monkeypatch):
    """A V100 (compute capability 7.0) has no bf16 arithmetic; torch would emulate it slowly or fail in a kernel.
    With the capability faked (no GPU here), Precision refuses in one line naming the GPU; the control, an A100, is
    accepted."""
    from tutorial.core.config import ConfigError
    from tutorial.core.precision import Precision
    for name, capability, supported in (("Tesla V100-SXM2-32GB", (7, 0), False), ("NVIDIA A100-SXM4-40GB", (8, 0), True)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: supported)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        if supported:
            assert Precision("bf16", torch.device("cuda", 0)).dtype == torch.bfloat16
        else:
            with pytest.raises(ConfigError, match=r"Tesla V100-SXM2-32GB is 7\.0: use --precision fp16"):
                Precision("bf16", torch.device("cuda", 0))

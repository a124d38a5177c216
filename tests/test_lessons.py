"""The notebooks' helper functions teach facts; these tests check that the facts are true (the notebooks also
execute them under nbval, but a wrong helper there would print a wrong 'True' that nobody re-derives)."""
from __future__ import annotations

import torch

from tutorial.lessons import data_parallel, horovod as lessons_horovod, mixed_precision, notebook, single_device
from tutorial.core.config import TrainConfig
from tutorial.core.optim import lr_at, scaled_lr


def test_data_parallel_by_hand_gives_the_full_batch_gradient():
    torch.manual_seed(0)
    model, X, y = data_parallel.model_and_batch(TrainConfig.preset("smoke"), batch_size=16, device=torch.device("cpu"))
    dp = data_parallel.data_parallel_by_hand(model, X, y, replicas=2)
    full = data_parallel.batch_gradient(model, X, y)
    # DP sums the replicas' gradients of a loss averaged over the whole batch: the full-batch gradient.
    assert torch.allclose(dp["gradient"], full, atol=1e-6)
    assert dp["processes"] == 1 and dp["threads"] == 2 and dp["batch slices"] == [8, 8]


def test_grad_scaler_skips_overflowing_steps_and_halves_the_scale():
    rows = mixed_precision.scaler_demo(("ok", "inf", "ok", "ok", "nan"), init_scale=1024.0, growth_interval=2)
    assert [r["weight updated"] for r in rows] == [True, False, True, True, False]
    assert rows[1]["next scale"] == rows[1]["scale"] / 2
    assert rows[3]["next scale"] == rows[3]["scale"] * 2  # two good steps in a row: the scale grows


def test_seed_002_speedup_is_computed_from_its_times():
    rows = lessons_horovod.seed002_scaling("MNIST")
    assert rows[0]["GPUs"] == 1 and rows[0]["speed-up"] == 1.0
    eight = next(r for r in rows if r["GPUs"] == 8)
    assert eight["speed-up"] == round(rows[0]["seconds"] / eight["seconds"], 1)


def test_warmup_reaches_the_scaled_peak():
    cfg = TrainConfig.preset("smoke", warmup_epochs=1, epochs=4)
    peak = scaled_lr(cfg, 8)
    assert peak == 8 * cfg.lr
    assert lr_at(cfg, 0.0, peak) < 0.01 * peak
    assert abs(lr_at(cfg, 1.0, peak) - peak) < 1e-9
    assert lr_at(cfg, 4.0, peak) < 1e-9  # cosine decays to zero at the end

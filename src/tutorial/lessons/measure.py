"""Pieces the lesson helpers share: one seeded model and batch, a timed training step, device sync and a quiet
stderr (01, 02, 04, 05)."""
from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils import benchmark

from ..core.config import TrainConfig
from ..core.data import SHAPES, DataInfo, build_datasets
from ..core.models import build_model
from ..core.precision import Precision


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _native_stderr_silenced():
    """Send file descriptor 2 to /dev/null: the profiler's C++ library (kineto) writes timestamped progress lines
    there, which Jupyter would show under the next cell."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _default_device() -> torch.device:
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def model_and_batch(cfg: TrainConfig, batch_size: int | None = None, device: torch.device | None = None,
                    real: bool = True):
    """The preset's model (seeded, as the trainers build it) and one training batch.

    real=True: the first samples of the training set; real=False: random images of the dataset's shape (speed
    measurements, where the values do not matter and the data may not be downloaded).
    """
    device = device or torch.device("cpu")
    n = batch_size or cfg.batch_size
    if real:
        train_set, _, info = build_datasets(cfg)
        X, y = zip(*(train_set[i % len(train_set)] for i in range(n)))
        X, y = torch.stack(X), torch.as_tensor(y)
    else:
        info = SHAPES.get(cfg.dataset, DataInfo(3, 1000, cfg.image_size or 224))
        gen = torch.Generator().manual_seed(cfg.seed)
        X = torch.randn(n, info.in_channels, info.image_size, info.image_size, generator=gen)
        y = torch.randint(0, info.num_classes, (n,), generator=gen)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, info).to(device)
    return model, X.to(device), y.to(device)


def step_seconds(model, X: torch.Tensor, y: torch.Tensor, precision: Precision, steps: int = 20) -> float:
    """Seconds per training step (forward, loss, backward, SGD step) of model on the batch (X, y) under precision.

    torch.utils.benchmark times it: warm-up steps first (the first calls allocate memory and pick kernels), and the
    GPU synchronised around the timed steps, so kernels are timed and not just queued. num_threads: Timer would
    otherwise time with one CPU thread."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        with precision.autocast():
            loss = F.cross_entropy(model(X), y)
        precision.backward(loss)
        precision.step(optimizer, model.parameters())
        optimizer.zero_grad(set_to_none=True)

    timer = benchmark.Timer("step()", globals={"step": step}, num_threads=torch.get_num_threads())
    return timer.timeit(steps).mean

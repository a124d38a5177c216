"""Pieces the lesson helpers share: one seeded model and batch, device sync, a quiet stderr (01, 02, 04, 05)."""
from __future__ import annotations

import contextlib
import copy
import gc
import math
import os
import sys
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

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


# The shape of each dataset's images, so that speed measurements need no download (random data of that shape).



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



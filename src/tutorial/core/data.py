"""Datasets and loaders (taught in 01_single_device; the samplers in 03a_ddp_by_hand).

digits (scikit-learn's real 8x8 handwritten digits, shipped with the package) is the offline CPU default. MNIST and
CIFAR-10 come through torchvision: downloaded where there is internet, else read from --data-dir. ImageFolder reads an
ImageNet layout (train/ and val/ with one folder per class). synthetic feeds random images for throughput runs, and
cfg.synthetic=True random images shaped like any of them (no download, no decoding: the model's cost alone).
"""
from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock, Timeout
from torch.utils.data import DataLoader, Dataset, TensorDataset

from . import accelerator
from .config import ConfigError, TrainConfig


class DataError(ConfigError):
    """Data that cannot be found or read; reported like a bad option (one line, exit code 2)."""


@dataclass
class DataInfo:
    in_channels: int
    num_classes: int
    image_size: int


# Each dataset's image shape, so that speed measurements and lessons need no download (random data of that shape).
SHAPES = {"digits": DataInfo(1, 10, 8), "mnist": DataInfo(1, 10, 28), "cifar10": DataInfo(3, 10, 32),
          "imagefolder": DataInfo(3, 1000, 224), "synthetic": DataInfo(3, 1000, 224)}


class SyntheticImages(Dataset):
    """16 fixed random images of a shape, cycled, with labels i % classes: no decoding or disk I/O."""

    def __init__(self, size: int, info: DataInfo, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.images = torch.randn(16, info.in_channels, info.image_size, info.image_size, generator=gen)
        self.size, self.num_classes = size, info.num_classes

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return self.images[i % 16], i % self.num_classes  # not len(self.images): a Python call per sample


def digits_arrays():
    """The digits as load_digits(return_X_y=True) gives them: 1797 images of 64 values 0-16 (float64), their labels.
    Read straight from scikit-learn's copy of the file, which is what load_digits reads: importing scikit-learn costs
    1.2 s of CPU, paid by every rank of every smoke launch (tests/test_data.py holds the two equal). Where a release of
    scikit-learn moves the file, load_digits it is."""
    import importlib.util

    import numpy as np
    path = Path(importlib.util.find_spec("sklearn").origin).parent / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        from sklearn.datasets import load_digits
        return load_digits(return_X_y=True)
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int)


def _digits(seed: int = 0):
    images, labels = digits_arrays()
    x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    x = (x - 0.3) / 0.35  # roughly zero mean, unit variance
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))  # fixed split, same on every rank
    n_test = len(x) // 5
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test]), DataInfo(1, 10, 8)


def data_dir(cfg: TrainConfig) -> str:
    """Where datasets live: --data-dir if given, else $TUTORIAL_DATA_DIR, else the checkout's data/ folder, so the
    notebooks (which run in notebooks/) and the scripts (run from the checkout) share one copy."""
    if cfg.data_dir:
        return cfg.data_dir
    if os.environ.get("TUTORIAL_DATA_DIR"):
        return os.environ["TUTORIAL_DATA_DIR"]
    checkout = Path(__file__).resolve().parents[3]  # src/tutorial/core/data.py -> the checkout (editable install)
    return str(checkout / "data") if (checkout / "pyproject.toml").exists() else "data"


@contextlib.contextmanager
def one_downloader(folder: str, what: str, timeout: float = 1800):
    """Let one process of the job download into `folder` while the others wait for it (an exclusive lock on a file
    there): 8 ranks downloading the same archive at once would fetch it 8 times and unpack it over each other.
    The wait is bounded and says what it waits for."""
    os.makedirs(folder, exist_ok=True)
    lock = FileLock(os.path.join(folder, ".download.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"waiting (up to {timeout:.0f} s) for another process downloading {what} into {folder}",
              file=sys.stderr, flush=True)
        try:
            lock.acquire(timeout=timeout)
        except Timeout:
            raise DataError(f"gave up after {timeout:.0f} s waiting for another process to download {what} "
                            f"into {folder}") from None
    try:
        yield
    finally:
        lock.release()


class GeneratedImages(Dataset):
    """Made-up images of a dataset's shape whose classes can be learnt (a fixed pattern per class plus noise), as
    PIL images through the dataset's own transforms: the workshop-cpu preset's stand-in for CIFAR-10 in CI, where
    nothing can be downloaded. Only the pixels are made up; the augmentation, loaders and model are the real ones."""

    CELL, CONTRAST = 8, 0.6  # pixels per pattern cell; the pattern's share of each pixel (the rest is noise)

    def __init__(self, size: int, info: DataInfo, transform, seed: int = 0):
        gen = torch.Generator().manual_seed(1234)  # the same class patterns for train and test
        # Smooth patterns (cells of about 8 pixels) that CIFAR-10's random crop and flip keep recognisable: with one
        # random value per pixel, a shift of a few pixels made another pattern, and the workshop preset's ResNet-18
        # reached 0.51 test accuracy after 10 epochs on an H200 (2026-11-29).
        cells = max(2, info.image_size // self.CELL)
        coarse = torch.rand(info.num_classes, info.in_channels, cells, cells, generator=gen)
        self.patterns = torch.nn.functional.interpolate(coarse, size=info.image_size, mode="bilinear")
        self.size, self.info, self.transform, self.seed = size, info, transform, seed

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        from PIL import Image
        label = i % self.info.num_classes
        noise = torch.rand(self.patterns.shape[1:], generator=torch.Generator().manual_seed(self.seed * 10**6 + i))
        pixels = self.CONTRAST * self.patterns[label] + (1 - self.CONTRAST) * noise
        pixels = pixels.mul(255).byte().permute(1, 2, 0).squeeze(-1).numpy()
        return self.transform(Image.fromarray(pixels)), label


def _torchvision(cfg: TrainConfig):
    from torchvision import datasets, transforms as T
    if cfg.dataset == "mnist":
        cls, info = datasets.MNIST, DataInfo(1, 10, 28)
        normalize = T.Normalize((0.1307,), (0.3081,))
        train_tf = test_tf = T.Compose([T.ToTensor(), normalize])
    else:
        side = (cfg.image_size or 32) if cfg.generated else 32  # made-up images may be smaller (workshop-cpu)
        cls, info = datasets.CIFAR10, DataInfo(3, 10, side)
        normalize = T.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
        train_tf = T.Compose([T.RandomCrop(side, padding=side // 8), T.RandomHorizontalFlip(), T.ToTensor(),
                              normalize])
        test_tf = T.Compose([T.ToTensor(), normalize])
    if cfg.generated:
        return (GeneratedImages(cfg.generated, info, train_tf), GeneratedImages(cfg.generated // 4, info, test_tf, 1),
                info)
    root = data_dir(cfg)
    try:
        return cls(root, train=True, transform=train_tf), cls(root, train=False, transform=test_tf), info
    except RuntimeError:
        pass  # not on disk: try to download it, as the seeds do on machines with internet
    with one_downloader(root, cfg.dataset):
        try:  # whoever waited for the lock finds it on disk now
            return cls(root, train=True, transform=train_tf), cls(root, train=False, transform=test_tf), info
        except RuntimeError:
            pass
        old_timeout = socket.getdefaulttimeout()
        socket.setdefaulttimeout(30)  # a compute node without internet should fail in seconds, not hang
        chatter = io.StringIO()  # torchvision prints its download attempts; keep them for the error message
        try:
            with contextlib.redirect_stdout(chatter):
                train = cls(root, train=True, transform=train_tf, download=True)
                return train, cls(root, train=False, transform=test_tf, download=True), info
        except Exception as exc:  # noqa: BLE001 - any download failure means the same thing to the user
            text = chatter.getvalue() + "\n" + str(exc)
            lines = [line.strip() for line in text.splitlines() if "error" in line.lower()] or [type(exc).__name__]
            raise DataError(f"{cfg.dataset} is not in the data folder {root!r} (--data-dir) and could not be "
                            f"downloaded ({lines[-1][:160]}); download it where there is internet into that "
                            "folder") from None
        finally:
            socket.setdefaulttimeout(old_timeout)


def _imagefolder(cfg: TrainConfig):
    from torchvision import datasets, transforms as T
    size = cfg.image_size or 224
    dirs = [os.path.join(data_dir(cfg), part) for part in ("train", "val")]
    for d in dirs:
        if not os.path.isdir(d):
            raise DataError(f"imagefolder needs {d!r} (an ImageNet layout: train/ and val/ with one folder per class)")
    normalize = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    test_tf = T.Compose([T.Resize(int(size * 8 / 7)), T.CenterCrop(size), T.ToTensor(), normalize])
    train, test = datasets.ImageFolder(dirs[0], train_tf), datasets.ImageFolder(dirs[1], test_tf)
    return train, test, DataInfo(3, len(train.classes), size)


def build_datasets(cfg: TrainConfig):
    """(train_set, test_set, DataInfo) for cfg.dataset (random images of its shape with cfg.synthetic); identical on
    every rank."""
    if cfg.synthetic or cfg.dataset == "synthetic":
        shape = SHAPES[cfg.dataset]
        info = DataInfo(shape.in_channels, shape.num_classes, cfg.image_size or shape.image_size)
        # Enough samples for max_steps (or 64 steps) of the global batch of up to 8 ranks in one epoch.
        n = max(cfg.max_steps, 64) * cfg.batch_size * cfg.grad_accum * 8
        return SyntheticImages(n, info), SyntheticImages(cfg.batch_size * 4, info, seed=1), info
    if cfg.dataset == "digits":
        return _digits()
    if cfg.dataset in ("mnist", "cifar10"):
        return _torchvision(cfg)
    return _imagefolder(cfg)


def make_loader(dataset, cfg: TrainConfig, device: torch.device, sampler=None, batch_size: int | None = None,
                start_method: str | None = None):
    """A DataLoader with the configured workers; pinned memory only helps host-to-GPU copies. start_method
    "forkserver" starts the workers from a clean server process instead of forking this one (train_horovod)."""
    if start_method == "forkserver" and cfg.workers > 0:
        # The server imports torch and this module once, before it starts: its workers then fork ready to load.
        multiprocessing.set_forkserver_preload(["torch", "torchvision", __name__])
    return DataLoader(
        dataset,
        batch_size=batch_size or cfg.batch_size,
        sampler=sampler,
        num_workers=cfg.workers,
        pin_memory=cfg.pin_memory and device.type in accelerator.GPU_DEVICE_TYPES,  # for torch's accelerator
        persistent_workers=cfg.workers > 0,
        worker_init_fn=leave_sigterm_to_the_trainer if cfg.workers > 0 else None,
        multiprocessing_context=start_method if cfg.workers > 0 else None,
    )


def leave_sigterm_to_the_trainer(worker_id: int) -> None:
    """In each loader worker: ignore SIGTERM. Slurm and torchrun send it to every process of the job, and a worker
    killed by it makes its trainer fail ("DataLoader worker ... is killed by signal: Terminated") instead of saving
    (10_when_things_go_wrong). The trainer decides; its workers end with it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def shard(dataset, rank: int, world_size: int):
    """Every world_size-th sample from rank on: an exact split for evaluation (DistributedSampler would pad
    with duplicates, which would be counted twice)."""
    return torch.utils.data.Subset(dataset, range(rank, len(dataset), world_size))

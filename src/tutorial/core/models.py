"""Models: a small CNN for the CPU presets and torchvision ResNets for GPU nodes (01_single_device)."""
from __future__ import annotations

import hashlib

import torch
from torch import nn

from .data import DataInfo


def small_cnn(in_channels: int, num_classes: int, batch_norm: bool = False) -> nn.Module:
    """Two 3x3 convolutions and two linear layers; works on 8x8 digits, 28x28 MNIST and 32x32 CIFAR.

    Without BatchNorm and dropout its gradient over a batch is the mean of per-sample gradients, so DDP with
    2 ranks x B matches one process with 2B exactly (the equivalence tests rely on that). cnn_bn adds BatchNorm,
    whose running statistics drift apart between replicas unless SyncBatchNorm is used (03 shows it).
    """
    def norm(c):
        return nn.BatchNorm2d(c) if batch_norm else nn.Identity()

    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 3, padding=1), norm(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), norm(64), nn.ReLU(),
        nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        nn.Linear(64 * 4 * 4, 128), nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def resnet(name: str, info: DataInfo) -> nn.Module:
    import torchvision
    model = getattr(torchvision.models, name)(weights=None, num_classes=info.num_classes)
    if info.image_size < 64:
        # Small images (CIFAR, MNIST): the ImageNet stem would shrink 32x32 to 8x8 before the first block.
        model.conv1 = nn.Conv2d(info.in_channels, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif info.in_channels != 3:
        model.conv1 = nn.Conv2d(info.in_channels, 64, 7, stride=2, padding=3, bias=False)
    return model


def build_model(name: str, info: DataInfo) -> nn.Module:
    if name in ("cnn", "cnn_bn"):
        return small_cnn(info.in_channels, info.num_classes, batch_norm=name == "cnn_bn")
    return resnet(name, info)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside its wrappers: what checkpoints hold and replicas are compared by."""
    model = getattr(model, "module", model)       # DataParallel, DistributedDataParallel
    return getattr(model, "_orig_mod", model)     # torch.compile


def parameter_vector(model: nn.Module) -> torch.Tensor:
    """All parameters as one flat fp32 CPU vector, for comparing runs. FSDP's sharded parameters (DTensors) are
    gathered whole first, so call it on every rank."""
    return torch.cat([getattr(p, "full_tensor", p.detach)().detach().float().reshape(-1).cpu()
                      for p in unwrap(model).parameters()])


def checksum(model: nn.Module) -> str:
    """A short digest of the parameters' bytes: equal digests mean bitwise-identical replicas."""
    return hashlib.sha256(parameter_vector(model).numpy().tobytes()).hexdigest()[:16]

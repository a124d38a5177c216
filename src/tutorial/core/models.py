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


def convert_batchnorm(module: nn.Module, sync_class) -> nn.Module:
    """Every BatchNorm layer replaced by sync_class (Horovod's SyncBatchNorm; torch's own has
    convert_sync_batchnorm), its weights and running statistics kept."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        sync = sync_class(module.num_features, module.eps, module.momentum, module.affine,
                          module.track_running_stats)
        sync.load_state_dict(module.state_dict())
        return sync.to(next(module.buffers(), torch.empty(0)).device)
    for name, child in module.named_children():
        module.add_module(name, convert_batchnorm(child, sync_class))
    return module


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated units of a model, for FSDP to shard one by one (09_sharded_training): a ResNet's residual blocks
    (torch's FSDP2 tutorial and torchtitan shard per block), the small CNN's convolutions and linear layers. What is
    left (a ResNet's stem and head) stays with the root unit."""
    if all(hasattr(model, f"layer{i}") for i in range(1, 5)):
        return [block for i in range(1, 5) for block in getattr(model, f"layer{i}")]
    return [layer for layer in model.children() if isinstance(layer, (nn.Conv2d, nn.Linear))]


def batch_norms(model: nn.Module) -> list[nn.Module]:
    """The BatchNorm layers: FSDP keeps them in fp32 (their running statistics are fp32, and the CPU kernel refuses
    bf16 weights beside them)."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


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

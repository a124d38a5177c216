"""Mixed precision as a setting of every trainer (04_mixed_precision): autocast, and GradScaler for fp16."""
from __future__ import annotations

import torch

from .config import ConfigError

class Precision:
    """autocast for fp16/bf16 and, for fp16 only, a GradScaler (dynamic loss scaling).

    fp16 has 5 exponent bits: small gradients underflow to zero unless the loss is scaled up first. The scaler
    multiplies the loss by a large factor, unscales the gradients before the step, and when they overflow (inf/nan)
    skips that step and halves the scale: Apex's "Gradient overflow. Skipping step". bf16 has fp32's exponent
    range, so it needs no scaler.
    """

    def __init__(self, name: str, device: torch.device):
        if name == "fp16" and device.type != "cuda":
            raise ConfigError("precision fp16 needs a CUDA GPU (no fast fp16 kernels or loss scaling on a CPU); "
                              "use --precision bf16 or fp32 here")
        self.name, self.device_type = name, device.type
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(name)
        self.scaler = torch.amp.GradScaler(device.type, enabled=name == "fp16")
        self.skipped_steps = 0

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer, parameters, clip_grad: float = 0.0) -> bool:
        """Unscale (so clipping sees true gradient norms), clip, step unless gradients overflowed, update the scale.
        Returns False when the step was skipped."""
        if clip_grad > 0:
            self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        if not self.scaler.is_enabled():
            optimizer.step()
            return True
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        if self.scaler.get_scale() < scale:  # the scaler only lowers the scale after inf/nan gradients
            self.skipped_steps += 1
            return False
        return True

    @property
    def loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler.is_enabled() else 1.0

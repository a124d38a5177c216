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
        if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
            major, minor = torch.cuda.get_device_capability(device)
            raise ConfigError(f"precision bf16 needs a GPU with bf16 arithmetic (compute capability 8.0, Ampere, or "
                              f"newer); {torch.cuda.get_device_name(device)} is {major}.{minor}: use --precision "
                              "fp16 (with loss scaling) or fp32")
        self.name, self.device_type = name, device.type
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(name)
        self.scaler = torch.amp.GradScaler(device.type, enabled=name == "fp16")
        self._skipped = 0  # a tensor on the device once fp16 steps have run: counted there, read per epoch

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def step(self, optimizer, parameters, clip_grad: float = 0.0) -> None:
        """Unscale (so clipping sees true gradient norms), clip, step unless gradients overflowed, update the scale.
        Nothing here waits for the GPU: GradScaler.get_scale() is a .item() (a host-device sync), so the skipped step
        is counted by comparing the scale tensors on the device, and read once per epoch (skipped_steps)."""
        if clip_grad > 0:
            self.scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
        if not self.scaler.is_enabled():
            optimizer.step()
            return
        before = self.scaler._scale.clone()  # the scale tensor scale() made (get_scale() would copy it to the host)
        self.scaler.step(optimizer)
        self.scaler.update()
        self._skipped = self._skipped + (self.scaler._scale < before).int()  # lowered only after inf/nan gradients

    @property
    def skipped_steps(self) -> int:
        return int(self._skipped)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (a host-device sync under fp16: read it at log steps only, RunLog.step does)."""
        return self.scaler.get_scale() if self.scaler.is_enabled() else 1.0

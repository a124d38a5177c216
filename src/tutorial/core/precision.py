"""Mixed precision as a setting of every trainer (04_mixed_precision): autocast, and GradScaler for fp16."""
from __future__ import annotations

import torch

from . import accelerator
from .config import ConfigError

class Precision:
    """autocast for fp16/bf16 and, for fp16 only, a GradScaler (dynamic loss scaling).

    fp16 has 5 exponent bits: small gradients underflow to zero unless the loss is scaled up first. The scaler
    multiplies the loss by a large factor, unscales the gradients before the step, and when they overflow (inf/nan)
    skips that step and halves the scale: Apex's "Gradient overflow. Skipping step". bf16 has fp32's exponent
    range, so it needs no scaler.
    """

    def __init__(self, name: str, device: torch.device):
        # fp16 with loss scaling runs on every GPU torch drives: NVIDIA's, AMD's (device type cuda) and Intel's (xpu).
        if name == "fp16" and device.type not in accelerator.GPU_DEVICE_TYPES:
            raise ConfigError("precision fp16 needs a CUDA GPU (no fast fp16 kernels or loss scaling on a CPU); "
                              "use --precision bf16 or fp32 here")
        if name == "bf16" and not accelerator.has_bf16(device):  # NVIDIA before Ampere; every ROCm GPU has bf16
            gpu = accelerator.device_name(device)
            if device.type == "cuda":
                major, minor = torch.cuda.get_device_capability(device)
                why = f" (compute capability 8.0, Ampere, or newer); {gpu} is {major}.{minor}"
            else:
                why = f"; {gpu} has none"
            raise ConfigError(f"precision bf16 needs a GPU with bf16 arithmetic{why}: use --precision fp16 (with loss "
                              "scaling) or fp32")
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


def fp8_line(device: torch.device) -> str:
    """Whether this device multiplies FP8 matrices, and in which formats (04_mixed_precision): NVIDIA from compute
    capability 8.9, AMD's MI300 in its own fnuz formats, MI350 in NVIDIA's; not an A100, MI250X, Intel's Max or a CPU.
    A capability test alone would say yes for MI250X, whose gfx90a torch reports as (9, 0)."""
    where = "a CPU: no FP8 tensor cores" if device.type == "cpu" else accelerator.device_label(device)
    formats = accelerator.fp8_formats(device)
    if formats:
        answer = "yes, " + " and ".join(str(f).removeprefix("torch.") for f in formats)
    elif device.type == "xpu":
        answer = "no: Intel's Data Center GPU Max multiplies 8-bit integers, not FP8"
    elif getattr(torch.version, "hip", None):
        answer = "no: on AMD GPUs they start with MI300 (gfx942); MI250X is gfx90a"
    else:
        answer = "no: they need compute capability 8.9 or later (Ada, H100, H200); an A100 has compute capability 8.0"
    return f"FP8 matmuls on this device ({where}): {answer}"

"""04_mixed_precision: number formats, GradScaler's reaction to inf/nan, autocast's dtypes, a speed comparison."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..core.config import ConfigError, TrainConfig
from ..core.precision import Precision
from .measure import _default_device, model_and_batch, step_seconds


# NVIDIA Apex AMP offered four opt levels; torch.amp replaced them. What each level did and what to use now:
APEX_OPT_LEVELS = {
    "O0": ("pure fp32; the accuracy baseline", "fp32"),
    "O1": ("patch functions to cast per op (whitelist to fp16, blacklist in fp32), dynamic loss scaling",
           "fp16"),  # = torch.autocast + GradScaler: the recommended mode then and now
    "O2": ("fp16 model with fp32 master weights, BatchNorm kept fp32, dynamic loss scaling",
           "fp16"),  # no direct equivalent; autocast gives the speed without hand-kept master weights
    "O3": ("pure fp16, no master weights: a speed ceiling, often unstable", "fp16"),  # model.half(); not offered
}


def from_apex(opt_level: str) -> str:
    """The precision setting that replaces an Apex opt level (bf16 is the better choice where hardware has it)."""
    if opt_level not in APEX_OPT_LEVELS:
        raise ConfigError(f"Apex opt level {opt_level!r} is not one of: {', '.join(APEX_OPT_LEVELS)}")
    return APEX_OPT_LEVELS[opt_level][1]


# ---------------------------------------------------------------------------------------- 04: mixed precision
def float_formats(dtypes=(torch.float32, torch.float16, torch.bfloat16)) -> list[dict]:
    """Bits, range and precision of floating-point formats, from torch.finfo."""
    rows = []
    for dtype in dtypes:
        info = torch.finfo(dtype)
        mantissa = round(-math.log2(info.eps))
        rows.append({"dtype": str(dtype).replace("torch.", ""), "bits": info.bits,
                     "exponent": info.bits - 1 - mantissa, "mantissa": mantissa, "max": info.max,
                     "smallest normal": info.smallest_normal,
                     "smallest subnormal": info.smallest_normal * info.eps, "eps": info.eps})
    return rows


def scaler_demo(gradients=("ok", "ok", "inf", "ok", "ok", "nan", "ok"), init_scale: float = 2.0 ** 16,
                growth_interval: int = 2, device_type: str = "cpu") -> list[dict]:
    """A real torch.amp.GradScaler reacting to finite and inf/nan gradients, one row per step.

    The "model" is one weight w with loss = g * w, so its gradient is whatever we choose: a finite number, or inf
    and nan as an fp16 overflow would produce. growth_interval is small so that doubling shows up in a few steps
    (the default is 2000).
    """
    w = nn.Parameter(torch.ones((), device=device_type))
    optimizer = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, growth_interval=growth_interval)
    rows = []
    for step, kind in enumerate(gradients):
        g = {"ok": 1.0, "inf": math.inf, "nan": math.nan}[kind]
        before, scale = w.item(), scaler.get_scale()
        scaler.scale(g * w).backward()
        scaler.step(optimizer)           # skipped when the unscaled gradients hold inf or nan
        scaler.update()                  # halves the scale after a skip, doubles it after growth_interval good steps
        optimizer.zero_grad()
        rows.append({"step": step, "gradient": kind, "scale": scale, "weight updated": w.item() != before,
                     "next scale": scaler.get_scale()})
    return rows


def autocast_dtypes(device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Which dtype autocast gives each operation's output, and the dtype the weights stay in."""
    layer = nn.Linear(8, 4).to(device_type)
    x = torch.randn(2, 8, device=device_type)
    y = torch.tensor([0, 1], device=device_type)
    with torch.autocast(device_type, dtype=dtype):
        logits = layer(x)
        loss = F.cross_entropy(logits, y)
    names = lambda t: str(t.dtype).replace("torch.", "")  # noqa: E731
    return [{"tensor": "input x", "dtype": names(x)},
            {"tensor": "weight (the master copy)", "dtype": names(layer.weight)},
            {"tensor": "linear output (matmul)", "dtype": names(logits)},
            {"tensor": "cross-entropy loss", "dtype": names(loss)}]


def precision_benchmark(cfg: TrainConfig, precisions=("fp32", "bf16"), steps: int = 20) -> list[dict]:
    """Training samples per second and peak memory for each precision, same model and batch (04_mixed_precision).

    Uses the trainers' own Precision policy. fp16 is only accepted on a GPU.
    """
    device = _default_device()
    rows = []
    for name in precisions:
        amp = Precision(name, device)
        model, X, y = model_and_batch(cfg, device=device, real=False)
        if cfg.channels_last:
            model, X = model.to(memory_format=torch.channels_last), X.contiguous(memory_format=torch.channels_last)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        row = {"precision": name, "samples/s": round(len(X) / step_seconds(model, X, y, amp, steps))}
        if device.type == "cuda":
            row["peak MiB"] = torch.cuda.max_memory_allocated(device) / 2**20
        rows.append(row)
        del model
    return rows

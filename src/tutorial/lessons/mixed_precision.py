"""04_mixed_precision: number formats and their picture, GradScaler's reaction to inf/nan, a speed comparison, and the
exercises' checkers and solutions (clipping without unscale_, fp16 without loss scaling); TF32's input rounding,
emulated on a CPU (round_mantissa)."""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..core.accelerator import AllocatorWindow
from ..core.config import ConfigError, TrainConfig
from ..core.precision import Precision
from .measure import _default_device, model_and_batch, step_seconds
from .ranks import describe


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


def precision_benchmark(cfg: TrainConfig, precisions=("fp32", "bf16"), steps: int = 20) -> list[dict]:
    """Training samples per second and peak memory for each precision, same model and batch (04_mixed_precision).

    Uses the trainers' own Precision policy. fp16 is only accepted on a GPU.
    """
    device = _default_device()
    rows = []
    for name in precisions:
        precision = Precision(name, device)
        model, X, y = model_and_batch(cfg, device=device, real=False)
        if cfg.channels_last:
            model, X = model.to(memory_format=torch.channels_last), X.contiguous(memory_format=torch.channels_last)
        with AllocatorWindow(device) as memory:
            row = {"precision": name, "samples/s": round(len(X) / step_seconds(model, X, y, precision, steps))}
        if memory.max is not None:
            row["peak MiB"] = memory.max / 2**20
        rows.append(row)
        del model
    return rows


# ------------------------------------------------------------------------------------------- 04: the picture
def draw_number_lines(dtypes=(torch.float32, torch.float16, torch.bfloat16), ax=None):
    """fp32, fp16 and bf16 on one logarithmic axis, from torch.finfo: the subnormal and normal ranges, the largest
    value, and the spacing of representable numbers next to 1 (eps), which is their precision."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(11, 1.4 + 0.9 * len(dtypes)), layout="constrained")
    for row, dtype in enumerate(dtypes):
        info = torch.finfo(dtype)
        y = len(dtypes) - 1 - row
        tiny = math.log10(info.smallest_normal * info.eps)   # the smallest subnormal
        low, high = math.log10(info.smallest_normal), math.log10(info.max)
        ax.barh(y, low - tiny, left=tiny, height=0.42, color="#c6dbef", edgecolor="k")
        ax.barh(y, high - low, left=low, height=0.42, color="#3182bd", edgecolor="k")
        ax.text(tiny, y + 0.3, f"{10 ** tiny:.1e}", ha="center", fontsize=8)
        ax.text(low, y - 0.42, f"normal from {info.smallest_normal:.2g}", ha="left", fontsize=8)
        ax.text(high, y + 0.3, f"max {info.max:.3g}", ha="center", fontsize=8)
        ax.text(-50, y, f"{str(dtype).replace('torch.', '')}\nspacing near 1: {info.eps:.2g}", ha="right",
                va="center", fontsize=9)
    ax.axvline(-8, color="#e6550d", ls="--")
    ax.axvline(0, color="k", lw=0.8)
    ax.text(-8.5, -0.65, "a small gradient, 1e-8", color="#e6550d", ha="right", fontsize=8)
    ax.text(0.5, -0.65, "1", fontsize=8)
    ax.set_yticks([])
    ax.set_ylim(-0.75, len(dtypes) - 0.3)
    ax.set_xlim(-48, 46)
    ax.set_xlabel("log10 of the magnitude (light: subnormals, losing precision; dark: normal numbers)")
    ax.set_title("range and precision of the floating-point formats (torch.finfo)")
    return ax.figure


# ------------------------------------------------------------------------------------------- 04: measuring
def seconds_per_call(fn, device: torch.device, repeats: int = 5, warmup: int = 3, repeat_s: float = 0.5,
                     most: int = 10) -> list[float]:
    """Mean seconds per call of fn() in each of `repeats` timings (a comparison needs several: measure.comparison),
    after `warmup` untimed calls (they allocate memory and pick kernels), the GPU synchronised around each timing.
    A timing takes as many calls as fit in about repeat_s at the warm-up's pace, between 1 and `most`: a 1.5-s bf16
    step on a CPU without bf16 units is timed once per repeat, a GPU's millisecond step 10 times."""
    import time

    def synchronized():
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        return time.perf_counter()

    start = synchronized()
    for _ in range(warmup):
        fn()
    pace = (synchronized() - start) / warmup if warmup else 0.0
    steps = max(1, min(most, int(repeat_s / pace))) if pace else most
    seconds = []
    for _ in range(repeats):
        start = synchronized()
        for _ in range(steps):
            fn()
        seconds.append((synchronized() - start) / steps)
    return seconds


# -------------------------------------------------------------------------------------------- 04: exercises
def _mlp(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return model, torch.randn(64, 16, generator=gen), torch.randint(0, 4, (64,), generator=gen)


class _RecordingSGD(torch.optim.SGD):
    """SGD that remembers the gradients it stepped with: what the optimizer really saw (unscaled, clipped, or not)."""
    seen = None

    def step(self, closure=None):
        self.seen = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).clone()
                               for group in self.param_groups for p in group["params"]])
        return super().step(closure)


def _gradient_seen(step, model, X, y, scaler, **kwargs):
    """The gradient optimizer.step() got in one call of step(model, optimizer, scaler, X, y); None if never called."""
    optimizer = _RecordingSGD(model.parameters(), lr=0.1)
    step(model, optimizer, scaler, X, y, **kwargs)
    return optimizer.seen


def _reference_gradient(model, X, y, max_norm=None) -> torch.Tensor:
    model = copy.deepcopy(model)
    F.cross_entropy(model(X), y).backward()
    if max_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _forward_dtypes(model: nn.Module) -> set:
    """What the model's Linear layers compute in, filled as it runs: fp16 under autocast(dtype=torch.float16)."""
    dtypes = set()
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            layer.register_forward_hook(lambda module, inputs, output: dtypes.add(output.dtype))
    return dtypes


def _not_fp16(dtypes: set, why: str) -> str | None:
    if not dtypes or dtypes == {torch.float16}:
        return None
    names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    return f"wrong: the forward ran in {names}, not fp16: {why}"


def check_clipping(clipped_step, max_norm: float = 0.1) -> str:
    """Exercise 1: clipped_step(model, optimizer, scaler, X, y, max_norm), an fp16 step, must clip the TRUE gradient
    norm to max_norm, with a GradScaler whose scale is 65536 (its default). fp16 is the precision that needs the
    scaler; a bf16 step needs none (04's prose), so the checker asks for fp16."""
    model, X, y = _mlp()
    true_norm = _reference_gradient(model, X, y).norm().item()
    expected = _reference_gradient(model, X, y, max_norm)
    scaler = torch.amp.GradScaler("cpu")
    trained = copy.deepcopy(model)
    dtypes = _forward_dtypes(trained)
    try:
        seen = _gradient_seen(clipped_step, trained, X, y, scaler, max_norm=max_norm)
    except Exception as exc:  # noqa: BLE001 -- the learner's code; report it
        return f"wrong: it raised {describe(exc)}"
    wrong = _not_fp16(dtypes, "this is the fp16 step, the one that needs the GradScaler (bf16 needs none, and a "
                              "scaler with it only multiplies and divides); keep torch.autocast(..., "
                              "dtype=torch.float16)")
    if wrong:
        return wrong
    if seen is None:
        return "wrong: optimizer.step() was never called: the step was skipped (call scaler.step(optimizer))"
    got = seen.norm().item()
    if ((seen - expected).norm() / expected.norm()).item() < 0.05:    # fp16 autocast rounds: 5 % is ample
        return f"correct: the true gradient norm {true_norm:.2f} was clipped to {got:.3f}"
    if got < max_norm / 100:
        return (f"wrong: the optimizer got a gradient of norm {got:.2g} instead of {max_norm}, "
                f"{max_norm / got:,.0f}x too small: clip_grad_norm_ saw the gradients multiplied by the loss scale "
                f"{scaler.get_scale():g}, so it clipped them to {max_norm} / {scaler.get_scale():g}; "
                "call scaler.unscale_(optimizer) before clipping")
    if got > max_norm * 1.05:
        return (f"wrong: the optimizer got a gradient of norm {got:.3f}, above max_norm {max_norm}: it was not "
                "clipped (torch.nn.utils.clip_grad_norm_ after scaler.unscale_, before scaler.step)")
    return f"wrong: the optimizer got another gradient than the clipped fp32 one (norm {got:.3f})"


def solution_clipped_step(model, optimizer, scaler, X, y, max_norm=1.0):
    with torch.autocast(X.device.type, dtype=torch.float16):
        loss = F.cross_entropy(model(X), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                      # the true gradients, so that clipping sees their real norm
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)                          # knows they are unscaled already; skips on inf/nan
    scaler.update()
    optimizer.zero_grad()


def _confident_mlp():
    """A model late in training: it predicts the labels of this batch with logit margins of 15 to 23, so its
    gradients are tiny (below about 1e-6, most far below), where fp16 has only subnormals and zero."""
    model, _, _ = _mlp(seed=1)
    X = torch.randn(512, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model[2].weight.mul_(40.0)
        model[2].bias.zero_()
        top = model(X).topk(2, dim=1).values
        margin = top[:, 0] - top[:, 1]
        X = X[(margin > 15) & (margin < 23)][:64]
        y = model(X).argmax(1)
    return model, X, y


def check_fp16_step(fp16_step) -> str:
    """Exercise 2: one fp16 autocast step of a model with tiny gradients must give the optimizer the fp32 gradient."""
    model, X, y = _confident_mlp()
    expected = _reference_gradient(model, X, y)
    moving = expected.abs() > 1e-3 * expected.abs().max()       # the gradients that matter
    scaler = torch.amp.GradScaler("cpu")
    trained = copy.deepcopy(model)
    dtypes = _forward_dtypes(trained)
    try:
        seen = _gradient_seen(fp16_step, trained, X, y, scaler)
    except Exception as exc:  # noqa: BLE001
        if "No inf checks" in str(exc):
            return (f"wrong: it raised {describe(exc)} -- scaler.update() needs scaler.step(optimizer) before it: "
                    "scaler.step unscales the gradients (and skips the step on inf/nan); call it instead of "
                    "optimizer.step()")
        return f"wrong: it raised {describe(exc)}"
    wrong = _not_fp16(dtypes, "the step must stay fp16 (V100s and older GPUs have no fast bf16, and fp32 gives up "
                              "the speed); keep torch.autocast(..., dtype=torch.float16) and make its gradients "
                              "survive with the GradScaler")
    if wrong:
        return wrong
    if seen is None:
        return "wrong: optimizer.step() was never called (scaler.step(optimizer) calls it unless gradients overflow)"
    stuck = ((seen == 0) & moving).sum().item() / moving.sum().item()
    error = ((seen - expected).norm() / expected.norm()).item()
    if stuck > 0.01:
        return (f"wrong: {stuck:.0%} of the gradients were zero that fp32 computes as non-zero: gradients this "
                f"small (at most {expected.abs().max().item():.1e}) underflow to zero in fp16; scale the loss: "
                "scaler.scale(loss).backward(), then scaler.step(optimizer) and scaler.update()")
    if error > 0.15:
        return (f"wrong: the gradient is {error:.0%} off the fp32 gradient: were the gradients unscaled? "
                "(scaler.step(optimizer) unscales them, then steps)")
    return (f"correct: the optimizer got the fp32 gradient (within {error:.1%}), although no gradient exceeds "
            f"{expected.abs().max().item():.1e}")


def solution_fp16_step(model, optimizer, scaler, X, y):
    with torch.autocast(X.device.type, dtype=torch.float16):
        loss = F.cross_entropy(model(X), y)
    scaler.scale(loss).backward()                   # the gradients times 65536: out of the underflow zone
    scaler.step(optimizer)                          # unscaled in fp32, then optimizer.step()
    scaler.update()
    optimizer.zero_grad()


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x as fp32 with its mantissa rounded (to nearest, ties to even) to `bits` bits, the exponent kept: 10 bits is
    what a TF32 tensor core reads of an fp32 input, 7 is bf16. An emulation of the inputs' rounding only: a GPU then
    multiplies and accumulates in fp32, which adds fp32's own small error. For finite values below about 3e38."""
    if not 0 < bits <= 23:
        raise ValueError(f"bits must be 1 to 23 (fp32 has 23 mantissa bits), not {bits}")
    x = x.float().contiguous()
    drop = 23 - bits
    if drop == 0:
        return x.clone()
    i = x.view(torch.int32)
    i = i + ((i >> drop) & 1) + (1 << (drop - 1)) - 1  # round half to even on the bits that are dropped
    return (i & ~((1 << drop) - 1)).view(torch.float32)

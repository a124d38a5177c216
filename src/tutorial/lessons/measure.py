"""Pieces the lesson helpers share: one seeded model and batch, a timed training step, device sync and a quiet
stderr (01, 02, 04, 05, and 07's engines); the line that states a measured comparison (04, 05, 09, 11);
07_scaling_study's exercises (checkers and solutions)."""
from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.utils import benchmark

from ..core import accelerator
from ..core.config import TrainConfig
from ..core.data import SHAPES, DataInfo, build_datasets
from ..core.models import build_model
from ..core.precision import Precision
from .ranks import describe


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
    if torch.accelerator.is_available():  # NVIDIA's and AMD's GPUs are "cuda" to torch, Intel's "xpu"
        return torch.device(torch.accelerator.current_accelerator().type, 0)
    return torch.device("cpu")


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
        shape = SHAPES.get(cfg.dataset, DataInfo(3, 1000, 224))  # made-up images take the preset's size if it has one
        info = DataInfo(shape.in_channels, shape.num_classes, cfg.image_size or shape.image_size)
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


# A measured comparison is printed by the cell that measures it, with its numbers, and the prose points at that line
# ("compared here: ..."): a direction written in words ("several times slower") went stale when a re-run reversed it.
# tests/test_prose_claims.py flags comparisons of measured quantities in words that do not point at such a line.

def _value(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}" if abs(v) >= 10 or abs(v) < 0.1 else f"{v:.2f}"


def comparison(a_name: str, a, b_name: str, b, unit: str = "", *, warmup: int = 0, faster: str | None = None,
               repeat: str = "repeat") -> str:
    """The line that states a measured comparison (04, 05, 09).

    Two numbers give their ratio and no verdict: 'compared here: bf16 6096 samples/s against fp32 5537 samples/s:
    bf16 is 1.10x fp32'. One number per run cannot tell a difference from the machine's noise, so where a run can be
    repeated, pass its repeats (the samples/s of every epoch, the seconds of every timed repeat) and the line says
    which is faster only when the noise cannot explain it:

    - the first `warmup` repeats of each run are dropped (the first epoch allocates memory, starts the loader's
      workers and picks kernels); the rest are the run's steady repeats, and each run is summed up by their median,
      which one disturbed repeat (another process took the CPU) does not move;
    - A is called faster than B only when every steady repeat of A beat every steady repeat of B (the two runs'
      ranges, min to max, do not overlap), and that is unlikely by chance: were both runs n and m draws of one
      distribution, their ranges would fall apart (in either direction) with probability 2 / C(n + m, n), the
      extreme of the Mann-Whitney test. A verdict needs that chance at most 1/10 (NOISE_CHANCE): 3 repeats against 3
      are the fewest that can name a winner (2/20), 5 against 5 do it by chance 1 time in 126;
    - otherwise the two are "within noise", with the medians' difference and the two ranges that overlap (or the
      number of repeats that is too small to tell); a run with nothing but its warm-up has nothing to compare.

    faster: "higher" (rates: samples/s) or "lower" (seconds); by default it follows the unit ("/s" higher, "s",
    "ms", "us" lower); any other unit gets "A 1.31x B, beyond the noise" instead of "faster". repeat: what one
    repeat is called in the line ("epoch").

    Review 6's run of 04 (f7f8195), whose mean rates said "bf16 is 1.30x fp32" while by time fp32 was ahead:
    'compared here: bf16 8492 samples/s against fp32 6507 samples/s (medians of 3 epochs each, after 1 warm-up
    epoch): bf16 and fp32 are within noise (bf16 1.31x fp32, but the runs' ranges overlap: bf16 392-9040, fp32
    6460-6634 samples/s)'. One bf16 epoch was disturbed (3.7 s instead of 0.2 s): the medians do not move, and
    the verdict is withheld, since a run that noisy cannot tell a 31% difference.
    """
    space = f" {unit}" if unit else ""
    if not (_is_sequence(a) or _is_sequence(b)):
        ratio = f"{a / b:.2f}x" if b else "no ratio (the second value is 0)"
        return (f"compared here: {a_name} {_value(a)}{space} against {b_name} {_value(b)}{space}: "
                f"{a_name} is {ratio} {b_name}")
    runs = [[float(v) for v in (r if _is_sequence(r) else [r])] for r in (a, b)]
    if min(map(len, runs)) <= warmup:  # a preset of one epoch (workshop-cpu): only its warm-up
        return (f"compared here: {a_name} against {b_name}: nothing to compare (the runs have {len(runs[0])} and "
                f"{len(runs[1])} {repeat}s, and the first {warmup} of each is warm-up)")
    (a_steady, b_steady), faster = [sorted(r[warmup:]) for r in runs], faster or _faster_way(unit)
    if faster not in ("higher", "lower", "neutral"):
        raise ValueError(f"comparison: faster={faster!r}; allowed: 'higher' (rates), 'lower' (times) or None")
    a_mid, b_mid = statistics.median(a_steady), statistics.median(b_steady)
    n, m = len(a_steady), len(b_steady)
    each = f"{n} {repeat}s each" if n == m else f"{n} and {m} {repeat}s"
    after = f", after {warmup} warm-up {repeat}{'s' if warmup > 1 else ''}" if warmup else ""
    head = (f"compared here: {a_name} {_value(a_mid)}{space} against {b_name} {_value(b_mid)}{space} "
            f"(medians of {each}{after})")
    if not (a_mid and b_mid):
        return f"{head}: no ratio (a median is 0)"
    ranges = (f"{a_name} {_value(a_steady[0])}-{_value(a_steady[-1])}, "
              f"{b_name} {_value(b_steady[0])}-{_value(b_steady[-1])}{space}")
    ratio = f"{a_name} {a_mid / b_mid:.2f}x {b_name}"
    disjoint = a_steady[0] > b_steady[-1] or b_steady[0] > a_steady[-1]
    chance = 2 / math.comb(n + m, n)
    if not disjoint:
        return f"{head}: {a_name} and {b_name} are within noise ({ratio}, but the runs' ranges overlap: {ranges})"
    if chance > NOISE_CHANCE:
        return (f"{head}: {a_name} and {b_name} are within noise ({ratio}; the ranges {ranges} do not overlap, but "
                f"{n} {repeat}s against {m} fall apart so by chance 1 time in {1 / chance:.3g}: too few to tell)")
    if faster == "neutral":
        return f"{head}: {ratio}, beyond the noise (the runs' ranges do not overlap: {ranges})"
    a_ahead = (a_mid > b_mid) == (faster == "higher")
    (win, win_mid), (lose, lose_mid) = ((a_name, a_mid), (b_name, b_mid)) if a_ahead else ((b_name, b_mid),
                                                                                          (a_name, a_mid))
    times = win_mid / lose_mid if faster == "higher" else lose_mid / win_mid
    return (f"{head}: {win} is {times:.2f}x faster than {lose}, beyond the noise (the runs' ranges do not overlap: "
            f"{ranges})")


# The largest chance, were both runs draws of one distribution, at which comparison() still names a winner.
NOISE_CHANCE = 1 / 10


def _is_sequence(v) -> bool:
    return isinstance(v, (list, tuple)) or (isinstance(v, torch.Tensor) and v.dim() > 0)


def _faster_way(unit: str) -> str:
    if unit.endswith("/s"):
        return "higher"
    return "lower" if unit in ("s", "ms", "us", "\u00b5s", "seconds") else "neutral"


def trend(what: str, x_name: str, xs, ys) -> str:
    """'compared here: gpipe's idle fraction at m = 2, 4, 8: 0.40, 0.35, 0.29; it fell at every step, to 0.72x its
    value at m = 2' (11's bubble). The direction is computed from the values, so it is true of this run."""
    steps = [b - a for a, b in zip(ys, ys[1:])]
    moved = ("fell at every step" if all(d < 0 for d in steps) else "rose at every step" if all(d > 0 for d in steps)
             else "did not move one way at every step")
    ratio = f"{ys[-1] / ys[0]:.2f}x" if ys[0] else "no ratio to"
    return (f"compared here: {what} at {x_name} = {', '.join(map(str, xs))}: {', '.join(_value(y) for y in ys)}; "
            f"it {moved}, to {ratio} its value at {x_name} = {xs[0]}")


# 07_scaling_study's exercises: the learner's function, run on fixed inputs, against the solution. Each verdict is
# "correct: ..." or "wrong: ..." naming the mistake people make most with scaling numbers.

# Measured-looking tables (nproc, batch per process, seconds per step): weak scaling keeps 32 per process, strong
# scaling splits a global batch of 32.
WEAK_TABLE = [dict(nproc=1, batch_per_process=32, step_s=0.0100), dict(nproc=2, batch_per_process=32, step_s=0.0110),
              dict(nproc=4, batch_per_process=32, step_s=0.0125), dict(nproc=8, batch_per_process=32, step_s=0.0160)]
STRONG_TABLE = [dict(nproc=1, batch_per_process=32, step_s=0.0100), dict(nproc=2, batch_per_process=16, step_s=0.0065),
                dict(nproc=4, batch_per_process=8, step_s=0.0045)]


def solution_scaling(rows: list[dict]) -> list[dict]:
    """Speed-up and efficiency of every row against the first: throughput is summed over all processes."""
    def throughput(r):
        return r["nproc"] * r["batch_per_process"] / r["step_s"]  # samples/s of the whole job
    base = rows[0]
    out = []
    for r in rows:
        speedup = throughput(r) / throughput(base)
        out.append(dict(nproc=r["nproc"], speedup=speedup, efficiency=speedup * base["nproc"] / r["nproc"]))
    return out


def _close(a, b, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def check_scaling(scaling) -> str:
    """Run the learner's scaling(rows) on a weak and a strong table; name the mistake if the numbers are off."""
    for name, table in (("weak", WEAK_TABLE), ("strong", STRONG_TABLE)):
        try:
            got = scaling([dict(r) for r in table])
            got = [(float(g["speedup"]), float(g["efficiency"])) for g in got]
        except Exception as exc:  # noqa: BLE001 - the learner's code may fail in any way
            return f"wrong: scaling() failed on the {name}-scaling table: {describe(exc)}"
        want = [(r["speedup"], r["efficiency"]) for r in solution_scaling(table)]
        if len(got) != len(want):
            return f"wrong: {len(got)} rows for a {name}-scaling table of {len(want)}: one result per measured row"
        per_rank = [r["batch_per_process"] / r["step_s"] / (table[0]["batch_per_process"] / table[0]["step_s"])
                    for r in table]
        for r, (s, e), (ws, we), pr in zip(table, got, want, per_rank):
            n = r["nproc"]
            if _close(s, ws) and _close(e, we):
                continue
            where = (f"at {n} processes of the {name}-scaling table ({r['batch_per_process']} samples per process, "
                     f"{r['step_s'] * 1000:g} ms per step) your speed-up is {s:.2f}, expected {ws:.2f}")
            if _close(s, pr) and not _close(s, ws):
                return (f"wrong: {where}: you compared one rank's samples/s. The job's throughput is summed over all "
                        f"processes: processes x batch per process / step time")
            if not _close(s, ws):
                return f"wrong: {where}: speed-up is the job's throughput over the first row's"
            if _close(e, s):
                return (f"wrong: at {n} processes your efficiency equals the speed-up ({s:.2f}): efficiency is "
                        f"speed-up per process, {ws:.2f} / {n} = {we:.2f} here")
            return f"wrong: at {n} processes ({name} scaling) your efficiency is {e:.2f}, expected {we:.2f} (speed-up / processes)"
    weak, strong = solution_scaling(WEAK_TABLE)[-1], solution_scaling(STRONG_TABLE)[-1]
    return (f"correct: weak scaling {weak['speedup']:.2f}x at 8 processes ({weak['efficiency']:.0%} efficiency), "
            f"strong scaling {strong['speedup']:.2f}x at 4 ({strong['efficiency']:.0%})")


# (bytes, seconds, processes) of all-reduces: 2, 4 and 8 ranks, and one rank (nothing crosses a link).
BUSBW_CASES = [(2 ** 20, 1e-3, 2), (2 ** 24, 0.02, 4), (4e6, 5e-3, 8), (64e6, 0.01, 16), (2 ** 20, 1e-4, 1)]


def solution_bus_bandwidth(size_bytes: float, seconds: float, nproc: int) -> float:
    """nccl-tests' bus bandwidth in GB/s (1e9 bytes/s): algbw = size / time, times 2(n-1)/n."""
    algbw = size_bytes / seconds / 1e9
    return algbw * 2 * (nproc - 1) / nproc


def check_bus_bandwidth(bus_bandwidth) -> str:
    """Run the learner's bus_bandwidth(size_bytes, seconds, nproc) on several all-reduces against the solution."""
    for size, seconds, n in BUSBW_CASES:
        try:
            got = float(bus_bandwidth(size, seconds, n))
        except Exception as exc:  # noqa: BLE001
            return f"wrong: bus_bandwidth({size:g}, {seconds:g}, {n}) failed: {describe(exc)}"
        want = solution_bus_bandwidth(size, seconds, n)
        if _close(got, want):
            continue
        algbw = size / seconds / 1e9
        where = f"{size:g} bytes in {seconds * 1000:g} ms on {n} processes: you return {got:.4g} GB/s, expected {want:.4g}"
        if _close(got, algbw):
            return (f"wrong: {where}. That is algbw (size / time); the bus bandwidth multiplies it by 2(n-1)/n, "
                    f"what a ring all-reduce sends over every link, so it can be compared with the link's peak")
        if _close(got, 2 * algbw):
            return (f"wrong: {where}. The factor is 2(n-1)/n, not 2: it tends to 2 for many processes, but it is "
                    f"{2 * (n - 1) / n:g} at {n}")
        if _close(got, algbw * (n - 1) / n):
            return (f"wrong: {where}. A ring all-reduce is a reduce-scatter plus an all-gather, each moving (n-1)/n of "
                    f"the buffer: the factor is 2(n-1)/n")
        if _close(got, want * 1e9) or _close(got, want * 1e9 / 2 ** 30):
            return f"wrong: {where}. Units: GB/s here is 1e9 bytes/s, as in nccl-tests"
        if _close(got, algbw * n / (2 * (n - 1))) or _close(got, algbw / (2 * (n - 1) / n)):
            return f"wrong: {where}. Multiply algbw by 2(n-1)/n, do not divide"
        return f"wrong: {where}. busbw = size / time x 2(n-1)/n, in 1e9 bytes/s"
    return "correct: busbw = algbw x 2(n-1)/n on 1 to 16 processes (1x algbw at 2 processes, 1.75x at 8, 0 on one)"


# Peak dense matrix throughput in TFLOP/s per device torch sees, from the vendors' datasheets, never the "with
# sparsity" figures (twice these: training multiplies dense matrices).
# - NVIDIA: A100 Tensor Core GPU datasheet (bf16/fp16 312, TF32 156); H100 Tensor Core GPU datasheet (SXM 989 and
#   495, PCIe 756 and 378, NVL 835 and 418); H200 datasheet (SXM as H100 SXM; NVL 835 and 418); L40S datasheet (bf16
#   362, TF32 183); V100 datasheet (tensor cores 125 SXM2, 112 PCIe, 130 V100S): fp16 only, V100 has no bf16 and no
#   TF32, so its bf16 is None and an fp16 run asks for "fp16".
# - AMD: Instinct MI250X datasheet (bf16/fp16 383, FP32 matrix 95.7, no TF32) for the module, whose two dies torch
#   sees as two devices: half each; MI300X datasheet (bf16/fp16 1307.4, TF32 653.7, FP32 matrix 163.4), one device in
#   its default partition mode (SPX). ROCm's torch multiplies fp32 as FP32 unless HIPBLASLT_ALLOW_TF32=1: "fp32".
# - Intel: Data Center GPU Max 1550 product brief (bf16/fp16 839, TF32 419 for the card of 2 stacks, no sparsity),
#   whose stacks torch sees as two devices (Level Zero's default ZE_FLAT_DEVICE_HIERARCHY=FLAT, Aurora's 12): half.
# A name is matched by the first key it contains, so a key comes before any shorter key inside it ("H100 PCIe" before
# "H100"). fp16 is bf16's figure wherever no "fp16" is given.
PEAK_TFLOPS = {  # {key in the device's name (torch's get_device_name): {dtype: TFLOP/s, None: the device has none}}
    "H100 PCIe": {"bf16": 756, "tf32": 378},
    "H100 NVL": {"bf16": 835, "tf32": 418},
    "H100": {"bf16": 989, "tf32": 495},   # SXM5 ("NVIDIA H100 80GB HBM3")
    "H200 NVL": {"bf16": 835, "tf32": 418},
    "H200": {"bf16": 989, "tf32": 495},
    "A100": {"bf16": 312, "tf32": 156},
    "L40S": {"bf16": 362, "tf32": 183},
    "V100S": {"bf16": None, "fp16": 130, "tf32": None},
    "V100-PCIE": {"bf16": None, "fp16": 112, "tf32": None},
    "V100": {"bf16": None, "fp16": 125, "tf32": None},  # SXM2 ("Tesla V100-SXM2-32GB")
    "MI250X": {"bf16": 191.5, "tf32": None, "fp32": 47.85},  # one die ("AMD Instinct MI250X")
    "MI300X": {"bf16": 1307.4, "tf32": 653.7, "fp32": 163.4},
    "Max 1550": {"bf16": 419.5, "tf32": 209.5},  # one stack ("Intel(R) Data Center GPU Max 1550")
}
PEAK_SOURCE = "the vendors' datasheets, dense (half the 'with sparsity' figures), per device torch sees"


def peak_flops(device: torch.device, dtype: str = "bf16") -> float | None:
    """The device's datasheet peak in FLOP/s for `dtype` ("bf16", "fp16", "tf32" or "fp32"), or None where none is
    known: a CPU, a GPU not in PEAK_TFLOPS (peak_missing says so), a dtype the device has no figure for. A ROCm GPU is
    a "cuda" device to torch; an Intel GPU an "xpu" one."""
    if device.type not in accelerator.GPU_DEVICE_TYPES:
        return None
    name = accelerator.device_name(device)
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            tflops = peaks.get("fp16", peaks["bf16"]) if dtype == "fp16" else peaks.get(dtype)
            return tflops * 1e12 if tflops else None
    return None


def peak_missing(device: torch.device, dtype: str = "bf16") -> str:
    """The line to print where peak_flops is None. A GPU's MFU needs its own peak: one CPU core's estimate would make a
    GPU run hundreds of percent efficient."""
    if device.type not in accelerator.GPU_DEVICE_TYPES:
        return "peak: no datasheet peak for this device; exercise 3 uses an estimate for one CPU core"
    return (f"peak: none known for {accelerator.device_name(device)} in {dtype}; look up its dense {dtype} TFLOP/s "
            f"(not the 'with sparsity' figure) in its datasheet and set peak = <TFLOP/s> * 1e12 to compute its MFU")


def cpu_peak_estimate(cores: int, ghz: float, flops_per_cycle: int = 32) -> float:
    """An estimate, not a datasheet value: cores x clock x FLOPs per cycle per core. 32 = two AVX2 FMA units x 8 fp32
    lanes x 2 FLOPs per multiply-add (an AVX-512 core with two FMA units does 64)."""
    return cores * ghz * 1e9 * flops_per_cycle


# (forward FLOPs of one batch, batch size, samples/s, peak FLOP/s) and the MFU they give: an H100 step of a model of
# 10 GFLOP forward per sample at 12,000 samples/s, an A100 step, and a CPU core's.
MFU_CASES = [(10e9 * 256, 256, 12_000, 989e12), (4.1e9 * 64, 64, 2_600, 312e12), (2.4e6 * 32, 32, 4_000, 64e9)]


def solution_mfu(batch_forward_flops: float, batch_size: int, samples_per_second: float, peak: float) -> float:
    """Model FLOPs utilisation, a fraction: FLOPs one sample's training step needs (forward x 3: the backward pass
    costs about twice the forward) times samples/s, over the device's peak FLOP/s."""
    flops_per_sample = 3 * batch_forward_flops / batch_size
    return flops_per_sample * samples_per_second / peak


def check_mfu(mfu) -> str:
    """Run the learner's mfu(batch_forward_flops, batch_size, samples_per_second, peak) on MFU_CASES."""
    for flops, batch, rate, peak in MFU_CASES:
        try:
            got = float(mfu(flops, batch, rate, peak))
        except Exception as exc:  # noqa: BLE001
            return f"wrong: mfu({flops:g}, {batch}, {rate:g}, {peak:g}) failed: {describe(exc)}"
        want = solution_mfu(flops, batch, rate, peak)
        if _close(got, want):
            continue
        where = (f"{flops / batch / 1e9:g} GFLOP forward per sample, {rate:,} samples/s, peak {peak / 1e12:g} TFLOP/s: "
                 f"you return {got:.4g}, expected {want:.4g}")
        if _close(got, want / 3):
            return (f"wrong: {where}. You counted the forward pass only; training also runs the backward pass, about "
                    f"twice the forward's FLOPs (the gradients of the inputs and of the weights): x3")
        if _close(got, want * batch) or _close(got, want * batch / 3):
            return (f"wrong: {where}. FlopCounterMode counted the whole batch of {batch}: divide by the batch size "
                    f"to get FLOPs per sample, then multiply by samples/s")
        if _close(got, 100 * want):
            return f"wrong: {where}. Return a fraction (0.4), not a percentage (40)"
        if _close(got, want / 2) or _close(got, 2 * want):
            return (f"wrong: {where}. FlopCounterMode already counts 2 FLOPs per multiply-add: do not halve or "
                    f"double it")
        return f"wrong: {where}. MFU = 3 x forward FLOPs per sample x samples/s / peak FLOP/s"
    h100 = solution_mfu(*MFU_CASES[0])
    return f"correct: MFU = 3 x forward FLOPs per sample x samples/s / peak (the H100 case: {h100:.0%})"

"""The studies of notebook 07_scaling_study: a grid of trainer runs (samples/s), an all-reduce sweep over message sizes
(bus bandwidth), and weak and strong scaling over 1..N processes with where a step's time goes.

Each takes the parsed command line (bench/cli.py), prints a table and appends one line per result to
results/<kind>.jsonl (bench/record.py)."""
from __future__ import annotations

import itertools
import statistics
import sys
from dataclasses import dataclass

import torch

from ..core import accelerator
from ..core.config import TrainConfig
from ..core.data import SHAPES
from ..core.distributed import init_process_group, pick_device, teardown, world_from_env
from .collectives import allreduce_check, bus_bandwidth
from .record import append_result, print_table, summary
from .runs import BenchError, available_processes, launch, launch_horovod, measure_run


# ------------------------------------------------------------------------------------------------------- train
@dataclass(frozen=True)
class Point:
    """One grid point: which trainer, on what, how many processes."""
    strategy: str
    precision: str
    model: str
    batch_size: int
    nproc: int
    data: str = "synthetic"
    independent: bool = False  # nproc single-process trainers side by side: compute without communication

    @property
    def label(self) -> str:
        return "none (compute)" if self.independent else self.strategy

    @property
    def ranks(self) -> int:
        """Batches per step: one per process (dp splits one batch in its one process)."""
        return 1 if self.strategy == "dp" else self.nproc


def _train_job(job: dict, rank: int, nproc: int) -> dict:
    return measure_run(job["strategy"], TrainConfig(**job["cfg"]), job["warmup"], job["steps"],
                       verbose=job["verbose"] and rank == 0)


def run_points(points: list[Point], cfg: TrainConfig, args) -> list[dict]:
    """`repeats` runs of every point, each in fresh processes; throughput over all ranks. The repeats go round the
    points (1, 2, 3, 1, 2, 3, ...) so that a change in the machine's load hits every point alike."""
    jobs = [dict(strategy="single" if p.independent else p.strategy, warmup=args.warmup, steps=args.steps,
                 verbose=args.verbose, threads=args.threads,
                 cfg=cfg.replace(model=p.model, precision=p.precision, batch_size=p.batch_size,
                                 synthetic=p.data == "synthetic").to_dict()) for p in points]
    runs = [[] for _ in points]
    for repeat in range(args.repeats):
        for p, job, done in zip(points, jobs, runs):
            print(f"run {repeat + 1}/{args.repeats}: {p.label} x{p.nproc} {p.model} {p.precision} batch "
                  f"{p.batch_size}/process, {p.data} data, {args.warmup}+{args.steps} steps", file=sys.stderr,
                  flush=True)
            start = launch_horovod if p.strategy == "horovod" and not p.independent else launch
            done.append(start(_train_job, job, p.nproc, args.timeout, args.verbose))
    return [dict(samples_per_second=summary(sum(r["samples"]) * p.ranks / sum(r["seconds"]) for r in done),
                 step_seconds=summary(statistics.median(r["seconds"]) for r in done),
                 threads_per_process=done[-1]["threads"]) for p, done in zip(points, runs)]


def check_point(p: Point) -> None:
    """Refuse what cannot run here before starting anything."""
    if p.strategy in ("single", "dp") and p.nproc != 1 and not p.independent:
        raise BenchError(f"strategy {p.strategy} runs one process, got --nproc {p.nproc} (use ddp or horovod for more)")
    if p.precision == "fp16" and not accelerator.device_count():
        raise BenchError("precision fp16 needs a GPU; use bf16 or fp32 here")
    if p.strategy == "horovod":
        try:
            import horovod.torch  # noqa: F401
        except ImportError:
            raise BenchError("strategy horovod needs Horovod built with PyTorch (bash scripts/install_horovod.sh)") \
                from None


def base_config(args) -> TrainConfig:
    overrides = {name: getattr(args, name) for name in ("image_size", "workers", "data_dir", "channels_last",
                                                        "compile", "dataset") if getattr(args, name) is not None}
    return TrainConfig.preset(args.preset, **overrides)


def _run_parameters(cfg: TrainConfig, args) -> dict:
    """What every trainer run of a study shares, for the record."""
    return dict(preset=cfg.preset_name, channels_last=cfg.channels_last, compile=cfg.compile, workers=cfg.workers,
                device=accelerator.gpu_type(), threads_per_process=args.threads or "cores / nproc",
                warmup_steps=args.warmup, measured_steps=args.steps, repeats=args.repeats)


def _point_parameters(p: Point, cfg: TrainConfig, args) -> dict:
    shape = SHAPES[cfg.dataset]
    size = cfg.image_size or shape.image_size
    dataset = (f"synthetic {shape.in_channels}x{size}x{size}, {shape.num_classes} classes" if p.data == "synthetic"
               else cfg.dataset)
    return dict(strategy=p.label, nproc=p.nproc, precision=p.precision, model=p.model, batch_size=p.batch_size,
                global_batch_size=p.batch_size * p.ranks, data=p.data, dataset=dataset, **_run_parameters(cfg, args))


def train(args, command: list) -> int:
    cfg = base_config(args)
    points = [Point(*values, data=args.data) for values in itertools.product(
        args.strategy, args.precision or [cfg.precision], args.model or [cfg.model],
        args.batch_size or [cfg.batch_size], args.nproc)]
    if len(args.strategy) > 1 or len(args.nproc) > 1:  # in a grid, single and dp run only their one-process points
        for p in [p for p in points if p.strategy in ("single", "dp") and p.nproc > 1]:
            print(f"skipping {p.strategy} x{p.nproc}: {p.strategy} runs one process", file=sys.stderr)
            points.remove(p)
        if not points:
            raise BenchError("no grid point left: single and dp run one process (use ddp or horovod for --nproc > 1)")
    for p in points:
        check_point(p)
        cfg.replace(model=p.model, precision=p.precision, batch_size=p.batch_size)  # validates
    rows = []
    for p, results in zip(points, run_points(points, cfg, args)):
        path = append_result(args.results_dir, "train", command, _point_parameters(p, cfg, args), results)
        sps = results["samples_per_second"]
        rows.append({"strategy": p.label, "nproc": p.nproc, "model": p.model, "precision": p.precision,
                     "batch": p.batch_size, "global": p.batch_size * p.ranks,
                     "samples/s": f"{sps['median']:.1f}", "min": f"{sps['min']:.1f}",
                     "max": f"{sps['max']:.1f}", "spread": f"{(sps['max'] - sps['min']) / sps['median']:.1%}",
                     "step ms": f"{results['step_seconds']['median'] * 1000:.2f}"})
    print_table(rows)
    print(f"appended {len(rows)} line(s) to {path}")
    return 0


# --------------------------------------------------------------------------------------------------- allreduce
def _allreduce_job(job: dict, rank: int, nproc: int) -> list[dict]:
    world = world_from_env()
    device = torch.device("cpu") if job["backend"] == "gloo" else pick_device(world.local_rank)
    created = init_process_group(world, device)  # gloo for CPU tensors, nccl for GPU ones
    try:
        checks = [allreduce_check(size / 2 ** 20, job["repeats"], job["iters"], device) for size in job["sizes"]]
    finally:
        teardown(created)
    wrong = [c["bytes"] for c in checks if not c["sum_correct"]]
    if wrong:
        raise RuntimeError(f"all-reduce of {wrong[0]} bytes gave a wrong sum")
    return checks


def allreduce(args, command: list) -> int:
    backends = args.backend or [accelerator.backend()]  # nccl (NVIDIA, AMD), xccl (Intel) or gloo
    max_bytes = args.max_bytes or (2 ** 30 if accelerator.device_count() else 64 * 2 ** 20)
    if args.min_bytes > max_bytes:
        raise BenchError(f"--min-bytes {args.min_bytes} is larger than --max-bytes {max_bytes}")
    for backend in backends:
        if backend != "gloo" and not accelerator.device_count():
            raise BenchError(f"backend {backend} needs GPUs; this machine has none (use --backend gloo)")
        available, what = available_processes(backend)
        if args.nproc > available:
            raise BenchError(f"--nproc {args.nproc} is more than the {available} {what} of this machine")
    sizes = [args.min_bytes]
    while sizes[-1] * args.factor <= max_bytes:
        sizes.append(sizes[-1] * args.factor)
    for backend in backends:
        job = dict(backend=backend, sizes=sizes, iters=args.iters, repeats=args.repeats)
        rows, table = [], []
        for check in launch(_allreduce_job, job, args.nproc, args.timeout, args.verbose):
            seconds, size = check["repeat_seconds"], check["bytes"]
            t, algbw = summary(s * 1e6 for s in seconds), summary(size / s / 1e9 for s in seconds)
            busbw = summary(bus_bandwidth(size, s, args.nproc) / 1e9 for s in seconds)
            rows.append(dict(bytes=size, iterations=check["iterations"], time_us=t, algbw_GBps=algbw, busbw_GBps=busbw))
            table.append({"size": _human(size), "count": size // 4, "time us": f"{t['median']:.1f}",
                          "min": f"{t['min']:.1f}", "max": f"{t['max']:.1f}", "algbw GB/s": f"{algbw['median']:.3f}",
                          "busbw GB/s": f"{busbw['median']:.3f}"})
        print(f"all-reduce (sum, float32), backend {backend}, {args.nproc} processes, "
              "busbw = size/time x 2(n-1)/n, the slowest rank's time")
        print_table(table)
        params = dict(backend=backend, nproc=args.nproc, dtype="float32", op="sum", sizes=sizes,
                      iterations=args.iters or "auto (~50 ms per repeat)", repeats=args.repeats,
                      device=accelerator.gpu_type() if backend != "gloo" else "cpu")
        path = append_result(args.results_dir, "allreduce", command, params,
                             dict(busbw_GBps=rows[-1]["busbw_GBps"], at_bytes=rows[-1]["bytes"], sizes=rows))
        print(f"appended to {path}")
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024


# ----------------------------------------------------------------------------------------------------- scaling
def scaling_table(points: list[dict]) -> list[dict]:
    """Speed-up and efficiency from (nproc, samples/s) points; the first point (usually 1 process) is the base.
    Weak scaling (fixed batch per process) and strong scaling (fixed global batch) both compare throughput:
    at a fixed global batch, time per epoch is inversely proportional to it."""
    base = points[0]
    rows = []
    for p in points:
        speedup = p["samples_per_second"] / base["samples_per_second"]
        rows.append(dict(p, speedup=speedup, efficiency=speedup * base["nproc"] / p["nproc"]))
    return rows


def breakdown(compute_s: float, ddp_synthetic_s: float, ddp_real_s: float) -> dict:
    """Where a step's time goes, from three runs of the same step: compute (no communication, synthetic data),
    communication (DDP minus compute), data loading (real minus synthetic data). Differences of noisy medians
    can come out slightly negative: that means 'too small to see here'."""
    return dict(step_s=ddp_real_s, compute_s=compute_s, communication_s=ddp_synthetic_s - compute_s,
                data_loading_s=ddp_real_s - ddp_synthetic_s)


def nproc_ladder(max_nproc: int) -> list[int]:
    """1, 2, 4, ... up to max_nproc, and max_nproc itself."""
    ladder = [n for n in (2 ** k for k in range(32)) if n < max_nproc]
    return ladder + [max_nproc]


def scaling(args, command: list) -> int:
    cfg = base_config(args)
    model, precision = args.model or cfg.model, args.precision or cfg.precision
    batch = args.batch_size or cfg.batch_size
    cfg = cfg.replace(model=model, precision=precision, batch_size=batch)  # validates model and batch
    nprocs = nproc_ladder(args.max_nproc or available_processes("gloo")[0])
    if "strong" in args.mode and any(batch % n for n in nprocs):
        raise BenchError(f"strong scaling splits --batch-size {batch} over {nprocs} processes: "
                         "choose a batch size they all divide")
    for n in nprocs:
        check_point(Point(args.strategy, precision, model, batch, n))
    device = "GPU" if accelerator.device_count() else f"CPU core, {args.threads or 'cores / nproc'} thread(s) each"
    for mode in args.mode:
        # The sweep itself, and for the weak breakdown the same step without communication and with the real data.
        kinds = dict(sweep={}, compute=dict(independent=True), real=dict(data="real")) \
            if args.breakdown and mode == "weak" else dict(sweep={})
        points = {(n, kind): Point(args.strategy, precision, model, batch if mode == "weak" else batch // n, n, **extra)
                  for n in nprocs for kind, extra in kinds.items()}
        runs = dict(zip(points, run_points(list(points.values()), cfg, args)))
        steps = {key: run["step_seconds"] for key, run in runs.items()}
        rows = scaling_table([dict(nproc=n, batch_size=points[n, "sweep"].batch_size,
                                   global_batch_size=points[n, "sweep"].batch_size * n,
                                   samples_per_second=runs[n, "sweep"]["samples_per_second"]["median"],
                                   samples_per_second_summary=runs[n, "sweep"]["samples_per_second"],
                                   step_seconds=steps[n, "sweep"]) for n in nprocs])
        parts = [dict(nproc=n, **breakdown(steps[n, "compute"]["median"], steps[n, "sweep"]["median"],
                                           steps[n, "real"]["median"]),
                      compute_summary=steps[n, "compute"], real_data_summary=steps[n, "real"])
                 for n in nprocs if "compute" in kinds]
        print(f"\n{mode} scaling, {args.strategy}, {model} {precision}, "
              f"{'batch %d per process' % batch if mode == 'weak' else 'global batch %d' % batch}, "
              f"one process per {device}")
        print_table([{"nproc": r["nproc"], "batch/proc": r["batch_size"], "global": r["global_batch_size"],
                      "samples/s": f"{r['samples_per_second']:.1f}", "speed-up": f"{r['speedup']:.2f}",
                      "efficiency": f"{r['efficiency']:.0%}", "step ms": f"{r['step_seconds']['median'] * 1000:.2f}"}
                     for r in rows])
        if parts:
            print(f"\nwhere a step's time goes ({cfg.dataset} as the real data)")
            print_table([{"nproc": p["nproc"], "step ms": f"{p['step_s'] * 1000:.2f}",
                          "compute": _share(p["compute_s"], p["step_s"]),
                          "communication": _share(p["communication_s"], p["step_s"]),
                          "data loading": _share(p["data_loading_s"], p["step_s"])} for p in parts])
        params = dict(mode=mode, strategy=args.strategy, nprocs=nprocs, model=model, precision=precision,
                      batch_size=batch, batch_meaning="per process" if mode == "weak" else "global",
                      real_dataset=cfg.dataset, **_run_parameters(cfg, args))
        path = append_result(args.results_dir, "scaling", command, params,
                             dict(efficiency_at_max=rows[-1]["efficiency"], speedup_at_max=rows[-1]["speedup"],
                                  points=rows, breakdown=parts))
        print(f"appended to {path}")
    return 0


def _share(part: float, total: float) -> str:
    return f"{part * 1000:.2f} ms ({part / total:.0%})" if total else "-"

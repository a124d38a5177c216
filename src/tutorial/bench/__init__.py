"""Benchmarks for notebook 07_scaling_study: trainer throughput, all-reduce bandwidth, weak and strong scaling.

    tutorial bench train --strategy ddp --nproc 2 --preset smoke
    tutorial bench allreduce --backend gloo --nproc 2
    tutorial bench scaling --max-nproc 2

Every measurement is printed as a table and appended as one JSON line to results/<kind>.jsonl with the hardware,
the versions, the date and the exact command, so a number in a notebook or a slide can always be traced back.

How throughput is measured: the real trainers (`tutorial.train_<strategy>.main`) run unchanged. Two hooks on
`tracking.RunLog` (the loop calls `log.bar(loader)` when an epoch starts and `log.step()` after every optimizer
step) put a time stamp on each step boundary: a `perf_counter` on a CPU, a CUDA event on a GPU (recorded on the
stream, read after one synchronisation at the end, so the GPU's queue is never drained mid-run). The first
`--warmup` steps (allocator, cuDNN autotuning, torch.compile) are left out; each repeat is a fresh set of processes.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import io
import itertools
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ..core import tracking
from ..core.config import MODELS, PRECISIONS, PRESETS, ConfigError, TrainConfig
from ..core.process import exit_process

STRATEGIES = ("single", "dp", "ddp", "horovod")
BACKENDS = ("gloo", "nccl")
MODES = ("weak", "strong")
DATA = ("synthetic", "real")
# (channels, classes, image size) of each dataset, so synthetic data has the real data's shape and the model is the
# same one: a 1000-class head on a 10-class task would change the compute and the gradient size being measured.
SHAPES = {"digits": (1, 10, 8), "mnist": (1, 10, 28), "cifar10": (3, 10, 32), "imagefolder": (3, 1000, 224),
          "synthetic": (3, 1000, 224)}
OVERHEAD_GOAL = 1.03  # trainer step time / bare loop step time


class BenchError(ConfigError):
    """A bad benchmark option: one line on stderr, exit code 2."""


class RunFailed(RuntimeError):
    """A benchmark process failed or hung: one line on stderr, exit code 1."""


# ------------------------------------------------------------------------------------------------------ the record
def hardware() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() \
        else []
    return dict(cpu=cpu, cores=os.cpu_count(), usable_cores=usable_cores(), gpus=gpus, os=platform.platform())


def versions() -> dict:
    v = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda)
    if torch.cuda.is_available():
        v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    try:
        import horovod
        v["horovod"] = horovod.__version__
    except ImportError:
        pass
    return v


def summary(values) -> dict:
    """median, min, max and every repeat: the spread is part of the result."""
    values = [float(v) for v in values]
    return dict(median=statistics.median(values), min=min(values), max=max(values), repeats=values)


def append_result(results_dir, kind: str, command: list, parameters: dict, results: dict) -> Path:
    """One JSON line in results_dir/<kind>.jsonl; returns the file."""
    line = dict(kind=kind, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                hardware=hardware(), versions=versions(), command=list(command),
                # A busy machine slows every number down: the load average says how quiet it was.
                load_average=[round(x, 2) for x in os.getloadavg()],
                parameters=parameters, results=results)
    path = Path(results_dir) / f"{kind}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
    return path


def read_results(path, kind: str | None = None) -> list[dict]:
    """Every line of a results file (or of every *.jsonl in a folder), optionally of one kind."""
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    lines = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    return [line for line in lines if kind is None or line["kind"] == kind]


def bus_bandwidth(size_bytes: float, seconds: float, nproc: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce, in bytes/s: algbw x 2(n-1)/n. A ring all-reduce moves
    2(n-1)/n of the buffer over every link, so busbw is comparable with the link's peak whatever n is."""
    return size_bytes / seconds * 2 * (nproc - 1) / nproc


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def available_processes(backend: str) -> tuple[int, str]:
    """How many processes fit on this machine: one per GPU, or one per CPU core with gloo."""
    if backend == "nccl" or torch.cuda.is_available():
        return torch.cuda.device_count(), "GPUs"
    return usable_cores(), "CPU cores"


# ----------------------------------------------------------------------------------------------- timing one run
class StepTimer:
    """Time stamps at every epoch start and optimizer step, turned into per-step seconds and samples."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.marks = []  # (kind, stamp, batches per epoch, samples in the last batch, batch size)

    def _stamp(self):
        if self.cuda:  # an event on the current stream: no synchronisation now, exact GPU time later
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        # Beside the wall clock, this process's CPU time: on a shared machine it does not count the time other
        # programs had the core, so it resolves small differences (the trainer overhead) that wall time cannot.
        return time.perf_counter(), time.process_time()

    def epoch_start(self, loader) -> None:
        batches, batch = len(loader), loader.batch_size
        samples = len(loader.sampler) if loader.sampler is not None else len(loader.dataset)
        self.marks.append(("epoch", self._stamp(), batches, samples - (batches - 1) * batch, batch))

    def step(self) -> None:
        self.marks.append(("step", self._stamp()))

    def steps(self, warmup: int, clock: int = 0) -> tuple[list[float], list[int]]:
        """(seconds, samples) of every step after the first `warmup` steps, on this process. On a CPU, clock 1
        gives the process's CPU seconds instead of wall-clock seconds."""
        if self.cuda:
            torch.cuda.synchronize()
        seconds, samples, done, previous = [], [], 0, None
        for mark in self.marks:
            if mark[0] == "epoch":
                # The step after an epoch starts is timed from here: the end-of-epoch evaluation and checkpoint
                # are not training steps, but building the loader's iterator is part of loading data.
                previous, (_, _, batches, last, batch), index = mark[1], mark, 0
                continue
            index, done = index + 1, done + 1
            if done > warmup:
                seconds.append(previous.elapsed_time(mark[1]) / 1000 if self.cuda
                               else mark[1][clock] - previous[clock])
                samples.append(last if index == batches else batch)  # the last batch of an epoch may be short
            previous = mark[1]
        return seconds, samples


@contextlib.contextmanager
def timing_hooks(timer: StepTimer):
    """Let the trainers' own loop call the timer: wrap RunLog.bar (epoch start) and RunLog.step (step end)."""
    bar, step = tracking.RunLog.bar, tracking.RunLog.step

    def timed_bar(self, iterable, epoch):
        timer.epoch_start(iterable)
        return bar(self, iterable, epoch)

    def timed_step(self, *args, **kwargs):
        step(self, *args, **kwargs)
        timer.step()

    tracking.RunLog.bar, tracking.RunLog.step = timed_bar, timed_step
    try:
        yield timer
    finally:
        tracking.RunLog.bar, tracking.RunLog.step = bar, step


class SyntheticLike(Dataset):
    """Random images shaped like a real dataset (channels, classes, size): no decoding or disk I/O."""

    def __init__(self, size: int, channels: int, num_classes: int, image_size: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.images = torch.randn(16, channels, image_size, image_size, generator=gen)
        self.size, self.num_classes = size, num_classes

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return self.images[i % len(self.images)], i % self.num_classes


def data_shape(cfg: TrainConfig) -> tuple[int, int, int]:
    channels, classes, size = SHAPES[cfg.dataset]
    return channels, classes, cfg.image_size or size


@contextlib.contextmanager
def synthetic_data(module, cfg: TrainConfig, world_size: int):
    """Give the trainer synthetic data of the real data's shape, enough for max_steps in one epoch per rank."""
    from ..core.data import DataInfo
    channels, classes, size = data_shape(cfg)
    train_size = (cfg.max_steps + 1) * cfg.batch_size * cfg.grad_accum * world_size

    def build(_cfg):
        return (SyntheticLike(train_size, channels, classes, size),
                SyntheticLike(2 * cfg.batch_size, channels, classes, size, seed=1), DataInfo(channels, classes, size))

    original = module.build_datasets
    module.build_datasets = build
    try:
        yield
    finally:
        module.build_datasets = original


def measure_run(strategy: str, cfg: TrainConfig, warmup: int, steps: int, data: str = "synthetic",
                world_size: int = 1, verbose: bool = False) -> dict:
    """Run one trainer in this process (one rank of it) and time its steps. Called inside every benchmark process,
    and directly by benchmarks/bare_loop.py."""
    module = importlib.import_module(f"tutorial.train_{strategy}")
    # max_steps ends the run; epochs only has to be large enough not to end it first.
    cfg = cfg.replace(max_steps=warmup + steps, epochs=10 ** 6, progress=False, out="", resume="",
                      target_accuracy=0.0)
    timer = StepTimer()
    quiet = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
    feed = synthetic_data(module, cfg, world_size) if data == "synthetic" else contextlib.nullcontext()
    with timing_hooks(timer), feed, quiet:
        module.main(cfg)
    seconds, samples = timer.steps(warmup)
    cpu_seconds = None if timer.cuda else timer.steps(warmup, clock=1)[0]
    return dict(step_seconds=seconds, step_samples=samples, step_cpu_seconds=cpu_seconds,
                threads=torch.get_num_threads())


# -------------------------------------------------------------------------------------------------- launching
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _share_cores(nproc: int, threads: int = 0) -> None:
    """n processes on one CPU: each gets `threads` threads, by default its share of the cores (as torchrun's
    OMP_NUM_THREADS=1 intends), or they fight over them. Done for every strategy so that the no-communication runs
    compare fairly with DDP; OMP_NUM_THREADS tells the trainers' pick_device to leave the choice alone."""
    if torch.cuda.is_available():
        return
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, usable_cores() // nproc))


def _spawned(local_rank: int, fn, nproc: int, port: int, out_dir: str, job: dict) -> None:
    """One benchmark process: torchrun's variables, then fn(job). Rank 0 writes the result; any rank an error."""
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        result = fn(job, local_rank, nproc)
    except ConfigError as exc:  # bad data path and the like: the parent prints it as one line
        Path(out_dir, f"error-{local_rank}.txt").write_text(str(exc))
        raise SystemExit(2)
    except BaseException as exc:
        Path(out_dir, f"error-{local_rank}.txt").write_text(f"rank {local_rank}: {type(exc).__name__}: {exc}")
        raise
    if local_rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(result))
    exit_process(0)  # the result is on disk; skip the interpreter teardown that can abort after DDP on gloo


def launch(fn, job: dict, nproc: int, timeout: float = 600, verbose: bool = False):
    """Run fn(job, rank, nproc) in nproc fresh processes and return rank 0's result. Every process is stopped
    before this returns, whether the run succeeded, failed, hung or was interrupted."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException, ProcessExitedException
    with tempfile.TemporaryDirectory(prefix="tutorial-bench-") as out_dir:
        ctx = mp.start_processes(_spawned, args=(fn, nproc, _free_port(), out_dir, job), nprocs=nproc,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.5):
                if time.monotonic() > deadline:
                    raise RunFailed(f"a benchmark run did not finish within {timeout:.0f} s (raise --timeout?)")
        except ProcessException as exc:
            # The rank that failed first tells the cause; the others only saw their partner go away.
            first = Path(out_dir, f"error-{exc.error_index}.txt")
            errors = [first] if first.exists() else sorted(Path(out_dir).glob("error-*.txt"))
            message = errors[0].read_text() if errors else str(exc).strip().splitlines()[-1]
            if verbose:
                print(exc, file=sys.stderr)
            if isinstance(exc, ProcessExitedException) and exc.exit_code == 2 and errors:
                raise BenchError(message) from None
            raise RunFailed(message) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join()
        return json.loads(Path(out_dir, "result.json").read_text())


def launch_horovod(fn, job: dict, nproc: int, verbose: bool = False):
    """Horovod ranks come from its own launcher (horovod.run with gloo, as horovodrun -np N --gloo)."""
    import horovod
    quiet = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
    try:
        with quiet:
            results = horovod.run(_horovod_rank, args=(fn, job, nproc), np=nproc, hosts=f"localhost:{nproc}",
                                  use_gloo=True, verbose=0)
    except Exception as exc:  # noqa: BLE001 - horovod.run wraps any rank's failure; report its first line
        lines = str(exc).strip().splitlines()
        raise RunFailed(f"horovod run failed: {lines[0] if lines else type(exc).__name__}") from None
    return results[0]


def _horovod_rank(fn, job, nproc):
    import horovod.torch as hvd
    hvd.init()
    return fn(job, hvd.rank(), nproc)


# ------------------------------------------------------------------------------------------------------- train
@dataclass
class Point:
    """One grid point of `bench train`: which trainer, on what, how many processes."""
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


def _train_job(job: dict, rank: int, nproc: int) -> dict:
    _share_cores(nproc, job["threads"])
    cfg = TrainConfig(**job["cfg"])
    world = 1 if job["independent"] else nproc
    result = measure_run(job["strategy"], cfg, job["warmup"], job["steps"], job["data"], world,
                         verbose=job["verbose"] and rank == 0)
    return result


def run_points(points: list[Point], cfg: TrainConfig, args) -> list[dict]:
    """`repeats` runs of every point, each run in fresh processes; throughput over all ranks. The repeats go
    round the points (1, 2, 3, 1, 2, 3, ...) so that a change in the machine's load hits every point alike."""
    jobs, raw = [], [dict(throughputs=[], step_seconds=[], threads=0) for _ in points]
    for point in points:
        c = cfg.replace(model=point.model, precision=point.precision, batch_size=point.batch_size)
        jobs.append(dict(strategy="single" if point.independent else point.strategy, cfg=c.to_dict(), data=point.data,
                         warmup=args.warmup, steps=args.steps, independent=point.independent,
                         verbose=args.verbose, threads=args.threads))
    for repeat in range(args.repeats):
        for point, job, acc in zip(points, jobs, raw):
            print(f"run {repeat + 1}/{args.repeats}: {point.label} x{point.nproc} {point.model} {point.precision} "
                  f"batch {point.batch_size}/process, {point.data} data, {args.warmup}+{args.steps} steps",
                  file=sys.stderr, flush=True)
            if point.strategy == "horovod" and not point.independent:
                run = launch_horovod(_train_job, job, point.nproc, args.verbose)
            else:
                run = launch(_train_job, job, point.nproc, args.timeout, args.verbose)
            # Every rank processes its own batch in the same step (dp: one process splits one batch).
            ranks = 1 if point.strategy == "dp" else point.nproc
            acc["throughputs"].append(sum(run["step_samples"]) * ranks / sum(run["step_seconds"]))
            acc["step_seconds"].append(statistics.median(run["step_seconds"]))
            acc["threads"] = run["threads"]
    return [dict(samples_per_second=summary(a["throughputs"]), step_seconds=summary(a["step_seconds"]),
                 threads_per_process=a["threads"]) for a in raw]


def point_parameters(point: Point, cfg: TrainConfig, args) -> dict:
    channels, classes, size = data_shape(cfg)
    ranks = 1 if point.strategy == "dp" else point.nproc
    dataset = f"synthetic {channels}x{size}x{size}, {classes} classes" if point.data == "synthetic" else cfg.dataset
    return dict(strategy=point.label, nproc=point.nproc, precision=point.precision, model=point.model,
                batch_size=point.batch_size, global_batch_size=point.batch_size * ranks, data=point.data,
                dataset=dataset, channels_last=cfg.channels_last, compile=cfg.compile, workers=cfg.workers,
                preset=cfg.preset_name, device="cuda" if torch.cuda.is_available() else "cpu",
                threads_per_process=args.threads or "cores / nproc", warmup_steps=args.warmup,
                measured_steps=args.steps, repeats=args.repeats)


def check_point(point: Point) -> None:
    """Refuse what cannot run here before starting anything."""
    available, what = available_processes("gloo")
    if point.nproc > available:
        raise BenchError(f"--nproc {point.nproc} is more than the {available} {what} of this machine")
    if point.strategy in ("single", "dp") and point.nproc != 1 and not point.independent:
        raise BenchError(f"strategy {point.strategy} runs one process, got --nproc {point.nproc} "
                         "(use ddp or horovod for more)")
    if point.precision == "fp16" and not torch.cuda.is_available():
        raise BenchError("precision fp16 needs a CUDA GPU; use bf16 or fp32 here")
    if point.strategy == "horovod":
        try:
            import horovod.torch  # noqa: F401
        except ImportError:
            raise BenchError("strategy horovod needs Horovod built with PyTorch (bash scripts/install_horovod.sh)") \
                from None


def base_config(args) -> TrainConfig:
    overrides = {name: getattr(args, name) for name in ("image_size", "workers", "data_dir", "channels_last",
                                                        "compile", "dataset") if getattr(args, name) is not None}
    # A benchmark measures steps, so no lr warm-up or accuracy target changes what a step does.
    return TrainConfig.preset(args.preset, **overrides)


def train(argv) -> int:
    parser = _parser("tutorial bench train", "Throughput (samples/s) of the trainers over a grid of settings; "
                     "lists are comma-separated and every combination is measured.")
    parser.add_argument("--strategy", type=_choices(STRATEGIES), default=["single"],
                        help=f"trainers: {','.join(STRATEGIES)} (default single)")
    parser.add_argument("--precision", type=_choices(PRECISIONS), help="default: the preset's")
    parser.add_argument("--model", type=_choices(MODELS),
                        help="default: the preset's")
    parser.add_argument("--batch-size", type=_ints, help="per process; default: the preset's")
    parser.add_argument("--nproc", type=_ints, default=[1], help="processes (world size); default 1")
    parser.add_argument("--data", choices=DATA, default="synthetic",
                        help="synthetic images shaped like the preset's dataset (default), or the real data")
    _common_train_flags(parser)
    args = parser.parse_args(argv)
    _check_steps(args)
    cfg = base_config(args)
    points = [Point(*values, data=args.data) for values in itertools.product(
        args.strategy, args.precision or [cfg.precision], args.model or [cfg.model],
        args.batch_size or [cfg.batch_size], args.nproc)]
    points = _drop_one_process_strategies(points, given=len(args.strategy) > 1 or len(args.nproc) > 1)
    for point in points:
        check_point(point)
        cfg.replace(model=point.model, precision=point.precision, batch_size=point.batch_size)  # validates
    command = ["tutorial", "bench", "train", *argv]
    rows = []
    for point, results in zip(points, run_points(points, cfg, args)):
        params = point_parameters(point, cfg, args)
        path = append_result(args.results_dir, "train", command, params, results)
        rows.append(_train_row(params, results))
    print(_table(TRAIN_HEADERS, rows))
    print(f"appended {len(rows)} line(s) to {path}")
    return 0


TRAIN_HEADERS = ("strategy", "nproc", "model", "precision", "batch", "global", "samples/s", "min", "max",
                 "spread", "step ms")


def _train_row(params: dict, results: dict) -> list:
    sps = results["samples_per_second"]
    spread = (sps["max"] - sps["min"]) / sps["median"] * 100
    return [params["strategy"], params["nproc"], params["model"], params["precision"], params["batch_size"],
            params["global_batch_size"], f"{sps['median']:.0f}", f"{sps['min']:.0f}", f"{sps['max']:.0f}",
            f"{spread:.1f}%", f"{results['step_seconds']['median'] * 1000:.2f}"]


def _drop_one_process_strategies(points, given: bool):
    """In a grid, single and dp only make sense at one process: skip their other sizes instead of failing."""
    if not given:
        return points
    kept = [p for p in points if p.strategy not in ("single", "dp") or p.nproc == 1]
    for p in points:
        if p not in kept:
            print(f"skipping {p.strategy} x{p.nproc}: {p.strategy} runs one process", file=sys.stderr)
    if not kept:
        raise BenchError("no grid point left: single and dp run one process (use ddp or horovod for --nproc > 1)")
    return kept


# --------------------------------------------------------------------------------------------------- allreduce
def _allreduce_job(job: dict, rank: int, nproc: int) -> dict:
    import torch.distributed as dist
    backend = job["backend"]
    if backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        _share_cores(nproc)
    dist.init_process_group(backend, rank=rank, world_size=nproc)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    try:
        rows = []
        for size in job["sizes"]:
            count = max(1, size // 4)
            check = torch.full((count,), float(rank + 1), device=device)
            dist.all_reduce(check)  # also the first warm-up: correct before fast
            if not torch.all(check == nproc * (nproc + 1) / 2):
                raise RuntimeError(f"all-reduce of {size} bytes gave a wrong sum")
            buf = torch.zeros(count, device=device)  # zeros stay zeros: no overflow however often it is summed
            for _ in range(job["warmup"]):
                dist.all_reduce(buf)
            # Enough iterations for about 50 ms per repeat; every rank must agree on the count.
            sync()
            start = time.perf_counter()
            dist.all_reduce(buf)
            sync()
            guess = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(guess, op=dist.ReduceOp.MAX)
            iters = job["iters"] or int(min(1000, max(5, 0.05 / max(guess.item(), 1e-7))))
            times = []
            for _ in range(job["repeats"]):
                dist.barrier()
                sync()
                start = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(buf)
                sync()
                # The collective is as slow as its slowest rank.
                t = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times.append(t.item())
            rows.append(dict(bytes=count * 4, iterations=iters, seconds=times))
        return dict(rows=rows)
    finally:
        dist.destroy_process_group()


def allreduce(argv) -> int:
    parser = _parser("tutorial bench allreduce", "All-reduce time and bus bandwidth over message sizes "
                     "(nccl-tests' busbw = size/time x 2(n-1)/n).")
    parser.add_argument("--backend", type=_choices(BACKENDS), default=None,
                        help="gloo and/or nccl (default: nccl with GPUs, else gloo)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--min-bytes", type=_bytes, default=1024, help="smallest message (default 1K)")
    parser.add_argument("--max-bytes", type=_bytes, default=None, help="largest message (default 64M CPU, 1G GPU)")
    parser.add_argument("--factor", type=int, default=4, help="size step (default x4)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed all-reduces per size (default 5)")
    parser.add_argument("--iters", type=int, default=0, help="timed all-reduces per repeat (default: ~50 ms worth)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per size (default 5)")
    _output_flags(parser)
    args = parser.parse_args(argv)
    backends = args.backend or ["nccl" if torch.cuda.is_available() else "gloo"]
    max_bytes = args.max_bytes or (2 ** 30 if torch.cuda.is_available() else 64 * 2 ** 20)
    if args.nproc < 2:
        raise BenchError(f"an all-reduce needs at least 2 processes, got --nproc {args.nproc}")
    if args.repeats < 1 or args.warmup < 0 or args.iters < 0:
        raise BenchError("--repeats must be at least 1, --warmup and --iters 0 or more")
    if args.factor < 2 or args.min_bytes < 4 or args.min_bytes > max_bytes:
        raise BenchError("sizes: need 4 <= --min-bytes <= --max-bytes and --factor >= 2")
    for backend in backends:
        if backend == "nccl" and not torch.cuda.is_available():
            raise BenchError("backend nccl needs CUDA GPUs; this machine has none (use --backend gloo)")
        available, what = (torch.cuda.device_count(), "GPUs") if backend == "nccl" else (usable_cores(), "CPU cores")
        if args.nproc > available:
            raise BenchError(f"--nproc {args.nproc} is more than the {available} {what} of this machine")
    sizes = []
    size = args.min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= args.factor
    command = ["tutorial", "bench", "allreduce", *argv]
    for backend in backends:
        job = dict(backend=backend, sizes=sizes, warmup=args.warmup, iters=args.iters, repeats=args.repeats)
        run = launch(_allreduce_job, job, args.nproc, args.timeout, args.verbose)
        rows, table = [], []
        for r in run["rows"]:
            busbw = [bus_bandwidth(r["bytes"], s, args.nproc) / 1e9 for s in r["seconds"]]
            algbw = [r["bytes"] / s / 1e9 for s in r["seconds"]]
            t = summary([s * 1e6 for s in r["seconds"]])
            rows.append(dict(bytes=r["bytes"], iterations=r["iterations"], time_us=t, algbw_GBps=summary(algbw),
                             busbw_GBps=summary(busbw)))
            table.append([_human(r["bytes"]), r["bytes"] // 4, f"{t['median']:.1f}", f"{t['min']:.1f}",
                          f"{t['max']:.1f}", f"{statistics.median(algbw):.3f}", f"{statistics.median(busbw):.3f}"])
        print(f"all-reduce (sum, float32), backend {backend}, {args.nproc} processes, "
              f"busbw = size/time x 2(n-1)/n")
        print(_table(("size", "count", "time us", "min", "max", "algbw GB/s", "busbw GB/s"), table))
        params = dict(backend=backend, nproc=args.nproc, dtype="float32", op="sum", sizes=sizes, warmup=args.warmup,
                      iterations=args.iters or "auto (~50 ms per repeat)", repeats=args.repeats,
                      device="cuda" if backend == "nccl" else "cpu")
        largest = rows[-1]
        path = append_result(args.results_dir, "allreduce", command, params,
                             dict(busbw_GBps=largest["busbw_GBps"], at_bytes=largest["bytes"], sizes=rows))
        print(f"appended to {path}")
    return 0


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


def scaling(argv) -> int:
    parser = _parser("tutorial bench scaling", "Weak and strong scaling over 1..N processes, speed-up, efficiency "
                     "and where the time goes (compute, communication, data loading).")
    parser.add_argument("--strategy", choices=("ddp", "horovod"), default="ddp", help="default ddp")
    parser.add_argument("--mode", type=_choices(MODES), default=list(MODES), help="weak,strong (default both)")
    parser.add_argument("--max-nproc", type=int, default=None,
                        help="largest world size (default: all GPUs, or all CPU cores with gloo)")
    parser.add_argument("--model", help="default: the preset's")
    parser.add_argument("--precision", choices=PRECISIONS, help="default: the preset's")
    parser.add_argument("--batch-size", type=int,
                        help="weak: per process; strong: global, split over the processes (default: the preset's)")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                        help="skip the compute / communication / data loading runs")
    # One core per process, whatever the number of processes: the CPU version of one GPU per process, so the
    # speed-up measures distribution, not threads against processes (and stays sane on a shared machine).
    _common_train_flags(parser, threads_default=1)
    args = parser.parse_args(argv)
    _check_steps(args)
    cfg = base_config(args)
    available, what = available_processes("gloo")
    max_nproc = args.max_nproc or available
    if max_nproc < 1 or max_nproc > available:
        raise BenchError(f"--max-nproc {max_nproc} must be between 1 and the {available} {what} of this machine")
    model, precision = args.model or cfg.model, args.precision or cfg.precision
    batch = args.batch_size or cfg.batch_size
    cfg = cfg.replace(model=model, precision=precision, batch_size=batch)  # validates model and batch
    nprocs = nproc_ladder(max_nproc)
    if "strong" in args.mode and any(batch % n for n in nprocs):
        raise BenchError(f"strong scaling splits --batch-size {batch} over {nprocs} processes: "
                         "choose a batch size they all divide")
    for n in nprocs:
        check_point(Point(args.strategy, precision, model, batch, n))
    command = ["tutorial", "bench", "scaling", *argv]
    device = "GPU" if torch.cuda.is_available() else \
        f"CPU core, {args.threads or 'cores / nproc'} thread(s) each"

    for mode in args.mode:
        def point(n, data="synthetic", independent=False):
            per_process = batch if mode == "weak" else batch // n
            return Point(args.strategy, precision, model, per_process, n, data=data, independent=independent)

        sweep = [point(n) for n in nprocs]
        extra = [point(n, **kind) for n in nprocs for kind in (dict(independent=True), dict(data="real"))] \
            if args.breakdown and mode == "weak" else []
        measured = run_points(sweep + extra, cfg, args)
        runs = dict(zip(nprocs, measured))
        points = [dict(nproc=p.nproc, batch_size=p.batch_size, global_batch_size=p.batch_size * p.nproc,
                       samples_per_second=r["samples_per_second"]["median"],
                       samples_per_second_summary=r["samples_per_second"], step_seconds=r["step_seconds"])
                  for p, r in zip(sweep, measured)]
        rows = scaling_table(points)
        parts = []
        for i, n in enumerate(nprocs if extra else []):
            compute, real = measured[len(sweep) + 2 * i], measured[len(sweep) + 2 * i + 1]
            parts.append(dict(nproc=n, **breakdown(compute["step_seconds"]["median"], runs[n]["step_seconds"]["median"],
                                                   real["step_seconds"]["median"]),
                              compute_summary=compute["step_seconds"], real_data_summary=real["step_seconds"]))
        print(f"\n{mode} scaling, {args.strategy}, {model} {precision}, "
              f"{'batch %d per process' % batch if mode == 'weak' else 'global batch %d' % batch}, "
              f"one process per {device}")
        print(_table(("nproc", "batch/proc", "global", "samples/s", "speed-up", "efficiency", "step ms"),
                     [[r["nproc"], r["batch_size"], r["global_batch_size"], f"{r['samples_per_second']:.0f}",
                       f"{r['speedup']:.2f}", f"{r['efficiency'] * 100:.0f}%",
                       f"{r['step_seconds']['median'] * 1000:.2f}"] for r in rows]))
        if parts:
            print(f"\nwhere a step's time goes ({cfg.dataset} as the real data)")
            print(_table(("nproc", "step ms", "compute", "communication", "data loading"),
                         [[p["nproc"], f"{p['step_s'] * 1000:.2f}", _share(p["compute_s"], p["step_s"]),
                           _share(p["communication_s"], p["step_s"]), _share(p["data_loading_s"], p["step_s"])]
                          for p in parts]))
        params = dict(mode=mode, strategy=args.strategy, nprocs=nprocs, model=model, precision=precision,
                      batch_size=batch, batch_meaning="per process" if mode == "weak" else "global",
                      real_dataset=cfg.dataset, preset=cfg.preset_name, channels_last=cfg.channels_last,
                      compile=cfg.compile, device="cuda" if torch.cuda.is_available() else "cpu",
                      threads_per_process=args.threads or "cores / nproc", warmup_steps=args.warmup,
                      measured_steps=args.steps, repeats=args.repeats)
        path = append_result(args.results_dir, "scaling", command, params,
                             dict(efficiency_at_max=rows[-1]["efficiency"], speedup_at_max=rows[-1]["speedup"],
                                  points=rows, breakdown=parts))
        print(f"appended to {path}")
    return 0


# ------------------------------------------------------------------------------------------------ CLI helpers
class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise BenchError(f"{message} (see {self.prog} --help)")


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    return _Parser(prog=prog, description=description)


def _output_flags(parser) -> None:
    parser.add_argument("--results-dir", default="results", help="where results/<kind>.jsonl is appended "
                                                                 "(default results)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one run may take (default 900)")
    parser.add_argument("--verbose", action="store_true", help="show the trainers' own output and tracebacks")


def _common_train_flags(parser, threads_default=None) -> None:
    parser.add_argument("--preset", default="smoke", choices=tuple(PRESETS),
                        help="starting point (default smoke)")
    parser.add_argument("--steps", type=int, default=30, help="measured optimizer steps per run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out at the start (default 5)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement, each in fresh processes "
                                                               "(default 3)")
    parser.add_argument("--dataset", help="the real data for --data real and the breakdown (default: the preset's)")
    parser.add_argument("--data-dir", help="where the real data is")
    parser.add_argument("--image-size", type=int, help="default: the dataset's")
    parser.add_argument("--workers", type=int, help="DataLoader workers per process (default: the preset's)")
    parser.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile the model (compilation falls in the warm-up steps)")
    parser.add_argument("--threads", type=int, default=0 if threads_default is None else threads_default,
                        help="CPU only: torch threads per process "
                             f"(default {threads_default or 'the cores shared out: cores / nproc'})")
    _output_flags(parser)


def _check_steps(args) -> None:
    if args.steps < 1:
        raise BenchError(f"--steps must be at least 1, got {args.steps}")
    if args.warmup < 0:
        raise BenchError(f"--warmup must be 0 or more, got {args.warmup}")
    if args.repeats < 1:
        raise BenchError(f"--repeats must be at least 1, got {args.repeats}")
    if args.threads < 0:
        raise BenchError(f"--threads must be 0 (automatic) or more, got {args.threads}")
    if any(n < 1 for n in getattr(args, "nproc", None) or [1]):
        raise BenchError(f"--nproc must be at least 1, got {min(args.nproc)}")


def _choices(allowed):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        for v in values:
            if v not in allowed:
                raise argparse.ArgumentTypeError(f"{v!r} is not one of: {', '.join(allowed)}")
        if not values:
            raise argparse.ArgumentTypeError("empty list")
        return values
    parse.__name__ = "list"
    return parse


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _bytes(text: str) -> int:
    units = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in units else ""
    try:
        return int(float(text[:len(text) - len(unit)]) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1024, 64K, 16M, 1G)") from None


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024


def _share(part: float, total: float) -> str:
    return f"{part * 1000:.2f} ms ({part / total * 100:.0f}%)" if total else "-"


def _table(headers, rows) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


COMMANDS = {"train": train, "allreduce": allreduce, "scaling": scaling}
USAGE = """usage: tutorial bench {train,allreduce,scaling} [options]

  train      throughput of a trainer over strategy x precision x model x batch x nproc
  allreduce  all-reduce time and bus bandwidth over message sizes (gloo, nccl)
  scaling    weak and strong scaling over 1..N processes, and where the time goes

Results are appended to results/<kind>.jsonl (--results-dir). See tutorial bench COMMAND --help."""


def main(argv=None) -> int:
    """`tutorial bench ...`: 0 on success, 2 for a bad option (one line on stderr), 1 when a run failed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"error: bench command {argv[0]!r} is not one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0


if __name__ == "__main__":
    sys.exit(main())

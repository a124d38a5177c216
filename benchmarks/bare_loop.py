"""Bare PyTorch training loops: the yardsticks for the trainers' overhead (notebook 07_scaling_study, issue 15).

`bare_loop()` uses no package code: a hand-written copy of the small CNN (or a torchvision ResNet), random images
shaped like the preset's data, a DataLoader and SGD, the few lines everyone writes first; with stage="ddp" or
"horovod" also the few lines each of those adds (tagged as in the trainers), the shortest correct loop of that stage.
Run as a script, it times these loops and the trainer of the same stage (`tutorial.train_<stage>`) on the same model,
data, batch and threads, alternately (ABBA) in the same processes, so a busy neighbour slows both alike, and appends
the ratio of their step times to results/overhead.jsonl. The goal: trainer step time <= 1.03 x the bare loop's.

    python benchmarks/bare_loop.py --threads 1                      # smoke: cnn, 1x8x8 digits-shaped images, batch 32
    python benchmarks/bare_loop.py --threads 1 --stage single,ddp,horovod --nproc 2
    python benchmarks/bare_loop.py --threads 1 --stage ddp,horovod --dataset synthetic --model resnet18 --batch-size 8
    python benchmarks/bare_loop.py --threads 1 --stage single,ddp --instructions --warmup 2 --steps 10

Times on a shared machine move by several per cent from run to run, so many ABBA runs are needed to resolve a 3 %
difference. --instructions counts instead: every process runs under valgrind's callgrind and the ratio is of the
instructions per step each side executes, which other programs on the machine do not change: what the trainer's code
adds (not what memory stalls or a neighbour cost; on a GPU the kernels are not counted at all, so use it on a CPU).
Single and DDP only: Horovod's main thread waits by polling, so its counts would measure waiting.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler

OVERHEAD_GOAL = 1.03  # trainer step time / bare loop step time


class RandomImages(Dataset):
    """What the package's synthetic data is: 16 fixed random images, cycled, with labels i % classes."""

    def __init__(self, size, channels, classes, image_size):
        self.images = torch.randn(16, channels, image_size, image_size, generator=torch.Generator().manual_seed(0))
        self.size, self.classes = size, classes

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        return self.images[i % 16], i % self.classes


def make_model(name, channels, classes, image_size):
    if name == "cnn":  # the same layers as tutorial.core.models.small_cnn, written out
        return nn.Sequential(
            nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
            nn.Linear(64 * 4 * 4, 128), nn.ReLU(),
            nn.Linear(128, classes),
        )
    import torchvision
    model = getattr(torchvision.models, name)(weights=None, num_classes=classes)
    if image_size < 64:  # small images keep their resolution, as in the package
        model.conv1 = nn.Conv2d(channels, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif channels != 3:
        model.conv1 = nn.Conv2d(channels, 64, 7, stride=2, padding=3, bias=False)
    return model


def bare_loop(stage="single", model="cnn", channels=1, classes=10, image_size=8, batch_size=32, lr=0.05,
              momentum=0.9, weight_decay=0.0, precision="fp32", channels_last=False, warmup=20, steps=200, seed=0):
    """(wall seconds, CPU seconds) of each step after the first `warmup` steps. The process's CPU seconds (CPU
    only; None on a GPU) do not count the time other programs had the cores. stage "ddp" runs in the process
    group (joined from torchrun's variables unless one exists), "horovod" after hvd.init()."""
    rank, size, local_rank = 0, 1, 0
    if stage == "ddp":  # DDP
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rank, size, local_rank = dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    if stage == "horovod":  # Horovod
        import horovod.torch as hvd
        hvd.init()
        rank, size, local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if torch.cuda.is_available() \
        else torch.device("cpu")
    torch.manual_seed(seed)
    data = RandomImages((warmup + steps + 1) * batch_size * size, channels, classes, image_size)
    sampler = RandomSampler(data, generator=torch.Generator().manual_seed(seed)) if stage == "single" \
        else DistributedSampler(data, size, rank, seed=seed)  # DDP, Horovod: each rank its share
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, pin_memory=device.type == "cuda")
    net = make_model(model, channels, classes, image_size).to(device)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    if stage == "ddp":  # DDP
        net = DDP(net, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    if stage == "horovod":  # Horovod
        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def stamp():  # a CUDA event is read after the run, so timing never drains the GPU's queue
        if device.type != "cuda":
            return time.perf_counter(), time.process_time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    stamps = [stamp()]
    net.train()
    for i, (X, y) in enumerate(loader):
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if channels_last:
            X = X.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(net(X), y)
        scaler.scale(loss).backward()
        if stage == "horovod" and scaler.is_enabled():  # Horovod: fp16 unscales the averaged gradients
            optimizer.synchronize()
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
        else:
            scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        stamps.append(stamp())
        if i + 1 == warmup + steps:
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1000 for a, b in zip(stamps[warmup:-1], stamps[warmup + 1:])], None
    pairs = list(zip(stamps[warmup:-1], stamps[warmup + 1:]))
    return [b[0] - a[0] for a, b in pairs], [b[1] - a[1] for a, b in pairs]


# --------------------------------------------------------------------- the comparison (this part uses the package)
def compare(argv=None) -> int:
    from tutorial import bench
    from tutorial.core.config import DATASETS, ConfigError, TrainConfig
    from tutorial.core.data import SHAPES

    parser = argparse.ArgumentParser(description="Trainer step time / bare loop step time, per stage, appended to "
                                                 "results/overhead.jsonl.")
    parser.add_argument("--stage", default="single", help="comma-separated: single, ddp, horovod (default single)")
    parser.add_argument("--nproc", type=int, default=2, help="processes of the ddp and horovod stages (default 2)")
    parser.add_argument("--preset", default="smoke", help="model, batch, lr and data shape (default smoke)")
    parser.add_argument("--dataset", choices=DATASETS, help="whose image shape (default: the preset's)")
    parser.add_argument("--model", help="default: the preset's")
    parser.add_argument("--batch-size", type=int, help="per process; default: the preset's")
    parser.add_argument("--image-size", type=int, help="default: the dataset's")
    parser.add_argument("--precision", help="default: the preset's")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per process (default: the cores "
                                                               "shared out)")
    parser.add_argument("--warmup", type=int, default=20, help="steps left out at the start (default 20)")
    parser.add_argument("--steps", type=int, default=100, help="measured steps per run (default 100)")
    parser.add_argument("--repeats", type=int, default=10, help="runs of each, alternating (default 10)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds all runs of one stage may take")
    parser.add_argument("--calibrate", action="store_true", help="time the bare loop against itself (A/A): the "
                                                                  "spread and bias that noise alone gives")
    parser.add_argument("--instructions", action="store_true", help="count instructions per step under callgrind "
                                                                     "instead of timing (needs valgrind; slow: use "
                                                                     "--warmup 2 --steps 10)")
    parser.add_argument("--results-dir", default="results")
    args = parser.parse_args(argv)
    # The launched processes import this file as the module bare_loop (cloudpickle, which horovod.run uses, would
    # copy a function of __main__ with everything it refers to).
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    import bare_loop as this
    stages = [s.strip() for s in args.stage.split(",") if s.strip()]
    try:
        if args.steps < 1 or args.repeats < 1 or args.warmup < 0 or args.threads < 0:
            raise ConfigError("--steps and --repeats must be at least 1, --warmup and --threads 0 or more")
        if not stages or set(stages) - {"single", "ddp", "horovod"}:
            raise ConfigError(f"--stage {args.stage!r}: choose from single, ddp, horovod")
        overrides = {k: v for k, v in dict(dataset=args.dataset, model=args.model, batch_size=args.batch_size,
                                           image_size=args.image_size, precision=args.precision).items()
                     if v is not None}
        cfg = TrainConfig.preset(args.preset, synthetic=True, **overrides)
        if cfg.model == "cnn_bn" or cfg.grad_accum != 1 or cfg.clip_grad:
            raise ConfigError("the bare loop has no BatchNorm CNN, gradient accumulation or clipping")
        for stage in stages:
            nproc = 1 if stage == "single" else args.nproc
            if nproc > bench.available_processes("gloo")[0] or nproc < 1:
                raise ConfigError(f"--nproc {nproc} is not between 1 and the processes this machine fits")
        if args.instructions and not shutil.which("valgrind"):
            raise ConfigError("--instructions needs valgrind's callgrind: apt-get install valgrind")
        if args.instructions and torch.cuda.is_available():
            raise ConfigError("--instructions counts CPU instructions, not GPU kernels: time the stages on a GPU")
        if args.instructions and "horovod" in stages:
            raise ConfigError("--instructions counts single and ddp only: Horovod waits for its background thread by "
                              "polling (WaitAndClear spins on sched_yield), so its counts measure waiting, not work")
        if args.instructions and args.calibrate:
            raise ConfigError("--instructions needs no --calibrate: other programs do not change a count")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    info = SHAPES[cfg.dataset]
    size = cfg.image_size or info.image_size
    # The trainer's lr schedule at a constant peak does the same arithmetic; warm-up epochs do not change the cost.
    shape = dict(model=cfg.model, channels=info.in_channels, classes=info.num_classes, image_size=size,
                 batch_size=cfg.batch_size, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                 precision=cfg.precision, channels_last=cfg.channels_last)
    summary_lines = []
    for stage in stages:
        nproc = 1 if stage == "single" else args.nproc
        trainer = f"{stage}, bare loop against itself" if args.calibrate else stage
        job = dict(stage=stage, cfg=cfg.to_dict(), shape=shape, warmup=args.warmup, steps=args.steps,
                   repeats=args.repeats, threads=args.threads, calibrate=args.calibrate)
        try:
            if args.instructions:
                line, path = record_instructions(stage, job, nproc, args, argv, cfg)
                summary_lines.append(line)
                continue
            launch = bench.launch_horovod if stage == "horovod" else bench.launch
            print(f"{stage}: {args.repeats} runs of each, alternating, in {nproc} process(es)", flush=True)
            sides = launch(this._pairs, job, nproc, args.timeout)
        except ConfigError as exc:  # e.g. the real data is not there
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except RuntimeError as exc:  # a failed or timed-out run: its first failure in a few lines
            print(f"error: {stage}: {exc}", file=sys.stderr)
            return 1
        # Per run: the median step time (what a step costs; a step the OS preempted does not move it), the mean (what
        # throughput sees) and the fastest step (what a step costs when nothing else runs: the steadiest on a busy
        # machine). The ratio of medians is the overhead; the others are recorded beside it. With one thread, the
        # process's CPU time per step is what the step's code costs (plus the launcher's threads, e.g. Horovod's).
        ratio = {key: [t / b for t, b in zip(sides["trainer"][key], sides["bare"][key]) if b]
                 for key in ("median", "mean", "fastest", "cpu")}
        r = statistics.median(ratio["median"])
        medians = {side: statistics.median(sides[side]["median"]) * 1000 for side in ("bare", "trainer")}
        interval = bench.median_ci95(ratio["median"])
        ci = f"{interval[0]:.3f}-{interval[1]:.3f}" if interval else "n/a (under 6 runs)"
        line = (f"{trainer} x{nproc}: {'bare again' if args.calibrate else 'trainer'} {medians['trainer']:.3f} "
                f"ms/step, bare {medians['bare']:.3f} ms/step, ratio {r:.3f} (95 % CI {ci}, range "
                f"{min(ratio['median']):.3f}-{max(ratio['median']):.3f}) over {args.repeats} ABBA runs, fastest-step "
                f"ratio {statistics.median(ratio['fastest']):.3f}"
                + (f", CPU-time ratio {statistics.median(ratio['cpu']):.3f}" if ratio["cpu"] else "")
                + f": {'meets' if r <= OVERHEAD_GOAL else 'misses'} <= {OVERHEAD_GOAL}")
        print(line, flush=True)
        summary_lines.append(line)
        params = dict(shape, trainer=trainer, nproc=nproc, preset=cfg.preset_name, dataset=cfg.dataset,
                      threads=sides["threads"], device="cuda" if torch.cuda.is_available() else "cpu",
                      warmup_steps=args.warmup, measured_steps=args.steps, repeats=args.repeats,
                      order=f"ABBA in the same {nproc} process(es); rank 0's step times")
        results = dict(ratio=bench.summary(ratio["median"]), ratio_of_means=bench.summary(ratio["mean"]),
                       fastest_step_ratio=bench.summary(ratio["fastest"]), goal=OVERHEAD_GOAL,
                       meets_goal=r <= OVERHEAD_GOAL,
                       **{f"{side}_{key}_step_seconds": bench.summary(sides[side][key]) for side in ("bare", "trainer")
                          for key in ("median", "mean", "fastest", "cpu") if sides[side][key]})
        if ratio["cpu"]:
            results["cpu_time_ratio"] = bench.summary(ratio["cpu"])
        path = bench.append_result(args.results_dir, "overhead",
                                   ["python", "benchmarks/bare_loop.py", *(argv or [])], params, results)
    print(f"\n{cfg.model} {info.in_channels}x{size}x{size}, batch {cfg.batch_size} per process, {cfg.precision}, "
          f"{args.threads or 'default'} thread(s) per process, {'cuda' if torch.cuda.is_available() else 'cpu'}")
    print("\n".join(summary_lines))
    print(f"appended to {path}")
    return 0


def _pairs(job: dict, rank: int, nproc: int) -> dict:
    """In every process of a stage: the bare loop and the trainer alternately (ABBA: a slow drift of the machine's
    load hits both alike), in the same processes and process group. Rank 0's step times are returned."""
    from tutorial import bench
    from tutorial.core.config import TrainConfig
    stage, cfg = job["stage"], TrainConfig(**job["cfg"])
    if stage == "ddp":  # one process group for both sides, so that neither creates or destroys it
        import torch.distributed as dist
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    sides = {side: dict(median=[], mean=[], fastest=[], cpu=[]) for side in ("bare", "trainer")}
    for i in range(job["repeats"]):
        for side in ("bare", "trainer") if i % 2 == 0 else ("trainer", "bare"):
            if side == "bare" or job["calibrate"]:
                seconds, cpu = bare_loop(stage, **job["shape"], warmup=job["warmup"], steps=job["steps"])
            else:
                run = bench.measure_run(stage, cfg, job["warmup"], job["steps"])
                seconds, cpu = run["seconds"], run["cpu_seconds"]
            sides[side]["median"].append(statistics.median(seconds))
            sides[side]["mean"].append(statistics.mean(seconds))
            sides[side]["fastest"].append(min(seconds))
            if cpu:
                sides[side]["cpu"].append(statistics.median(cpu))
        if rank == 0:
            print(f"  run {i + 1}/{job['repeats']}: median step: bare {sides['bare']['median'][-1] * 1000:.3f} ms  "
                  f"trainer {sides['trainer']['median'][-1] * 1000:.3f} ms", flush=True)
    return dict(sides, threads=torch.get_num_threads())


# ----------------------------------------------------------------------- instructions per step, counted by callgrind
def record_instructions(stage, job, nproc, args, argv, cfg):
    """Run every process of the stage under callgrind (collection off until the worker turns it on), then read rank
    0's counts: per side, (instructions of warmup + 2n steps - those of warmup + n steps) / n, so set-up cancels.
    Only the main thread is counted (callgrind switches counting on per thread): the training loop's own work, not
    gloo's background threads; torch.distributed's waits sleep, so they add (almost) nothing."""
    from tutorial import bench
    from tutorial.launch import child_processes
    n = args.steps
    print(f"{stage}: instructions of {job['warmup']}+{n} and {job['warmup']}+{2 * n} steps of each, under callgrind "
          f"in {nproc} process(es) (a few hundred times slower than native: ~10 min at --steps 10)", flush=True)
    with tempfile.TemporaryDirectory(prefix="callgrind-") as tmp:
        with open(os.path.join(tmp, "job.json"), "w") as f:
            json.dump(dict(job, nproc=nproc), f)
        grind = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--separate-threads=yes",
                 f"--callgrind-out-file={tmp}/cg.%q{{RANK}}",
                 sys.executable, "-c", f"import bare_loop; bare_loop._count({os.path.join(tmp, 'job.json')!r})"]
        launcher = [] if stage == "single" else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                 "--nproc-per-node", str(nproc), "--no-python"]
        single = {"RANK": 0} if stage == "single" else {}  # the dumps are named by rank; torchrun sets it
        child_processes.launch(launcher + grind, timeout=args.timeout,
                         env=child_processes.launcher_env(threads=args.threads or 1, **single))
        c = [_callgrind_total(tmp, dump) for dump in (1, 2, 3, 4)]
    main = dict(bare=(c[1] - c[0]) / n, trainer=(c[3] - c[2]) / n)
    if min(main.values()) <= 0:
        raise RuntimeError(f"instructions per step came out as {main}: the longer runs must count more")
    ratio = main["trainer"] / main["bare"]
    line = (f"{stage} x{nproc}: trainer {main['trainer'] / 1e6:.3f} M instructions/step, bare {main['bare'] / 1e6:.3f} "
            f"M (rank 0's main thread), ratio {ratio:.4f}: {'meets' if ratio <= OVERHEAD_GOAL else 'misses'} <= "
            f"{OVERHEAD_GOAL}")
    print(line, flush=True)
    params = dict(job["shape"], trainer=stage, nproc=nproc, preset=cfg.preset_name, dataset=cfg.dataset,
                  threads=args.threads or 1, device="cpu", warmup_steps=job["warmup"], measured_steps=n,
                  measure="instructions per step (valgrind callgrind), rank 0's main thread; ((warmup + 2n steps) - "
                          "(warmup + n steps)) / n")
    results = dict(instruction_ratio=ratio, goal=OVERHEAD_GOAL, meets_goal=ratio <= OVERHEAD_GOAL,
                   instructions_per_step=main)
    path = bench.append_result(args.results_dir, "overhead", ["python", "benchmarks/bare_loop.py", *(argv or [])],
                               params, results)
    return line, path


def _callgrind_total(folder: str, dump: int) -> int:
    """The instructions in one dump of rank 0's main thread (thread 01)."""
    name = os.path.join(folder, f"cg.0.{dump}-01")
    if not os.path.exists(name):
        raise RuntimeError(f"callgrind wrote no dump {dump} for rank 0 in {folder}")
    with open(name) as f:
        return next(int(line.split()[1]) for line in f if line.startswith("totals:"))


def _count(job_file: str) -> None:
    """In every process, under callgrind: each side runs warmup + n and warmup + 2n steps, and torch's valgrind hooks
    turn counting on for exactly each run and write a dump after it (dumps 1, 2: bare loop; 3, 4: trainer)."""
    from tutorial import bench
    from tutorial.bench import runs
    from tutorial.core.config import TrainConfig
    with open(job_file) as f:
        job = json.load(f)
    stage, cfg, n = job["stage"], TrainConfig(**job["cfg"]), job["steps"]
    runs.share_cores(job["nproc"], job["threads"])
    if stage == "ddp":  # one process group for both sides, as in _pairs
        import torch.distributed as dist
        dist.init_process_group("gloo")
    # One uncounted run of each side first: the first run in a process also pays for lazy initialisation (oneDNN
    # compiling its kernels, first imports), which would land in the first count only.
    bare_loop(stage, **job["shape"], warmup=0, steps=1)
    bench.measure_run(stage, cfg, 0, 1)
    for side in ("bare", "trainer"):
        for steps in (n, 2 * n):
            torch._C._valgrind_toggle()
            if side == "bare":
                bare_loop(stage, **job["shape"], warmup=job["warmup"], steps=steps)
            else:
                bench.measure_run(stage, cfg, job["warmup"], steps)
            torch._C._valgrind_toggle_and_dump_stats()


if __name__ == "__main__":
    sys.exit(compare(sys.argv[1:]))

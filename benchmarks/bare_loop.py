"""A bare PyTorch training loop: the yardstick for the trainers' overhead (notebook 07_scaling_study).

`bare_loop()` uses no package code: a hand-written copy of the small CNN (or a torchvision ResNet), random images
shaped like the preset's data, a DataLoader and SGD, the few lines everyone writes first. Run as a script, it times
this loop and `tutorial.train_single` on the same model, data, batch and threads, alternately in one process (so a
busy neighbour slows both alike), and appends the ratio of their step times to results/overhead.jsonl.
The goal: trainer step time <= 1.03 x the bare loop's.

    python benchmarks/bare_loop.py                          # smoke preset: cnn, 1x8x8 digits-shaped images, batch 32
    python benchmarks/bare_loop.py --image-size 32          # a larger step, where fixed costs weigh less
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

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


def bare_loop(model="cnn", channels=1, classes=10, image_size=8, batch_size=32, lr=0.05, momentum=0.9,
              weight_decay=0.0, precision="fp32", channels_last=False, warmup=20, steps=200, seed=0):
    """(wall seconds, CPU seconds) of each step after the first `warmup` steps. The process's CPU seconds (CPU
    only; None on a GPU) do not count the time other programs had the cores."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    data = RandomImages((warmup + steps + 1) * batch_size, channels, classes, image_size)
    loader = DataLoader(data, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(seed),
                        pin_memory=device.type == "cuda")
    net = make_model(model, channels, classes, image_size).to(device)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
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
    from tutorial.core.config import ConfigError, TrainConfig
    from tutorial.core.data import SHAPES

    parser = argparse.ArgumentParser(description="Trainer step time / bare loop step time, appended to "
                                                 "results/overhead.jsonl.")
    parser.add_argument("--preset", default="smoke", help="model, batch, lr and data shape (default smoke)")
    parser.add_argument("--model", help="default: the preset's")
    parser.add_argument("--batch-size", type=int, help="default: the preset's")
    parser.add_argument("--image-size", type=int, help="default: the preset dataset's")
    parser.add_argument("--precision", help="default: the preset's")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--warmup", type=int, default=20, help="steps left out at the start (default 20)")
    parser.add_argument("--steps", type=int, default=100, help="measured steps per run (default 100)")
    parser.add_argument("--repeats", type=int, default=10, help="runs of each, alternating (default 10)")
    parser.add_argument("--results-dir", default="results")
    args = parser.parse_args(argv)
    try:
        if args.steps < 1 or args.repeats < 1 or args.warmup < 0:
            raise ConfigError("--steps and --repeats must be at least 1, --warmup 0 or more")
        overrides = {k: v for k, v in dict(model=args.model, batch_size=args.batch_size, image_size=args.image_size,
                                             precision=args.precision).items() if v is not None}
        cfg = TrainConfig.preset(args.preset, synthetic=True, **overrides)
        if cfg.model == "cnn_bn" or cfg.grad_accum != 1 or cfg.clip_grad:
            raise ConfigError("the bare loop has no BatchNorm CNN, gradient accumulation or clipping")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = SHAPES[cfg.dataset]
    channels, classes, size = shape.in_channels, shape.num_classes, cfg.image_size or shape.image_size
    # The trainer's lr schedule at a constant peak does the same arithmetic; warm-up epochs do not change the cost.
    shape = dict(model=cfg.model, channels=channels, classes=classes, image_size=size, batch_size=cfg.batch_size,
                 lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, precision=cfg.precision,
                 channels_last=cfg.channels_last)
    # Per run: the median step time (what a step costs; a step the OS preempted does not move it) and the mean
    # (what throughput sees). The ratio of medians is the overhead; the ratio of means is recorded beside it.
    # With one thread, the process's CPU time per step is what the step's code costs, however busy the machine.
    bare, trainer, bare_mean, trainer_mean, bare_cpu, trainer_cpu = [], [], [], [], [], []
    for i in range(args.repeats):
        # ABBA order: a slow drift of the machine's load hits both sides equally.
        order = ("bare", "trainer") if i % 2 == 0 else ("trainer", "bare")
        for which in order:
            if which == "bare":
                steps, cpu = bare_loop(**shape, warmup=args.warmup, steps=args.steps)
                side = (bare, bare_mean, bare_cpu)
            else:
                run = bench.measure_run("single", cfg, args.warmup, args.steps)
                steps, cpu, side = run["seconds"], run["cpu_seconds"], (trainer, trainer_mean, trainer_cpu)
            side[0].append(statistics.median(steps)), side[1].append(statistics.mean(steps))
            if cpu:
                side[2].append(statistics.median(cpu))
        print(f"run {i + 1}/{args.repeats}: median step: bare {bare[-1] * 1000:.3f} ms  trainer "
              f"{trainer[-1] * 1000:.3f} ms  ratio {trainer[-1] / bare[-1]:.3f}", flush=True)
    ratios = [t / b for t, b in zip(trainer, bare)]
    mean_ratios = [t / b for t, b in zip(trainer_mean, bare_mean)]
    cpu_ratios = [t / b for t, b in zip(trainer_cpu, bare_cpu) if b > 0]
    ratio = statistics.median(ratios)
    verdict = "meets" if ratio <= OVERHEAD_GOAL else "misses"
    print(f"\n{cfg.model} {channels}x{size}x{size}, batch {cfg.batch_size}, {cfg.precision}, "
          f"{torch.get_num_threads()} threads, {'cuda' if torch.cuda.is_available() else 'cpu'}")
    print(f"bare loop  {statistics.median(bare) * 1000:.3f} ms/step (median step, median of runs)")
    print(f"trainer    {statistics.median(trainer) * 1000:.3f} ms/step")
    print(f"ratio      {ratio:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}): {verdict} the goal "
          f"<= {OVERHEAD_GOAL}; ratio of mean step times {statistics.median(mean_ratios):.3f}")
    if cpu_ratios:
        note = "" if torch.get_num_threads() == 1 else " (several threads: CPU time adds theirs up, spinning included)"
        print(f"CPU time   bare {statistics.median(bare_cpu) * 1000:.3f} ms/step, trainer "
              f"{statistics.median(trainer_cpu) * 1000:.3f} ms/step, ratio {statistics.median(cpu_ratios):.3f} "
              f"(min {min(cpu_ratios):.3f}, max {max(cpu_ratios):.3f}){note}")
    params = dict(shape, trainer="single", preset=cfg.preset_name, threads=torch.get_num_threads(),
                  device="cuda" if torch.cuda.is_available() else "cpu", warmup_steps=args.warmup,
                  measured_steps=args.steps, repeats=args.repeats, order="ABBA, one process")
    path = bench.append_result(args.results_dir, "overhead", ["python", "benchmarks/bare_loop.py", *(argv or [])],
                               params, dict(ratio=bench.summary(ratios), bare_step_seconds=bench.summary(bare),
                                            trainer_step_seconds=bench.summary(trainer),
                                            ratio_of_means=bench.summary(mean_ratios),
                                            bare_mean_step_seconds=bench.summary(bare_mean),
                                            trainer_mean_step_seconds=bench.summary(trainer_mean),
                                            **(dict(cpu_time_ratio=bench.summary(cpu_ratios),
                                                    bare_cpu_step_seconds=bench.summary(bare_cpu),
                                                    trainer_cpu_step_seconds=bench.summary(trainer_cpu))
                                               if cpu_ratios else {}),
                                            goal=OVERHEAD_GOAL, meets_goal=ratio <= OVERHEAD_GOAL))
    print(f"appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(compare(sys.argv[1:]))

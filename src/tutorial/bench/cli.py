"""`tutorial bench train | allreduce | scaling`: argparse sub-commands that share their flags through parent parsers.
Every value is checked by its `type=` function, so a bad one is one line that names it and what is allowed (exit 2,
through the package's OneLineErrorParser, as every command line of the workbook)."""
from __future__ import annotations

import argparse
import sys

from ..core.config import DATASETS, MODELS, PRECISIONS, PRESETS, ConfigError, OneLineErrorParser
from .runs import RunFailed, available_processes
from .studies import allreduce, scaling, train

STRATEGIES = ("single", "dp", "ddp", "horovod")


def _int(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def _choice(allowed):
    def parse(text: str) -> str:
        if text not in allowed:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of: {', '.join(allowed)}")
        return text
    return parse


def _list(item):
    """A comma-separated list of values that `item` checks: every combination is measured."""
    def parse(text: str) -> list:
        values = [item(v.strip()) for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError("empty list")
        return values
    return parse


def _processes(text: str) -> int:
    value, (available, what) = _int(1)(text), available_processes("gloo")
    if value > available:
        raise argparse.ArgumentTypeError(f"{value} is more than the {available} {what} of this machine")
    return value


def _bytes(text: str) -> int:
    units = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
    number = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = number[-1] if number and number[-1] in units else ""
    try:
        value = int(float(number[:len(number) - len(unit)]) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1024, 64K, 16M, 1G)") from None
    if value < 4:
        raise argparse.ArgumentTypeError(f"{text!r} is less than one float32 (4 bytes)")
    return value


def _output_flags() -> argparse.ArgumentParser:
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--results-dir", default="results", help="where <kind>.jsonl is appended (default results)")
    flags.add_argument("--timeout", type=_int(1), default=900, help="seconds one run may take (default 900)")
    flags.add_argument("--verbose", action="store_true", help="show the trainers' and launchers' own output")
    return flags


def _run_flags(threads: int) -> argparse.ArgumentParser:
    """The flags of the studies that run trainers (a new parser each: argparse parents share their arguments)."""
    flags = argparse.ArgumentParser(add_help=False, parents=[_output_flags()])
    flags.add_argument("--preset", type=_choice(tuple(PRESETS)), default="smoke", help="starting point (default smoke)")
    flags.add_argument("--steps", type=_int(1), default=30, help="measured optimizer steps per run (default 30)")
    flags.add_argument("--warmup", type=_int(0), default=5, help="steps left out at the start (default 5)")
    flags.add_argument("--repeats", type=_int(1), default=3, help="runs per measurement, each in fresh processes "
                                                                  "(default 3)")
    flags.add_argument("--dataset", type=_choice(DATASETS), help="the real data for --data real and the breakdown "
                                                                 "(default: the preset's)")
    flags.add_argument("--data-dir", help="where the real data is")
    flags.add_argument("--image-size", type=_int(0), help="default: the dataset's")
    flags.add_argument("--workers", type=_int(0), help="DataLoader workers per process (default: the preset's)")
    flags.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None)
    flags.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="torch.compile the model (compilation falls in the warm-up steps)")
    flags.add_argument("--threads", type=_int(0), default=threads, help="CPU only: torch threads per process "
                       f"(default {threads or 'the cores shared out: cores / nproc'})")
    return flags


def parser() -> argparse.ArgumentParser:
    top = OneLineErrorParser(prog="tutorial bench", description="Benchmarks of notebook 07_scaling_study; every result is "
                  "appended to <results-dir>/<kind>.jsonl with the hardware, versions, command and date.")
    commands = top.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser("train", parents=[_run_flags(threads=0)], help="throughput of the trainers over a grid",
                              description="Throughput (samples/s) of the trainers over a grid of settings; lists are "
                              "comma-separated and every combination is measured.")
    cmd.add_argument("--strategy", type=_list(_choice(STRATEGIES)), default=["single"],
                     help=f"trainers: {','.join(STRATEGIES)} (default single)")
    cmd.add_argument("--precision", type=_list(_choice(PRECISIONS)), help="default: the preset's")
    cmd.add_argument("--model", type=_list(_choice(MODELS)), help="default: the preset's")
    cmd.add_argument("--batch-size", type=_list(_int(1)), help="per process; default: the preset's")
    cmd.add_argument("--nproc", type=_list(_processes), default=[1], help="processes (world size); default 1")
    cmd.add_argument("--data", type=_choice(("synthetic", "real")), default="synthetic",
                     help="synthetic images shaped like the preset's dataset (default), or the real data")
    cmd.set_defaults(study=train)

    cmd = commands.add_parser("allreduce", parents=[_output_flags()], help="all-reduce time and bus bandwidth",
                              description="All-reduce time and bus bandwidth over message sizes (nccl-tests' busbw = "
                              "size/time x 2(n-1)/n), the slowest rank's time.")
    cmd.add_argument("--backend", type=_list(_choice(("gloo", "nccl", "xccl"))),
                     help="gloo, nccl (NVIDIA, AMD) and/or xccl (Intel) (default: the GPUs' own, else gloo)")
    cmd.add_argument("--nproc", type=_int(2), default=2, help="processes (default 2)")
    cmd.add_argument("--min-bytes", type=_bytes, default=1024, help="smallest message (default 1K)")
    cmd.add_argument("--max-bytes", type=_bytes, help="largest message (default 64M CPU, 1G GPU)")
    cmd.add_argument("--factor", type=_int(2), default=4, help="size step (default x4)")
    cmd.add_argument("--iters", type=_int(0), default=0, help="all-reduces per timing (default: ~50 ms worth)")
    cmd.add_argument("--repeats", type=_int(1), default=5, help="timings per size (default 5)")
    cmd.set_defaults(study=allreduce)

    # scaling: one thread per process, whatever the number of processes: the CPU version of one GPU per process, so
    # the speed-up measures distribution, not threads against processes (and stays sane on a shared machine).
    cmd = commands.add_parser("scaling", parents=[_run_flags(threads=1)], help="weak and strong scaling",
                              description="Weak and strong scaling over 1..N processes, speed-up, efficiency and where "
                              "the time goes (compute, communication, data loading).")
    cmd.add_argument("--strategy", type=_choice(("ddp", "horovod")), default="ddp", help="default ddp")
    cmd.add_argument("--mode", type=_list(_choice(("weak", "strong"))), default=["weak", "strong"],
                     help="weak,strong (default both)")
    cmd.add_argument("--max-nproc", type=_processes, help="largest world size (default: all GPUs, or all CPU cores)")
    cmd.add_argument("--model", type=_choice(MODELS), help="default: the preset's")
    cmd.add_argument("--precision", type=_choice(PRECISIONS), help="default: the preset's")
    cmd.add_argument("--batch-size", type=_int(1),
                     help="weak: per process; strong: global, split over the processes (default: the preset's)")
    cmd.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                     help="skip the compute / communication / data loading runs")
    cmd.set_defaults(study=scaling)
    return top


def main(argv=None) -> int:
    """`tutorial bench ...`: 0 on success, 2 for a bad option (one line on stderr), 1 when a run failed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser().parse_args(argv)
        return args.study(args, ["tutorial", "bench", *argv])
    except (ConfigError, RunFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0

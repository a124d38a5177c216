"""The command line of `make gpu-check` (scripts/gpu_check.sh): python -m gpucheck --help."""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from tutorial.core.config import ConfigError
from . import __doc__ as ABOUT
from .plan import CHECKOUT, SETUP_SECONDS, STAGE_SECONDS, STAGES, Check, measured_seconds, plan
from .runner import execute_notebook, probe, run_stage


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.probe:
        return probe(args.rehearse)
    if args.execute_notebook:
        return execute_notebook(*args.execute_notebook)
    if args.stage not in STAGES:
        return refuse(f"--stage {args.stage}: choose one of {', '.join(map(str, STAGES))}")
    if args.gpus < 0 or (args.gpus and not args.list):
        return refuse(f"--gpus {args.gpus}: a number of GPUs of at least 1, with --list only (a run uses the GPUs it "
                      f"sees; CUDA_VISIBLE_DEVICES chooses them)")
    import torch
    from tutorial.launch.engines import visible_gpus
    gpus = args.gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    visible = [str(i) for i in range(args.gpus)] if args.gpus else (visible_gpus() or [str(i) for i in range(8)])
    if not gpus and not (args.list or args.rehearse):
        return refuse("no CUDA GPU is visible here (torch.cuda.is_available() is False); make gpu-check verifies the "
                      "GPU path and needs one (tutorial doctor says why torch sees none)")
    results = Path(args.results_dir)
    out = Path(tempfile.mkdtemp(prefix="tutorial-gpu-check-"))
    everything = plan(gpus, out, args.rehearse, visible, measured={} if args.rehearse else measured_seconds(results))
    todo = [c for c in everything if c.stage in (0, args.stage)]
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        todo = [c for c in everything if any(c.name.startswith(w) for w in wanted)]
        if not todo:
            shutil.rmtree(out, ignore_errors=True)
            return refuse(f"--only {args.only!r} matches no check (see --list)")
    if args.list:
        list_stage(todo)
        shutil.rmtree(out, ignore_errors=True)
        return 0
    return run_stage(todo, stage=args.stage, budget=args.budget, results=results, gpus=gpus, rehearse=args.rehearse,
                     out=out, command=["make", "gpu-check", *(argv if argv is not None else sys.argv[1:])])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="make gpu-check", description=ABOUT.split("\n\n")[0])
    p.add_argument("--stage", type=int, default=1, help=f"which stage: {', '.join(map(str, STAGES))} (default 1; "
                   "stages 1 and 2 fit one 15-minute allocation)")
    p.add_argument("--results-dir", default=str(CHECKOUT / "results"),
                   help="where gpu_check.jsonl and failed checks' notebooks and logs go (default results/)")
    p.add_argument("--only", default="", help="comma-separated check names (or prefixes) to run")
    p.add_argument("--list", action="store_true", help="print the stage's checks with estimates and exit")
    p.add_argument("--gpus", type=int, default=0,
                   help="with --list: the checks for a node with this many GPUs (default: the GPUs here)")
    p.add_argument("--budget", type=float, default=STAGE_SECONDS - SETUP_SECONDS,
                   help="seconds the stage may take; a check that does not fit is skipped (default %(default)s)")
    p.add_argument("--rehearse", action="store_true", help=argparse.SUPPRESS)  # make test: CPU, smoke sizes
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--execute-notebook", nargs=2, metavar=("NOTEBOOK", "EXECUTED"), help=argparse.SUPPRESS)
    return p


def list_stage(todo: list[Check]) -> None:
    print(f"{'check':<40} {'est. s':>6} {'timeout':>7}  (estimates: seconds on one H100, read from the code or "
          f"measured by an earlier run)")
    print(f"{'(setup: bundle install, torch report)':<40} {SETUP_SECONDS:>6}")
    for c in todo:
        print(f"{c.name:<40} {c.estimate:>6.0f} {c.timeout:>7.0f}")
    total = SETUP_SECONDS + sum(c.estimate for c in todo)
    print(f"{'total (estimate)':<40} {total:>6.0f}  = {total / 60:.1f} min of at most {STAGE_SECONDS / 60:.0f}")


def refuse(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

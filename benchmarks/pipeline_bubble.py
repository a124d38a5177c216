"""The pipeline bubble of 11_model_parallelism, measured: each stage's idle fraction of a step for GPipe and 1F1B
with m micro-batches, next to the formula (p-1)/(m+p-1), appended to results/pipeline_bubble.jsonl with the
hardware, versions, load and date (a timing, so a benchmark and not a unit test). Run it on a quiet machine:

    torchrun --standalone --nproc_per_node 2 benchmarks/pipeline_bubble.py [--micro-batches 2,4,8] [--steps 5]
"""
from __future__ import annotations

import argparse
import os
import sys

from tutorial.bench.record import append_result
from tutorial.core.parallel_config import ParallelConfig
from tutorial.lessons import model_parallel as mp


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", default="2,4,8", help="comma-separated counts (each divides 32)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per setting (the median counts)")
    parser.add_argument("--results-dir", default="results")
    args = parser.parse_args(argv)
    try:
        counts = tuple(int(m) for m in args.micro_batches.split(","))
    except ValueError:
        parser.exit(2, f"error: --micro-batches {args.micro_batches!r} is not a list of whole numbers\n")
    if args.steps < 1 or any(m < 1 or 32 % m for m in counts):
        parser.exit(2, f"error: --steps must be >= 1 and every micro-batch count must divide 32, got {args.steps} "
                       f"and {args.micro_batches}\n")
    cfg = ParallelConfig(batch_size=32, d_model=128, context=64)
    rank = int(os.environ.get("RANK", 0))
    rows = [mp.bubble(t) for t in mp.bubble_sweep(cfg, ("gpipe", "1f1b"), counts, args.steps)]  # joins and leaves
    if rank != 0:  # every timeline holds both stages' events: rank 0 reports
        return
    for r in rows:
        print(f"{r['schedule']:5} m={r['micro_batches']}: idle per stage {[round(x, 3) for x in r['idle']]}, "
              f"formula {r['formula']:.3f}, in flight {r['in_flight']}")
    path = append_result(args.results_dir, "pipeline_bubble", sys.argv, dict(stages=2, batch_size=32, d_model=128,
                                                                              context=64, steps=args.steps), dict(rows=rows))
    print(f"appended to {path}")


if __name__ == "__main__":
    main()

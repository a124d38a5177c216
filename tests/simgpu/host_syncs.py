"""Host syncs per training step of every trainer, on one simulated GPU (simgpu.SYNCS counts them).

    TUTORIAL_SIMGPU=1 PYTHONPATH=tests/simgpu python -m host_syncs [--stages single,ddp] [--results results]

A read of a GPU tensor's value on the host (loss.item(), a tolist, a print, a blocking .cpu()) waits for every kernel
queued before it: one per step keeps the GPU idle while Python catches up. The course's trainers read the loss only
every log_every steps (RunLog.step), as nanoGPT and torchtitan do. Each trainer runs twice in this process at world
size 1, for STEPS and 2 x STEPS optimizer steps with no log step inside them; the syncs that the second run adds,
per added step, are its syncs per training step: 0 is the goal. With --results, one JSON line per trainer is
appended to results/host_syncs.jsonl (date, hardware, versions, the callers of each sync).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile

STEPS = 4
# The trainers that run in one process at world size 1. Not here: Horovod's (its ranks come from MPI), Lightning's
# (its loop is Lightning's), DeepSpeed's (its own accelerator asks the driver, which the simulation is not), and
# tp, pp and 2d (2 ranks at least; train_gpt is their one-process parent).
STAGES = ("single", "dp", "ddp", "fsdp", "gpt")


def measure(main, cfg) -> dict:
    """{'per_step': syncs per added training step, 'callers': {caller kind: count} of the longer run}."""
    import dataclasses

    import simgpu
    counts = []
    for steps in (STEPS, 2 * STEPS):
        simgpu.reset_host_syncs()
        length = {"steps": steps} if hasattr(cfg, "steps") else {"max_steps": steps}  # ParallelConfig: train_gpt
        with tempfile.TemporaryDirectory(prefix="host_syncs_") as out:  # its checkpoint and logs: not kept
            main(dataclasses.replace(cfg, out=out, **length))
        counts.append({f"{where} {kind}": n for (where, kind), n in simgpu.host_syncs().items()
                       if where.startswith("tutorial")})
    added = {k: n - counts[0].get(k, 0) for k, n in counts[1].items() if n != counts[0].get(k, 0)}
    return dict(per_step=sum(added.values()) / STEPS, added=added, callers=counts[1])


def config(stage: str):
    from tutorial.core.config import TrainConfig
    if stage == "gpt":
        from tutorial.core.parallel_config import ParallelConfig
        return ParallelConfig(log_every=1000)  # its last step is a log step in both runs: none inside them
    return TrainConfig.preset("smoke").replace(epochs=1, log_every=1000, quiet=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--results", default="")
    args = parser.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        print(f"error: --stages {','.join(unknown)}: not one of {', '.join(STAGES)}", file=sys.stderr)
        return 2
    rows = []
    for stage in stages:
        found = measure(importlib.import_module(f"tutorial.train_{stage}").main, config(stage))
        rows.append(dict(stage=stage, **found))
        print(json.dumps(dict(stage=stage, per_step=found["per_step"], added=found["added"])), flush=True)
    if args.results:
        from tutorial.bench.record import append_result
        for row in rows:
            append_result(args.results, "host_syncs", [sys.executable, "-m", "host_syncs", *sys.argv[1:]],
                          dict(steps=[STEPS, 2 * STEPS], simulated_gpus=1), row)
    return 0


if __name__ == "__main__":
    sys.exit(main())

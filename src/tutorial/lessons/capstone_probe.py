"""Run a capstone script (notebook 03) as it is, and note what each rank did that result.json cannot show.

    torchrun --standalone --nproc_per_node 2 -m tutorial.lessons.capstone_probe SCRIPT --out DIR

runs SCRIPT as `__main__` with the arguments after it, on every rank, and at exit writes $CAPSTONE_PROBE_DIR/
rank<R>.json with: the order in which every DistributedSampler handed out its samples, epoch by epoch (a missing
set_epoch gives the same order every epoch); which files the rank wrote (torch.save, open for writing); and the
learning rate of each optimizer's first step. ddp.check_capstone reads these reports. Nothing in the script changes:
the recorders only watch and call the originals.
"""
from __future__ import annotations

import atexit
import builtins
import io
import json
import os
import runpy
import sys

from .ranks import describe


def main() -> None:
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from torch.utils.data.distributed import DistributedSampler
    if len(sys.argv) < 2:
        raise SystemExit("usage: capstone_probe SCRIPT [ARGS...]")
    script, rank = sys.argv[1], int(os.environ.get("RANK", "0"))
    report = {"rank": rank, "samplers": {}, "writes": [], "lrs": []}

    iterate = DistributedSampler.__iter__

    def recording_iter(self):
        order = list(iterate(self))
        report["samplers"].setdefault(str(id(self)), {"shuffle": bool(self.shuffle), "orders": []})["orders"] \
            .append(order)
        return iter(order)

    save, open_, io_open = torch.save, builtins.open, io.open

    def note(f, mode="r"):
        if isinstance(f, (str, os.PathLike)) and any(m in mode for m in "wax+"):
            report["writes"].append(os.path.basename(os.fspath(f)))

    def recording_save(obj, f, *args, **kwargs):
        note(f, "w")
        return save(obj, f, *args, **kwargs)

    def recording_open(file, mode="r", *args, **kwargs):
        note(file, mode)
        return open_(file, mode, *args, **kwargs)

    def recording_io_open(file, mode="r", *args, **kwargs):  # pathlib's write_text goes through io.open
        note(file, mode)
        return io_open(file, mode, *args, **kwargs)

    stepped = set()

    def first_step(optimizer, args, kwargs):  # the lr of the first step: scaled at construction or after it
        if id(optimizer) not in stepped:
            stepped.add(id(optimizer))
            report["lrs"].append(float(optimizer.param_groups[0].get("lr", float("nan"))))

    DistributedSampler.__iter__ = recording_iter
    torch.save, builtins.open, io.open = recording_save, recording_open, recording_io_open
    register_optimizer_step_pre_hook(first_step)

    def write_report():
        folder = os.environ.get("CAPSTONE_PROBE_DIR", ".")
        with open_(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)

    atexit.register(write_report)
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            report["error"] = f"SystemExit: {exc.code}"
        raise
    except BaseException as exc:
        report["error"] = describe(exc)
        raise


if __name__ == "__main__":
    main()

"""Run a capstone script (notebook 03) as it is, and note what each rank did that result.json cannot show.

    torchrun --standalone --nproc_per_node 2 -m tutorial.lessons.capstone_probe SCRIPT --out DIR

runs SCRIPT as `__main__` with the arguments after it, on every rank, under tutorial.checkddp.recorder (the
recorder of `tutorial check-ddp`), and at exit writes $CAPSTONE_PROBE_DIR/rank<R>.json. ddp.check_capstone reads
from it: the order in which every DistributedSampler handed out its samples, epoch by epoch ("samplers"), the files
the rank wrote ("writes"), the learning rate of each optimizer's first step ("lrs") and the error, if any.
"""
from __future__ import annotations

import os
import sys

from ..checkddp.recorder import run


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: capstone_probe SCRIPT [ARGS...]")
    run(sys.argv[1:], os.environ.get("CAPSTONE_PROBE_DIR", "."))


if __name__ == "__main__":
    main()

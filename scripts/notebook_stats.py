#!/usr/bin/env python3
"""How hands-on the notebooks are (issue 11): per notebook, the code cells, the cells that use the taught APIs
directly (torch.distributed, DDP, DataParallel, AMP, the profiler, Horovod, FSDP/DeepSpeed/Lightning, launcher
commands) and the exercises (`### Exercise N: ...` headings).

    python scripts/notebook_stats.py            # the table
tests/test_hands_on.py holds the targets: a third of all code cells, two exercises per stage notebook.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What "uses the API directly" means: a call or name of the APIs the notebooks' objectives teach, written in the cell.
API = re.compile(r"""
    \bdist\.\w+ | torch\.distributed | init_process_group | DistributedSampler | set_epoch\(
  | \bDDP\( | DistributedDataParallel | DataParallel\( | no_sync\(
  | autocast\( | GradScaler | torch\.profiler | \bprofile\( | record_function
  | \bhvd\.\w+ | horovod\.torch
  | fully_shard | deepspeed\.\w+ | \bTrainer\( | LightningModule
  | ^\s*!.*\b(torchrun|torch\.distributed\.run|mpirun|mpiexec|horovodrun|srun|sbatch|qsub)\b | \{sys\.executable\}\s+-m\s+torch\.distributed\.run
""", re.X | re.M)
EXERCISE = re.compile(r"^### Exercise \d+: ")


def stats(path: Path) -> dict:
    cells = json.loads(path.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    return {"notebook": path.stem, "code_cells": len(code),
            "api_cells": sum(1 for c in code if API.search("".join(c["source"]))),
            "exercises": sum(1 for c in cells if c["cell_type"] == "markdown"
                             and EXERCISE.match("".join(c["source"]).lstrip()))}


def all_stats() -> list[dict]:
    return [stats(p) for p in sorted(ROOT.glob("notebooks/[0-9][0-9]*_*.ipynb"))]


def main() -> int:
    rows = all_stats()
    print(f"{'notebook':36s} {'code':>5s} {'API':>5s} {'share':>6s} {'exercises':>9s}")
    for r in rows:
        print(f"{r['notebook']:36s} {r['code_cells']:5d} {r['api_cells']:5d} "
              f"{r['api_cells'] / max(r['code_cells'], 1):6.0%} {r['exercises']:9d}")
    code, api = sum(r["code_cells"] for r in rows), sum(r["api_cells"] for r in rows)
    print(f"{'total':36s} {code:5d} {api:5d} {api / max(code, 1):6.0%} {sum(r['exercises'] for r in rows):9d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

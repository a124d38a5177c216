"""The record of a measurement: one JSON line per result in results/<kind>.jsonl with the hardware, the versions, the
exact command, the load average and the date, so a number in a notebook or a slide can always be traced back; and
the aligned table `tutorial bench` and the notebooks print their measurements as."""
from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import math
import platform
import statistics
from importlib import metadata
from pathlib import Path

from ..core import accelerator
from ..core.process import usable_cores


@functools.cache
def environment() -> dict:
    """The hardware and versions, from torch.utils.collect_env (what `python -m torch.utils.collect_env` reports)."""
    from torch.utils.collect_env import get_env_info
    env = get_env_info()
    cpu = next((line.split(":", 1)[1].strip() for line in (env.cpu_info or "").splitlines()
                if line.startswith("Model name")), platform.processor() or platform.machine())
    gpus = [line.split(": ", 1)[-1] for line in (env.nvidia_gpu_models or "").splitlines() if line.strip()]
    hardware = dict(cpu=cpu, cores=os.cpu_count(), usable_cores=usable_cores(), gpus=gpus, os=env.os,
                    nvidia_driver=env.nvidia_driver_version)
    versions = dict(python=platform.python_version(), torch=env.torch_version, cuda=env.cuda_compiled_version,
                    cudnn=env.cudnn_version)
    library = accelerator.library_version()
    if library:  # on AMD, RCCL's (it answers under NCCL's name): one key for every record
        versions["nccl"] = library
    for package in ("torchvision", "horovod"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return dict(hardware=hardware, versions=versions)


def summary(values) -> dict:
    """median, min, max, a 95 % confidence interval of the median and every repeat: the spread is part of the
    result."""
    values = [float(v) for v in values]
    return dict(median=statistics.median(values), median_ci95=median_ci95(values), min=min(values), max=max(values),
                repeats=values)


def median_ci95(values) -> list[float] | None:
    """A distribution-free 95 % confidence interval of the median: the k-th smallest and k-th largest of n values,
    k the largest with P(Binomial(n, 1/2) < k) <= 2.5 % (no assumption about how the noise is distributed). None
    below 6 values, where no such k exists."""
    n, ordered = len(values), sorted(values)
    below, k = 0.0, 0
    while below + math.comb(n, k) / 2 ** n <= 0.025:
        below += math.comb(n, k) / 2 ** n
        k += 1
    return [ordered[k - 1], ordered[n - k]] if k >= 1 else None


def append_result(results_dir, kind: str, command: list, parameters: dict, results: dict) -> Path:
    """One JSON line in results_dir/<kind>.jsonl; returns the file."""
    line = dict(kind=kind, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                **environment(), command=list(command),
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


def print_table(rows: list[dict], floatfmt: str = ".3g") -> None:
    """Rows of dicts as an aligned text table (the notebooks' and `tutorial bench`'s tables of measurements)."""
    if not rows:
        print("(no rows)")
        return
    keys = list(rows[0])

    def fmt(v):
        if isinstance(v, float):
            return format(v, floatfmt)
        return str(v)

    cells = [[fmt(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))

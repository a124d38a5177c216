"""`make gpu-check`: the GPU path of the workbook verified in one command, on any machine with a CUDA GPU.

Every check is a real run, as an attendee or instructor would start it (python -m, torchrun, horovodrun, jupyter
nbconvert), with a time limit; each outcome is one JSON line in results/gpu_check.jsonl with the hardware, versions
and date (tutorial.bench.record). What it checks:

- every trainer on the GPU in fp32, bf16 and fp16, with channels_last, and with torch.compile;
- FSDP, DeepSpeed (ZeRO-2) and Lightning in fp32 and bf16, on one GPU and over NCCL on every GPU (at most 8) where
  there are two or more;
- DDP over NCCL with one process per GPU (at most 8), and several ranks sharing one GPU over gloo with CUDA tensors,
  so the multi-rank code runs even where a single GPU is all there is; NCCL's refusal of a shared GPU is a clear
  one-line error;
- Horovod with NCCL operations (when Horovod was built with HOROVOD_GPU_OPERATIONS=NCCL; else it says so);
- the notebooks executed top to bottom with the workshop preset, on generated CIFAR-shaped images where CIFAR-10 is
  not on disk, under each allocation notebook.allocation decides for (CUDA_VISIBLE_DEVICES set per run): one GPU
  (its ranks share it over gloo, or run on the CPU sized for it) and, where there are two or more, every GPU (one
  rank per GPU over NCCL);
- ResNet-50 at 224 px, bf16 + channels_last: the trainer's throughput, next to the bare loop of
  benchmarks/bare_loop.py.

    python -m tutorial.bench.gpucheck [--list] [--gpus N] [--only NAME,...] [--skip-notebooks] [--results-dir results]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..core.config import ConfigError
from ..core.process import open_mpi_env, threads_per_process
from ..launch.commands import _tool as _installed_tool
from .record import append_result

CHECKOUT = Path(__file__).resolve().parents[3]
PY = sys.executable
PRECISIONS = ("fp32", "bf16", "fp16")


def checks(gpus: int, out: Path) -> list[dict]:
    """Name, command and expectation of every check, for a machine with `gpus` GPUs."""
    workshop = ["--preset", "workshop", "--max-steps", "30", "--epochs", "1", *_generated_unless_on_disk()]

    def trainer(stage, *args, nproc=0, backend=None, name, expect="pass"):
        run = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc else [PY]
        extra = ["--backend", backend] if backend else []
        return dict(name=name, command=[*run, "-m", f"tutorial.train_{stage}", *workshop, *args, *extra,
                                        "--out", str(out / name)], expect=expect)

    found = []
    for stage in ("single", "dp"):
        for precision in PRECISIONS:
            found.append(trainer(stage, "--precision", precision, "--no-channels-last", name=f"{stage}-{precision}"))
        found.append(trainer(stage, "--precision", "bf16", "--channels-last", name=f"{stage}-bf16-channels-last"))
    found.append(trainer("single", "--precision", "bf16", "--channels-last", "--compile", name="single-compile"))
    nccl = min(gpus, 8)
    for precision in PRECISIONS:
        found.append(trainer("ddp", "--precision", precision, nproc=nccl, name=f"ddp-nccl-{nccl}-{precision}"))
    found.append(trainer("ddp", "--compile", nproc=nccl, name=f"ddp-nccl-{nccl}-compile"))
    found.append(trainer("ddp", nproc=gpus + 1, backend="gloo", name=f"ddp-gloo-{gpus + 1}-ranks-on-{gpus}-gpus"))
    found.append(trainer("ddp", nproc=gpus + 1, backend="nccl", name="ddp-nccl-shared-gpu-refused",
                         expect="NCCL cannot put two ranks on one GPU"))
    # The sharded trainers and Lightning: one GPU (one process), then one process per GPU over NCCL.
    for stage in ("fsdp", "deepspeed", "lightning"):
        for precision in ("fp32", "bf16"):
            found.append(trainer(stage, "--precision", precision, nproc=1, name=f"{stage}-1gpu-{precision}"))
            if gpus >= 2:
                found.append(trainer(stage, "--precision", precision, nproc=nccl, name=f"{stage}-nccl-{nccl}-{precision}"))
    # Tensor, pipeline and 2D parallel (11_model_parallelism): one rank per GPU over NCCL, where there are enough.
    for stage, ranks, args in (("tp", 2, []), ("pp", 2, ["--schedule", "1f1b", "--micro-batches", "4"]),
                               ("2d", 4, ["--tp", "2"])):
        if gpus >= ranks:
            found.append(dict(name=f"{stage}-nccl-{ranks}", expect="pass", command=[
                PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), "-m",
                f"tutorial.train_{stage}", *args, "--out", str(out / stage)]))
    found.append(dict(name=f"horovod-nccl-{nccl}", expect="pass", requires="horovod-nccl", command=[
        _tool("horovodrun"), "-np", str(nccl), "-H", f"localhost:{nccl}", "--gloo", PY, "-m", "tutorial.train_horovod",
        *workshop, "--out", str(out / "horovod")]))
    found.append(dict(name="resnet50-bf16-channels-last-trainer", expect="pass", throughput=True, command=[
        PY, "-m", "tutorial.train_single", "--preset", "benchmark", "--max-steps", "200", "--out",
        str(out / "resnet50")]))
    bare = CHECKOUT / "benchmarks" / "bare_loop.py"
    if bare.exists():
        found.append(dict(name="resnet50-trainer-vs-bare-loop", expect="pass", command=[
            PY, str(bare), "--stage", "single", "--preset", "benchmark", "--steps", "100", "--warmup", "20",
            "--repeats", "3", "--results-dir", str(out / "bare")]))
    return found


def _generated_unless_on_disk() -> list[str]:
    """CIFAR-10 where it is on disk (or can be downloaded by the trainer); generated images where not."""
    from ..core.config import TrainConfig
    from ..core.data import data_dir
    folder = Path(data_dir(TrainConfig()))
    return [] if (folder / "cifar-10-batches-py").is_dir() else ["--generated", "5000"]


def run_check(check: dict, timeout: float, env: dict) -> dict:
    start = time.monotonic()
    try:
        proc = subprocess.run(check["command"], capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=CHECKOUT)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = None, f"timed out after {timeout:.0f} s\n{exc.stdout or ''}{exc.stderr or ''}"
    seconds = time.monotonic() - start
    if check["expect"] == "pass":
        ok = code == 0
    else:  # an expected refusal: a non-zero exit whose error line (the same from every rank) says why
        errors = {line for line in output.splitlines() if line.startswith("error: ")}
        ok = code not in (0, None) and len(errors) == 1 and check["expect"] in errors.pop()
    result = dict(check=check["name"], ok=ok, exit_code=code, seconds=round(seconds, 1),
                  tail=output.strip().splitlines()[-6:])
    metrics = _metrics(check)
    if metrics:
        result.update(samples_per_second=metrics.get("samples_per_second"),
                      test_accuracy=metrics.get("test_accuracy"), replicas_identical=metrics.get("replicas_identical"))
    return result


def _metrics(check: dict) -> dict:
    out = check["command"][check["command"].index("--out") + 1] if "--out" in check["command"] else ""
    path = Path(out) / "metrics.json"
    return json.loads(path.read_text()) if out and path.exists() else {}


def allocations(visible: list[str]) -> dict[str, str]:
    """The allocations the notebooks are checked under, as the CUDA_VISIBLE_DEVICES each run gets: one GPU (the
    common workshop case: a lesson's 2 ranks share it or run on the CPU) and, with two or more, all of them."""
    found = {"1gpu": visible[0]}
    if len(visible) >= 2:
        found[f"{len(visible)}gpu"] = ",".join(visible)
    return found


def notebook_checks(out: Path, visible: list[str]) -> list[dict]:
    """Every notebook, executed top to bottom (its asserts must hold) with the workshop preset, into `out`, once per
    allocation: notebook.allocation in each engine start and launch decides from the GPUs the run sees."""
    return [dict(name=f"notebook-{nb.stem}-{label}", expect="pass", notebook=True, visible=devices, command=[
        _tool("jupyter"), "nbconvert", "--to", "notebook", "--execute", "--ExecutePreprocessor.timeout=1800",
        "--ExecutePreprocessor.kernel_name=python3", "--output-dir", str(out / label), "--output", nb.name, str(nb)])
        for label, devices in allocations(visible).items()
        for nb in sorted((CHECKOUT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))]


def _tool(name: str) -> str:
    """A program from this Python's environment (the venv), else from PATH; its bare name if neither has it (the
    check then fails with "not found", which is the finding)."""
    try:
        return _installed_tool(name)
    except FileNotFoundError:
        return name


def horovod_nccl() -> tuple[bool, str]:
    try:
        import horovod.torch as hvd
    except ImportError:
        return False, "Horovod is not installed: HOROVOD_GPU_OPERATIONS=NCCL make install"
    if not hvd.nccl_built():
        return False, "Horovod was built without NCCL operations: HOROVOD_GPU_OPERATIONS=NCCL make install"
    return True, ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="make gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated check names (or prefixes) to run")
    parser.add_argument("--skip-notebooks", action="store_true", help="leave out the notebook executions")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one check may take (default 600)")
    parser.add_argument("--results-dir", default=str(CHECKOUT / "results"))
    parser.add_argument("--list", action="store_true", help="print the checks and exit")
    parser.add_argument("--gpus", type=int, default=0,
                        help="with --list: the checks for a node with this many GPUs (default: the GPUs here)")
    args = parser.parse_args(argv)
    if args.gpus < 0 or (args.gpus and not args.list):
        print(f"error: --gpus {args.gpus}: a number of GPUs of at least 1, with --list only (a run uses the GPUs "
              f"it sees; CUDA_VISIBLE_DEVICES chooses them)", file=sys.stderr)
        return 2
    import torch
    from ..launch.engines import visible_gpus
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = visible_gpus() or [str(i) for i in range(args.gpus or 1)]
    if args.gpus:
        gpus, visible = args.gpus, [str(i) for i in range(args.gpus)]
    if not gpus and not args.list:
        print("error: no CUDA GPU is visible here (torch.cuda.is_available() is False); make gpu-check verifies the "
              "GPU path and needs one (tutorial doctor says why torch sees none)", file=sys.stderr)
        return 2
    out = Path(tempfile.mkdtemp(prefix="tutorial-gpu-check-"))
    todo = checks(max(gpus, 1), out) + ([] if args.skip_notebooks else notebook_checks(out, visible))
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        todo = [c for c in todo if any(c["name"].startswith(w) for w in wanted)]
        if not todo:
            print(f"error: --only {args.only!r} matches no check (see --list)", file=sys.stderr)
            return 2
    if args.list:
        for c in todo:
            print(f"{c['name']:<46} {' '.join(map(str, c['command']))[:150]}")
        return 0
    env = open_mpi_env(dict(os.environ, PYTHONUNBUFFERED="1", CI="true",
                            OMP_NUM_THREADS=str(threads_per_process(min(gpus, 8)))))
    failed = 0
    for check in todo:
        if check.get("requires") == "horovod-nccl" and not horovod_nccl()[0]:
            result = dict(check=check["name"], ok=False, skipped=horovod_nccl()[1])
        else:
            check_env = dict(env, TUTORIAL_PRESET="workshop", TUTORIAL_CONFIG=" ".join(_generated_unless_on_disk()),
                             CUDA_VISIBLE_DEVICES=check["visible"]) if check.get("notebook") else env
            result = run_check(check, args.timeout, check_env)
        failed += not result["ok"]
        mark = "ok  " if result["ok"] else ("skip" if result.get("skipped") else "FAIL")
        extra = f"{result['samples_per_second']:.0f} samples/s" if result.get("samples_per_second") else ""
        print(f"{mark} {result['check']:<46} {result.get('seconds', 0):>7.1f} s  {extra}"
              f"{result.get('skipped', '')}", flush=True)
        if not result["ok"] and not result.get("skipped"):
            print("     " + "\n     ".join(result["tail"]), flush=True)
        append_result(args.results_dir, "gpu_check", ["make", "gpu-check", *(argv or sys.argv[1:])],
                      dict(command=[str(c) for c in check["command"]], gpus=gpus), result)
    shutil.rmtree(out, ignore_errors=True)
    print(f"{len(todo) - failed} of {len(todo)} checks passed; results appended to "
          f"{Path(args.results_dir) / 'gpu_check.jsonl'}")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

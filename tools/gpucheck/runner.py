"""Running a stage: each check in its own session under its own time limit (all it started killed at the end), a
recorded skip where the node lacks what a check needs or the stage's budget has no room, the verdict (verify.py),
one JSON line per check (bench/record.py). Also the two helper processes the checks start: the probe and the
notebook executor."""
from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tutorial.core.process import open_mpi_env, threads_per_process
from .plan import CHECKOUT, PY, Check, program
from .verify import finite, over_estimate, verify


# ---------------------------------------------------------------------------------------------- the stage
def run_stage(todo: list[Check], *, stage: int, budget: float, results: Path, gpus: int, rehearse: bool, out: Path,
              command: list) -> int:
    """Run the checks in order within `budget` seconds, each recorded in results/gpu_check.jsonl as it ends (with
    `command`, the driver's); 1 if one failed. out: the runs' scratch folder, removed at the end."""
    from tutorial.bench.record import append_result
    import torch
    print(f"gpu-check stage {stage}: torch {torch.__version__} (CUDA {torch.version.cuda}, {gpus} GPU(s)) from "
          f"{Path(torch.__file__).parents[1]}, Python {sys.version.split()[0]} ({PY})", flush=True)
    _become_subreaper()
    if any(c.name == "control-failing-notebook" for c in todo):
        write_failing_notebook(out / "control-failing.ipynb")
    keep = results / "gpu-check-failed" / time.strftime("%Y%m%d-%H%M%S")
    env = stage_env(gpus, rehearse)
    started, counts, late = time.monotonic(), {"pass": 0, "FAIL": 0, "skip": 0}, 0
    for check in todo:
        result = attempt(check, budget, budget - (time.monotonic() - started), env, keep)
        result = dict(check=check.name, stage=stage, estimate_seconds=check.estimate, **result)
        counts[result["status"]] += 1
        late += "over_estimate" in result
        report(check, result)
        append_result(results, "gpu_check", command, dict(command=[str(c) for c in check.command], gpus=gpus,
                                                          claims=list(check.claims), rehearse=rehearse), result)
    shutil.rmtree(out, ignore_errors=True)
    print(f"stage {stage}: {counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped in "
          f"{time.monotonic() - started:.0f} s; results appended to {results / 'gpu_check.jsonl'}")
    if late:  # what they took is their estimate from now on (plan.measured_seconds), and the stages' sums with it
        print(f"{late} check(s) took longer than their estimate: --list and the next stage count what they took")
    return 1 if counts["FAIL"] else 0


def stage_env(gpus: int, rehearse: bool) -> dict:
    """The checks' environment: unbuffered output, the workshop preset for the notebooks (the smoke preset in the
    rehearsal), made-up images where CIFAR-10 is not on disk (an offline node), a fair share of threads."""
    data_config = [] if (CHECKOUT / "data" / "cifar-10-batches-py").is_dir() else ["--generated", "5000"]
    # tools/ on the path: the probe and the notebook executor are this tool's own `python -m gpucheck`
    path = os.pathsep.join(filter(None, [str(CHECKOUT / "tools"), os.environ.get("PYTHONPATH")]))
    env = open_mpi_env(dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", CI="true", TUTORIAL_PRESET="workshop",
                            TUTORIAL_CONFIG=" ".join(data_config),
                            OMP_NUM_THREADS=str(threads_per_process(min(max(gpus, 1), 8)))))
    if rehearse:
        env.update(TUTORIAL_PRESET="smoke", TUTORIAL_CONFIG="", OMP_NUM_THREADS="1")
    return env


def attempt(check: Check, budget: float, left: float, env: dict, keep: Path) -> dict:
    """The check's result, or a recorded skip: what it needs is missing, the `left` seconds of the stage's `budget`
    cannot fit its estimate, or the budget ended it before its own timeout (not a hang)."""
    why = missing(check.needs)
    if why:
        return dict(status="skip", skipped=why)
    if left < min(check.estimate, check.timeout):
        return dict(status="skip", skipped=f"not started: {left:.0f} s of the stage's {budget:.0f} s left, estimate "
                                           f"{check.estimate:.0f} s")
    limit = min(check.timeout, left)
    result = run_check(check, limit, env, keep)
    if result.get("timed_out") and limit < check.timeout:
        result.update(status="skip", skipped=f"cut at the stage's budget: {limit:.0f} s were left of {budget:.0f} s "
                                             f"(estimate {check.estimate:.0f} s); run it alone with ARGS='--only "
                                             f"{check.name}'")
    return result


def report(check: Check, result: dict) -> None:
    """The check's line on the console, and under it what failed, the log's tail, and an overrun."""
    extra = (f"  {result['samples_per_second']:.0f} samples/s" if finite(result.get("samples_per_second"))
             else "") + (f"  {result['skipped']}" if result.get("skipped") else "")
    print(f"{result['status']:<4} {check.name:<40} {result.get('seconds', 0):>6.1f} s{extra}", flush=True)
    for line in result.get("failed_claims", []) + result.get("tail", []) + [result.get("over_estimate", "")]:
        if line:
            print(f"     {line}", flush=True)


# ------------------------------------------------------------------------------------------ running a check
def run_check(check: Check, timeout: float, env: dict, keep: Path) -> dict:
    """Run one check (run_in_session) and judge it (verify.py); keep: where a failed check's log and notebook go. The
    result records the seconds it took, and where that is well over its estimate, says so (over_estimate)."""
    if check.out:
        shutil.rmtree(check.out, ignore_errors=True)
    env = dict(env, **check.env, **({"CUDA_VISIBLE_DEVICES": check.visible} if check.visible is not None else {}))
    try:
        code, output, seconds, leftovers = run_in_session(check.command, timeout, env)
    except OSError as exc:  # the program vanished between the needs check and the start
        return dict(status="skip", skipped=f"{check.command[0]} could not start: {exc.strerror or exc}")
    out = Path(check.out) if check.out else None
    metrics = json.loads((out / "metrics.json").read_text()) if out and (out / "metrics.json").exists() else None
    records = out / "overhead.jsonl" if out else None
    overhead = [json.loads(x) for x in records.read_text().splitlines() if x.strip()] if records and records.exists() \
        else []
    bad, facts = verify(check, code, output, metrics, overhead)
    result = dict(status="pass" if not bad else "FAIL", exit_code=code, timed_out=code is None,
                  seconds=round(seconds, 1), failed_claims=bad, **facts)
    if code is not None and over_estimate(check, seconds):
        result["over_estimate"] = over_estimate(check, seconds)
    if leftovers:
        result["leftovers_killed"] = leftovers  # a run that does not stop what it started is a finding
    if bad:
        result.update(tail=output.strip().splitlines()[-8:], kept=keep_failed(check, output, keep))
    return result


def run_in_session(command: list, timeout: float, env: dict) -> tuple[int | None, str, float, list[str]]:
    """Run a command in its own session; at the timeout kill its process group and every descendant (also those in
    sessions of their own); after it, end whatever it left running. Returns the exit code (None: timed out), the
    output, the seconds it took and the command lines of what it left running."""
    before = {p.pid for p in _descendants()}
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([str(c) for c in command], stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=CHECKOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            family = [p for p in _descendants() if p.pid not in before]
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            _kill(family)
            proc.wait()
            code = None
        left = [p for p in _descendants() if p.pid not in before]
        leftovers = []
        for p in left:  # still running after the check ended (exited orphans are only reaped)
            with contextlib.suppress(Exception):
                if p.status() != "zombie":
                    leftovers.append(" ".join(p.cmdline())[:120])
        _kill(left)
        log.seek(0)
        return code, log.read(), time.monotonic() - start, leftovers


def keep_failed(check: Check, output: str, keep: Path) -> list[str]:
    """A failed check's log, and its executed notebook, copied to `keep`; their paths."""
    keep.mkdir(parents=True, exist_ok=True)
    (keep / f"{check.name}.log").write_text(output)
    kept = [str(keep / f"{check.name}.log")]
    executed = Path(check.command[-1]) if check.notebook else None
    if executed and executed.exists():
        shutil.copy(executed, keep / f"{check.name}.ipynb")
        kept.append(str(keep / f"{check.name}.ipynb"))
    return kept


def _become_subreaper() -> None:
    """Orphans of a check (a kernel's engines, a launcher's workers in their own session) become this process's
    children instead of init's, so the driver can find and end them after the check (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _descendants() -> list:
    import psutil
    return psutil.Process().children(recursive=True)


def _kill(procs) -> None:
    import psutil
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


# ------------------------------------------------------------------------------------ what the node lacks
def bundled() -> set[str]:
    """The packages scripts/gpu_bundle.txt pins for an offline node, as import names."""
    pins = (CHECKOUT / "scripts" / "gpu_bundle.txt").read_text().splitlines()
    return {line.split("==")[0].strip().lower().replace("-", "_") for line in pins if "==" in line.split("#")[0]}


def missing(needs) -> str:
    """Why a check cannot run here ("" if it can): a program not on PATH, a package not importable."""
    for need in needs:
        kind, _, what = need.partition(":")
        if kind == "program" and not shutil.which(program(what)):
            return f"{what} is not installed here (not on PATH)"
        if kind == "module" and importlib.util.find_spec(what) is None:
            where = "make gpu-bundle carries it" if what in bundled() else \
                "make gpu-bundle cannot carry it: build it on the node, as make install does"  # Horovod
            return f"the Python package {what} is not installed here ({where})"
        if need == "horovod-nccl":
            ok, why = horovod_nccl()
            if not ok:
                return why
        if need == "compile":
            why = compile_unready()
            if why:
                return why
    return ""


_compile_checked: list[str] = []  # compile_unready's answer, once per stage


def compile_unready() -> str:
    """Why torch.compile cannot work here ("" if it can): inductor (and on GPUs Triton's launcher) compiles C on first
    use, which needs a C compiler and Python's headers, neither of which a compute node is sure to have; then a
    one-line compile on the device proves the rest. Asked once per stage."""
    if not _compile_checked:
        import sysconfig
        headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
        compiler = os.environ.get("CC") or "gcc"
        if not shutil.which(compiler):
            why = f"torch.compile needs a C compiler and {compiler} is not on PATH (module load gcc, or set CC)"
        elif not headers.exists():
            why = f"torch.compile needs Python's headers and {headers} does not exist (the python3-dev package)"
        else:
            tiny = ("import torch; device = 'cuda' if torch.cuda.is_available() else 'cpu'; "
                    "f = torch.compile(lambda x: x * 2 + 1); assert f(torch.ones(8, device=device)).sum().item() == 24")
            try:
                proc = subprocess.run([PY, "-c", tiny], capture_output=True, text=True, timeout=300)
                failed = proc.returncode != 0
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
            except subprocess.TimeoutExpired:
                failed, last = True, "it did not finish within 300 s"
            why = f"a one-line torch.compile fails here: {last}" if failed else ""
        _compile_checked.append(why)
    return _compile_checked[0]


def horovod_nccl() -> tuple[bool, str]:
    try:
        import horovod.torch as hvd
    except ImportError:
        return False, "Horovod is not installed: HOROVOD_GPU_OPERATIONS=NCCL make install"
    if not hvd.nccl_built():
        return False, "Horovod was built without NCCL operations: HOROVOD_GPU_OPERATIONS=NCCL make install"
    return True, ""


# ---------------------------------------------------------------------------------------- helper processes
def probe(rehearse: bool) -> int:
    """The node as gpu-check finds it, as one JSON line: torch, CUDA, cuDNN, NCCL, the GPUs (each runs a bf16
    matmul), the programs and packages the checks need, and where each package comes from (the bundle or the node).
    Exit 1 where a GPU was expected and none works."""
    import torch
    found = dict(python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda,
                 cudnn=torch.backends.cudnn.version(), gpus=[], programs={}, packages={})
    if torch.cuda.is_available():
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        for i in range(torch.cuda.device_count()):
            x = torch.ones(256, 256, device=f"cuda:{i}", dtype=torch.bfloat16)
            found["gpus"].append(dict(name=torch.cuda.get_device_name(i), matmul_ok=bool((x @ x)[0, 0].item() == 256),
                                      memory_gib=round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)))
    for name in ("nvidia-smi", "nvcc", "gcc", "mpirun", "horovodrun", "py-spy", "cmake"):
        found["programs"][name] = shutil.which(name)
    import sysconfig
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    found["python_h"] = str(headers) if headers.exists() else None  # torch.compile builds C against it
    for package in ("torchvision", "lightning", "deepspeed", "horovod", "ipyparallel", "ipykernel", "nbclient",
                    "mpi4py", "tensorboard", "sklearn", "matplotlib", "psutil", "filelock", "tqdm"):
        spec = importlib.util.find_spec(package)
        found["packages"][package] = spec.origin if spec else None
    print(json.dumps(found))
    return 0 if rehearse or (found["gpus"] and all(g["matmul_ok"] for g in found["gpus"])) else 1


def execute_notebook(source: str, executed: str, timeout: float = 1800) -> int:
    """Execute a notebook top to bottom in this Python's kernel (its asserts are the check), writing the executed
    notebook, outputs and error included, whether or not a cell fails."""
    import nbclient
    import nbformat
    nb = nbformat.read(source, as_version=4)
    Path(executed).parent.mkdir(parents=True, exist_ok=True)
    # A private kernelspec "python3" that is this Python: a user's own python3 kernelspec must not be used instead.
    data = Path(tempfile.mkdtemp(prefix="gpucheck-jupyter-"))
    spec = data / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps(dict(
        argv=[PY, "-m", "ipykernel_launcher", "-f", "{connection_file}"], display_name="Python 3", language="python")))
    os.environ["JUPYTER_DATA_DIR"] = str(data)
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(Path(source).parent)}})
    try:
        client.execute()
        return 0
    except Exception as exc:  # noqa: BLE001 - a failing cell, a dead kernel: the notebook check fails either way
        last = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().splitlines()[-1:]  # without the colour codes
        print(f"error: {Path(source).name}: {type(exc).__name__}: {' '.join(last)}", file=sys.stderr)
        return 1
    finally:
        nbformat.write(nb, executed)
        shutil.rmtree(data, ignore_errors=True)


def write_failing_notebook(path: Path) -> None:
    """The rehearsal's control-failing-notebook: one cell runs, the next one's assert fails."""
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('control: this cell runs')"),
                                         nbformat.v4.new_code_cell("assert 1 + 1 == 3, 'control: the claim fails'")])
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))

"""`make gpu-check`: the GPU path of the workbook verified in stages of at most 8 minutes each, on any machine with a
CUDA GPU, including an offline compute node that has only its own Python and torch (scripts/gpu_check.sh brings the
rest as wheels). Which checks, in which stage, with the seconds each is estimated to take on one H100: `--list`.

Every check is a real run, as an attendee or instructor would start it (python -m, torchrun, horovodrun, a notebook
executed top to bottom), and it passes only if its claims hold, not on its exit code alone: the run's metrics.json
shows the device it was meant to use, the number of ranks it was started with, identical replicas (every rank's
parameter checksum), a finite training loss that falls from the first epoch to the last, the throughput, and the
preset's accuracy bound where the check trains long enough to have one (the notebooks assert theirs). Each check has
its own time limit, after which its whole process group and every process it started are killed; each outcome is one
JSON line appended to DIR/gpu_check.jsonl as it ends, with the hardware, versions and date (bench/record.py). A
missing program or package is a recorded skip with the reason; a check the stage's time budget cannot fit is a
recorded skip too. The executed notebook (or the log) of a failed check is kept in DIR.

    python -m tutorial.bench.gpucheck --stage 1 --results-dir DIR [--list] [--gpus N] [--only NAME,...]
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..core.config import ConfigError
from ..core.process import open_mpi_env, threads_per_process

CHECKOUT = Path(__file__).resolve().parents[3]
PY = sys.executable
STAGE_SECONDS = 480   # a job step on the node: 8 minutes
SETUP_SECONDS = 20    # scripts/gpu_check.sh before the driver starts: the bundle's install, the torch report
STAGES = (1, 2, 3, 4, 5)
# The accuracy a preset reaches when it trains to the end (tutorial.lessons.notebook.EXPECTED_ACCURACY, which the
# notebooks assert; bench may not import lessons, and tests/test_gpu_check.py keeps the two equal).
ACCURACY_BOUND = {"smoke": 0.95, "workshop": 0.85}
# Trainer checks train 3 short epochs on made-up CIFAR-shaped images (30 steps of 128 an epoch on one GPU): long
# enough for the loss to fall, too short for the workshop's 0.85, which notebooks 01 and 03b assert after 10 epochs.
WORKSHOP = ["--preset", "workshop", "--generated", "3840", "--epochs", "3"]
REHEARSAL = ["--preset", "smoke"]  # the CPU rehearsal (make test): the smoke preset trains to its accuracy bound


@dataclasses.dataclass
class Check:
    """One run and what it must show. estimate: seconds on one H100, an estimate from reading the code (no GPU run
    has measured them yet); timeout: seconds before its processes are killed."""
    name: str
    stage: int
    command: list
    estimate: float
    timeout: float = 90
    claims: tuple = ("exit",)
    world: int = 1                  # ranks the run must report
    device: str = "cuda"            # what metrics.json's device must start with
    out: str = ""                   # where the run writes metrics.json
    needs: tuple = ()               # "module:x", "program:x", "horovod-nccl": missing means a recorded skip
    expect_error: str = ""          # an expected refusal: one distinct `error: ` line containing this
    min_accuracy: float | None = None
    visible: str | None = None      # CUDA_VISIBLE_DEVICES for this run (None: what the driver sees)
    notebook: str = ""              # a notebook to execute (command is the runner)
    env: dict = dataclasses.field(default_factory=dict)


TRAINER_CLAIMS = ("exit", "metrics", "device", "replicas", "loss", "falling", "throughput", "accuracy")


def plan(gpus: int, out: Path, rehearse: bool = False, visible: list[str] | None = None) -> list[Check]:
    """Every check for a node with `gpus` GPUs, in priority order, each with its stage. With one GPU the multi-rank
    runs share it (the one-GPU allocation); with two or more they take one GPU each over NCCL (the full node), and
    the notebooks run under that allocation. rehearse: the same list on the CPU with the smoke preset (make test)."""
    n = min(max(gpus, 1), 8)
    visible = visible or [str(i) for i in range(n)]
    first = visible[0]
    device = "cpu" if rehearse else "cuda"
    base = REHEARSAL if rehearse else WORKSHOP
    bound = ACCURACY_BOUND["smoke"] if rehearse else None
    ranks_label = f"nccl-{n}" if n >= 2 else "1gpu"
    found: list[Check] = []

    def trainer(stage_no, stage, *args, name, estimate, nproc=0, backend=None, preset=None, world=None,
                min_accuracy=bound, **kw):
        """A trainer launched as people launch it; a multi-rank launch costs ~1.5 s more per extra rank."""
        if rehearse:  # on the CPU: no compile, and fp32 for fp16 (which needs a GPU), in the same launch
            args = ["fp32" if a == "fp16" else a for a in args if a != "--compile"]
        if "--compile" in args:  # a node without a C compiler or Python's headers: a recorded skip, not a FAIL
            kw["needs"] = (*kw.get("needs", ()), "compile")
        run = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc else [PY]
        where = str(out / name)
        command = [*run, "-m", f"tutorial.train_{stage}", *(preset or base), *args,
                   *(["--backend", backend] if backend else []), "--out", where]
        found.append(Check(name=name, stage=stage_no, estimate=estimate + 1.5 * max(nproc - 1, 0), command=command,
                           world=world or max(nproc, 1), device=device, out=where, min_accuracy=min_accuracy,
                           claims=kw.pop("claims", TRAINER_CLAIMS), **kw))

    def notebook(stage_no, stem, estimate, needs=()):
        label = f"{n}gpu" if n >= 2 else "1gpu"
        nb = CHECKOUT / "notebooks" / f"{stem}.ipynb"
        found.append(Check(name=f"notebook-{stem}-{label}", stage=stage_no, estimate=estimate,
                           timeout=max(120, 2.5 * estimate), notebook=str(nb), visible=",".join(visible[:n]),
                           needs=("module:nbclient", "module:ipykernel", *needs),
                           command=[PY, "-m", "tutorial.bench.gpucheck", "--execute-notebook", str(nb),
                                    str(out / "notebooks" / f"{stem}-{label}.ipynb")]))

    def sharded(stage_no, precision):  # FSDP, DeepSpeed, Lightning: one GPU, or one rank per GPU over NCCL
        for stage, estimate, needs in (("fsdp", 18, ()), ("deepspeed", 25, ("module:deepspeed",)),
                                       ("lightning", 20, ("module:lightning",))):
            trainer(stage_no, stage, "--precision", precision, nproc=n, name=f"{stage}-{ranks_label}-{precision}",
                    estimate=estimate, needs=needs)

    found.append(Check(name="probe", stage=0, estimate=15, timeout=60, claims=("exit", "probe"), device=device,
                       command=[PY, "-m", "tutorial.bench.gpucheck", "--probe", *(["--rehearse"] if rehearse else [])]))
    # Stage 1: the core GPU paths, then the core day's notebooks.
    trainer(1, "single", "--precision", "bf16", "--channels-last", name="single-bf16-channels-last", estimate=12)
    trainer(1, "single", "--precision", "fp16", "--no-channels-last", name="single-fp16", estimate=12)
    trainer(1, "ddp", "--precision", "bf16", nproc=n, name=f"ddp-nccl-{n}-bf16", estimate=16)
    # The one-GPU allocation on any node: two ranks on one GPU over gloo with CUDA tensors; NCCL refuses that.
    trainer(1, "ddp", nproc=2, backend="gloo", name="ddp-gloo-2-ranks-on-1-gpus", estimate=20, visible=first)
    trainer(1, "ddp", nproc=2, backend="nccl", name="ddp-nccl-shared-gpu-refused", estimate=10, visible=first,
            claims=("refusal",), expect_error="backend nccl needs a CUDA GPU" if rehearse else  # no GPU to share
            "NCCL cannot put two ranks on one GPU")
    sharded(1, "bf16")
    trainer(1, "dp", "--precision", "bf16", "--channels-last", name="dp-bf16-channels-last", estimate=12, world=1)
    trainer(1, "single", name="resnet50-bf16-channels-last-trainer", estimate=35, timeout=120,
            preset=REHEARSAL + ["--max-steps", "20", "--epochs", "1"] if rehearse else
            ["--preset", "benchmark", "--max-steps", "200"],
            claims=("exit", "metrics", "device", "replicas", "loss", "throughput"), min_accuracy=None)
    for stem, estimate in (("01_single_device", 45), ("03a_ddp_by_hand", 35), ("03b_ddp_trainer", 120)):
        notebook(1, stem, estimate)
    # Stage 2: torch.compile, fp16 for every trainer that takes it, notebooks 04 (TF32, FP8's formats, compile under
    # DDP with inductor: 120 s by guess, 70 before those sections) and 07 (MFU: 100 s).
    trainer(2, "single", "--precision", "bf16", "--channels-last", "--compile", name="single-compile", estimate=100,
            timeout=240)
    trainer(2, "ddp", "--precision", "fp16", nproc=n, name=f"ddp-nccl-{n}-fp16", estimate=16)
    sharded(2, "fp16")
    for stem, estimate in (("04_mixed_precision", 120), ("07_scaling_study", 100)):
        notebook(2, stem, estimate)
    # Stage 3: fp32 of the sharded trainers and Lightning; notebooks 08 and 10 (with the debug server: 220 s).
    sharded(3, "fp32")
    for stem, estimate in (("08_lightning", 110), ("10_when_things_go_wrong", 220)):
        notebook(3, stem, estimate)
    # Stage 4: DDP + compile, the trainer against the bare loop, plain fp32, DataParallel in fp16, SyncBatchNorm,
    # model parallel, notebooks 11, 00, 06.
    trainer(4, "ddp", "--compile", nproc=n, name=f"ddp-nccl-{n}-compile", estimate=90, timeout=240)
    trainer(4, "dp", "--precision", "fp16", name="dp-fp16", estimate=12, world=1)
    if n >= 2:  # SyncBatchNorm needs a GPU per rank
        trainer(4, "ddp", "--sync-bn", nproc=n, name=f"ddp-nccl-{n}-sync-bn", estimate=20)
    bare = CHECKOUT / "benchmarks" / "bare_loop.py"
    found.append(Check(name="resnet50-trainer-vs-bare-loop", stage=4, estimate=70, timeout=180, device=device,
                       claims=("exit", "overhead"), out=str(out / "bare"), command=[
                           PY, str(bare), "--stage", "single", "--preset", "smoke" if rehearse else "benchmark",
                           "--steps", "100", "--warmup", "20", "--repeats", "3", "--results-dir", str(out / "bare")]))
    trainer(4, "single", "--precision", "fp32", "--no-channels-last", name="single-fp32", estimate=15)
    trainer(4, "ddp", "--precision", "fp32", nproc=n, name=f"ddp-nccl-{n}-fp32", estimate=16)
    for stage, ranks, args in (("tp", 2, []), ("pp", 2, ["--schedule", "1f1b", "--micro-batches", "4"]),
                               ("2d", 4, ["--tp", "2"])):
        if n >= ranks:  # tensor, pipeline and 2D parallel (11): one rank per GPU over NCCL, where there are enough
            where = str(out / stage)
            found.append(Check(name=f"{stage}-nccl-{ranks}", stage=4, estimate=20 + 1.5 * (ranks - 1),
                               world=ranks, device=device, out=where,
                               claims=("exit", "metrics", "device", "world", "loss"),
                               command=[PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                        str(ranks), "-m", f"tutorial.train_{stage}", *args, "--out", where]))
    for stem, estimate in (("11_model_parallelism", 35), ("00_setup", 15), ("06_multi_node", 60)):
        notebook(4, stem, estimate)
    # Stage 5: what the node usually lacks: Horovod (built with NCCL operations); notebooks 05, 09 (with activation
    # checkpointing, offload, HSDP and async DCP: 290 s) and 02.
    horovod_out = str(out / "horovod")
    found.append(Check(name=f"horovod-nccl-{n}", stage=5, estimate=20 + 1.5 * (n - 1), world=n, device=device,
                       out=horovod_out, needs=("program:horovodrun", "horovod-nccl"), claims=TRAINER_CLAIMS,
                       min_accuracy=bound, command=[
                           _program("horovodrun"), "-np", str(n), "-H", f"localhost:{n}", "--gloo", PY, "-m",
                           "tutorial.train_horovod", *base, "--out", horovod_out]))
    notebook(5, "05_horovod", 60, needs=("module:horovod",))
    notebook(5, "09_sharded_training", 290, needs=("module:deepspeed",))
    notebook(5, "02_data_parallel", 45)
    if rehearse:
        found += controls(out)
    return found


def controls(out: Path) -> list[Check]:
    """The rehearsal's negative controls (make test, on the CPU): a check that hangs with a child in its own session
    (both must be killed at the timeout), one whose program is missing (a recorded skip), one that exits 0 but whose
    metrics.json says the replicas differ (it must FAIL), and a notebook whose assert fails (kept in DIR)."""
    fake = out / "control-exit-code-only"
    write = ("import json, os, sys; os.makedirs(sys.argv[1], exist_ok=True); json.dump(dict(world_size=2, "
             "device='cpu', replicas_identical=False, replica_checksums=['a', 'b'], epochs=[dict(train_loss=2.3, "
             "test_loss=2.3, test_accuracy=0.1, samples_per_second=10.0), dict(train_loss=0.5, test_loss=0.5, "
             "test_accuracy=0.99, samples_per_second=10.0)], test_accuracy=0.99), "
             "open(os.path.join(sys.argv[1], 'metrics.json'), 'w'))")
    hang = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)', "
            "'gpucheck-control-orphan'], start_new_session=True); time.sleep(3600)")
    failing = out / "control-failing.ipynb"
    return [
        Check(name="control-hang", stage=0, estimate=1, timeout=3, command=[PY, "-c", hang, "gpucheck-control-hang"]),
        Check(name="control-missing-program", stage=0, estimate=1, needs=("program:gpucheck-no-such-program",),
              command=["gpucheck-no-such-program"]),
        Check(name="control-exit-code-only", stage=0, estimate=1, claims=TRAINER_CLAIMS, world=2, device="cpu",
              out=str(fake), command=[PY, "-c", write, str(fake)]),
        Check(name="control-failing-notebook", stage=0, estimate=5, timeout=120, notebook=str(failing),
              needs=("module:nbclient", "module:ipykernel"),
              command=[PY, "-m", "tutorial.bench.gpucheck", "--execute-notebook", str(failing),
                       str(out / "notebooks" / "control-failing.ipynb")]),
    ]


def _write_failing_notebook(path: Path) -> None:
    import nbformat
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('control: this cell runs')"),
                                         nbformat.v4.new_code_cell("assert 1 + 1 == 3, 'control: the claim fails'")])
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))


# ------------------------------------------------------------------------------------------------- the claims
def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def verify(check: Check, code: int | None, output: str, metrics: dict | None) -> tuple[list[str], dict]:
    """What failed among the check's claims (empty: it passed), and the facts read on the way."""
    facts: dict = {}
    if "refusal" in check.claims:  # a non-zero exit whose error line (the same from every rank) says why
        errors = {line for line in output.splitlines() if line.startswith("error: ")}
        facts["errors"] = sorted(errors)
        bad = [] if code not in (0, None) else [f"exit code {code}: the run was expected to be refused"]
        if len(errors) != 1 or check.expect_error not in next(iter(errors), ""):
            bad.append(f"expected one error line with {check.expect_error!r}, got {sorted(errors)[:3]}")
        if metrics is not None:
            bad.append("it was refused, yet metrics.json was written: it trained")
        return bad, facts
    bad = [] if code == 0 else [f"exit code {code}" if code is not None else "timed out"]
    if "metrics" in check.claims and metrics is None:
        return bad + ["no metrics.json"], facts
    metrics = metrics or {}
    epochs = metrics.get("epochs") or []
    losses = [e.get("train_loss") for e in epochs] if epochs else list(metrics.get("losses") or [])
    if metrics:
        facts.update(device=metrics.get("device"), world_size=metrics.get("world_size"),
                     replicas_identical=metrics.get("replicas_identical"), train_losses=losses,
                     test_accuracy=metrics.get("test_accuracy"))
    if epochs:
        facts["samples_per_second"] = epochs[-1].get("samples_per_second")
    if "device" in check.claims and not str(metrics.get("device", "")).startswith(check.device):
        bad.append(f"ran on {metrics.get('device')!r}, not {check.device}")
    if "replicas" in check.claims or "world" in check.claims:
        if metrics.get("world_size") != check.world:
            bad.append(f"world size {metrics.get('world_size')}, started with {check.world}")
    if "replicas" in check.claims:
        digests = metrics.get("replica_checksums") or []
        if metrics.get("replicas_identical") is not True or len(set(digests)) != 1 or len(digests) != check.world:
            bad.append(f"replicas differ or were not all checked: {len(digests)} checksum(s), "
                       f"{len(set(digests))} distinct, replicas_identical={metrics.get('replicas_identical')}")
    if "loss" in check.claims:
        values = [*losses, *(e.get("test_loss") for e in epochs)]
        if not values or not all(_finite(v) for v in values):
            bad.append(f"loss not finite (or none recorded): {values[:6]}")
    if "falling" in check.claims:
        if len(losses) < 2 or not all(_finite(v) for v in losses) or not losses[-1] < losses[0]:
            bad.append(f"training loss did not fall from the first epoch to the last: {losses}")
    if "accuracy" in check.claims and check.min_accuracy is not None:
        if not (_finite(metrics.get("test_accuracy")) and metrics["test_accuracy"] >= check.min_accuracy):
            bad.append(f"test accuracy {metrics.get('test_accuracy')} below the preset's {check.min_accuracy}")
    if "throughput" in check.claims:
        if not (_finite(facts.get("samples_per_second")) and facts["samples_per_second"] > 0):
            bad.append(f"no throughput recorded: {facts.get('samples_per_second')}")
    if "overhead" in check.claims:
        lines = [json.loads(x) for x in _read(Path(check.out) / "overhead.jsonl").splitlines() if x.strip()]
        ratios = [line["results"]["ratio"]["median"] for line in lines
                  if line.get("parameters", {}).get("device") == check.device]
        facts["overhead_ratio"] = ratios[-1] if ratios else None
        if not ratios or not _finite(ratios[-1]):
            bad.append(f"no trainer/bare-loop ratio measured on {check.device}")
    if "probe" in check.claims:
        probe = _last_json(output)
        facts["probe"] = probe
        if probe is None:
            bad.append("the probe printed no JSON")
        elif check.device == "cuda" and not probe.get("gpus"):
            bad.append("torch sees no CUDA GPU")
    return bad, facts


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _last_json(output: str):
    for line in reversed(output.strip().splitlines()):
        with contextlib.suppress(ValueError):
            return json.loads(line)
    return None


# ------------------------------------------------------------------------------------------ running a check
def missing(needs) -> str:
    """Why a check cannot run here ("" if it can): a program not on PATH, a package not importable."""
    for need in needs:
        kind, _, what = need.partition(":")
        if kind == "program" and not shutil.which(_program(what)):
            return f"{what} is not installed here (not on PATH)"
        if kind == "module" and importlib.util.find_spec(what) is None:
            return f"the Python package {what} is not installed here (make gpu-bundle carries it)"
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


def _program(name: str) -> str:
    """A program from this Python's environment (the venv's horovodrun), else its name, found on PATH at the start."""
    local = Path(PY).parent / name
    return str(local) if local.exists() else name


def horovod_nccl() -> tuple[bool, str]:
    try:
        import horovod.torch as hvd
    except ImportError:
        return False, "Horovod is not installed: HOROVOD_GPU_OPERATIONS=NCCL make install"
    if not hvd.nccl_built():
        return False, "Horovod was built without NCCL operations: HOROVOD_GPU_OPERATIONS=NCCL make install"
    return True, ""


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


def run_check(check: Check, timeout: float, env: dict, keep: Path) -> dict:
    """Run one check in its own session; at the timeout kill its process group and every descendant (also those in
    sessions of their own); after it, end whatever it left behind. keep: where a failed check's log and notebook go."""
    if check.out:
        shutil.rmtree(check.out, ignore_errors=True)
    env = dict(env, **check.env, **({"CUDA_VISIBLE_DEVICES": check.visible} if check.visible is not None else {}))
    before = {p.pid for p in _descendants()}
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        try:
            proc = subprocess.Popen([str(c) for c in check.command], stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=CHECKOUT, start_new_session=True)
        except OSError as exc:  # the program vanished between the needs check and the start
            return dict(status="skip", skipped=f"{check.command[0]} could not start: {exc.strerror or exc}")
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
        output = log.read()
    seconds = time.monotonic() - start
    metrics_file = Path(check.out) / "metrics.json" if check.out else None
    metrics = json.loads(metrics_file.read_text()) if metrics_file and metrics_file.exists() else None
    bad, facts = verify(check, code, output, metrics)
    result = dict(status="pass" if not bad else "FAIL", exit_code=code, timed_out=code is None,
                  seconds=round(seconds, 1), failed_claims=bad, **facts)
    if leftovers:
        result["leftovers_killed"] = leftovers  # a run that does not stop what it started is a finding
    if bad:
        result["tail"] = output.strip().splitlines()[-8:]
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"{check.name}.log").write_text(output)
        result["kept"] = [str(keep / f"{check.name}.log")]
        executed = Path(check.command[-1]) if check.notebook else None
        if executed and executed.exists():
            shutil.copy(executed, keep / f"{check.name}.ipynb")
            result["kept"].append(str(keep / f"{check.name}.ipynb"))
    return result


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
    for program in ("nvidia-smi", "nvcc", "gcc", "mpirun", "horovodrun", "py-spy", "cmake"):
        found["programs"][program] = shutil.which(program)
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


# --------------------------------------------------------------------------------------------- the driver
def list_stage(todo: list[Check]) -> None:
    print(f"{'check':<40} {'est. s':>6} {'timeout':>7}  (estimates: seconds on one H100, from reading the code)")
    print(f"{'(setup: bundle install, torch report)':<40} {SETUP_SECONDS:>6}")
    for c in todo:
        print(f"{c.name:<40} {c.estimate:>6.0f} {c.timeout:>7.0f}")
    total = SETUP_SECONDS + sum(c.estimate for c in todo)
    print(f"{'total (estimate)':<40} {total:>6.0f}  = {total / 60:.1f} min of at most {STAGE_SECONDS / 60:.0f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="make gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, default=1, help=f"which stage: {', '.join(map(str, STAGES))} (default "
                        "1; stages 1 and 2 fit one 15-minute allocation)")
    parser.add_argument("--results-dir", default=str(CHECKOUT / "results"),
                        help="where gpu_check.jsonl and failed checks' notebooks and logs go (default results/)")
    parser.add_argument("--only", default="", help="comma-separated check names (or prefixes) to run")
    parser.add_argument("--list", action="store_true", help="print the stage's checks with estimates and exit")
    parser.add_argument("--gpus", type=int, default=0,
                        help="with --list: the checks for a node with this many GPUs (default: the GPUs here)")
    parser.add_argument("--budget", type=float, default=STAGE_SECONDS - SETUP_SECONDS,
                        help="seconds the stage may take; a check that does not fit is skipped (default %(default)s)")
    parser.add_argument("--rehearse", action="store_true", help=argparse.SUPPRESS)  # make test: CPU, smoke sizes
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--execute-notebook", nargs=2, metavar=("NOTEBOOK", "EXECUTED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        return probe(args.rehearse)
    if args.execute_notebook:
        return execute_notebook(*args.execute_notebook)
    if args.stage not in STAGES:
        print(f"error: --stage {args.stage}: choose one of {', '.join(map(str, STAGES))}", file=sys.stderr)
        return 2
    if args.gpus < 0 or (args.gpus and not args.list):
        print(f"error: --gpus {args.gpus}: a number of GPUs of at least 1, with --list only (a run uses the GPUs "
              f"it sees; CUDA_VISIBLE_DEVICES chooses them)", file=sys.stderr)
        return 2
    import torch
    from ..launch.engines import visible_gpus
    gpus = args.gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    visible = [str(i) for i in range(args.gpus)] if args.gpus else (visible_gpus() or [str(i) for i in range(8)])
    if not gpus and not (args.list or args.rehearse):
        print("error: no CUDA GPU is visible here (torch.cuda.is_available() is False); make gpu-check verifies the "
              "GPU path and needs one (tutorial doctor says why torch sees none)", file=sys.stderr)
        return 2
    out = Path(tempfile.mkdtemp(prefix="tutorial-gpu-check-"))
    everything = plan(gpus, out, args.rehearse, visible)
    todo = [c for c in everything if c.stage in (0, args.stage)]
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        todo = [c for c in everything if any(c.name.startswith(w) for w in wanted)]
        if not todo:
            print(f"error: --only {args.only!r} matches no check (see --list)", file=sys.stderr)
            return 2
    if args.list:
        list_stage(todo)
        shutil.rmtree(out, ignore_errors=True)
        return 0
    return run_stage(todo, args, gpus, out, argv)


def run_stage(todo: list[Check], args, gpus: int, out: Path, argv) -> int:
    import torch
    from .record import append_result
    print(f"gpu-check stage {args.stage}: torch {torch.__version__} (CUDA {torch.version.cuda}, {gpus} GPU(s)) from "
          f"{Path(torch.__file__).parents[1]}, Python {sys.version.split()[0]} ({PY})", flush=True)
    _become_subreaper()
    if any(c.name == "control-failing-notebook" for c in todo):
        _write_failing_notebook(out / "control-failing.ipynb")
    results = Path(args.results_dir)
    keep = results / "gpu-check-failed" / time.strftime("%Y%m%d-%H%M%S")
    data_config = [] if (CHECKOUT / "data" / "cifar-10-batches-py").is_dir() else ["--generated", "5000"]
    env = open_mpi_env(dict(os.environ, PYTHONUNBUFFERED="1", CI="true", TUTORIAL_PRESET="workshop",
                            TUTORIAL_CONFIG=" ".join(data_config),
                            OMP_NUM_THREADS=str(threads_per_process(min(max(gpus, 1), 8)))))
    if args.rehearse:
        env.update(TUTORIAL_PRESET="smoke", TUTORIAL_CONFIG="", OMP_NUM_THREADS="1")
    started, counts = time.monotonic(), {"pass": 0, "FAIL": 0, "skip": 0}
    for check in todo:
        left = args.budget - (time.monotonic() - started)
        why = missing(check.needs)
        if why:
            result = dict(status="skip", skipped=why)
        elif left < min(check.estimate, check.timeout):
            result = dict(status="skip", skipped=f"not started: {left:.0f} s of the stage's {args.budget:.0f} s left,"
                                                 f" estimate {check.estimate:.0f} s")
        else:
            limit = min(check.timeout, left)
            result = run_check(check, limit, env, keep)
            if result.get("timed_out") and limit < check.timeout:  # the stage's budget ended it, not a hang
                result.update(status="skip", skipped=f"cut at the stage's budget: {limit:.0f} s were left of "
                                                     f"{args.budget:.0f} s (estimate {check.estimate:.0f} s); run "
                                                     f"it alone with ARGS='--only {check.name}'")
        result = dict(check=check.name, stage=args.stage, estimate_seconds=check.estimate, **result)
        counts[result["status"]] += 1
        extra = (f"  {result['samples_per_second']:.0f} samples/s" if _finite(result.get("samples_per_second"))
                 else "") + (f"  {result['skipped']}" if result.get("skipped") else "")
        print(f"{result['status']:<4} {check.name:<40} {result.get('seconds', 0):>6.1f} s{extra}", flush=True)
        for line in result.get("failed_claims", []) + result.get("tail", []):
            print(f"     {line}", flush=True)
        append_result(results, "gpu_check", ["make", "gpu-check", *(argv if argv is not None else sys.argv[1:])],
                      dict(command=[str(c) for c in check.command], gpus=gpus, claims=list(check.claims),
                           rehearse=args.rehearse), result)
    shutil.rmtree(out, ignore_errors=True)
    print(f"stage {args.stage}: {counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped in "
          f"{time.monotonic() - started:.0f} s; results appended to {results / 'gpu_check.jsonl'}")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

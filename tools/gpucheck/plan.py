"""The checks as data: what each stage runs, what each run must show, and the seconds each is expected to take.

A check's estimate is the larger of two numbers: the seconds on one H100 read from the code, and the seconds the last
passing GPU run of that check took (measured_seconds: a results folder's gpu_check.jsonl), so that a check measured
over its first guess is counted at what it took, by `--list`, by the stage's budget and by the tests."""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
PY = sys.executable
STAGE_SECONDS = 480   # a job step on the node: 8 minutes
SETUP_SECONDS = 20    # scripts/gpu_check.sh before the driver starts: the bundle's install, the torch report
STAGES = (1, 2, 3, 4, 5, 6)
# The accuracy a preset reaches when it trains to the end (tutorial.lessons.notebook.EXPECTED_ACCURACY, which the
# notebooks assert; gpucheck may not import lessons, and tests/test_gpu_check.py keeps the two equal).
ACCURACY_BOUND = {"smoke": 0.95, "workshop": 0.85}
# Trainer checks train 3 short epochs on made-up CIFAR-shaped images (30 steps of 128 an epoch on one GPU): long
# enough for the loss to fall, too short for the workshop's 0.85, which notebooks 01 and 03b assert after 10 epochs.
WORKSHOP = ["--preset", "workshop", "--generated", "3840", "--epochs", "3"]
REHEARSAL = ["--preset", "smoke"]  # the CPU rehearsal (make test): the smoke preset trains to its accuracy bound
TRAINER_CLAIMS = ("exit", "metrics", "device", "replicas", "loss", "falling", "throughput", "accuracy")
EXECUTE = [PY, "-m", "gpucheck", "--execute-notebook"]  # the notebook executor: runner.execute_notebook


@dataclasses.dataclass
class Check:
    """One run and what it must show. estimate: seconds on one H100 (see the module's docstring); timeout: seconds
    before its processes are killed."""
    name: str
    stage: int
    command: list
    estimate: float
    timeout: float = 90
    claims: tuple = ("exit",)
    world: int = 1                  # ranks the run must report
    device: str = "cuda"            # what metrics.json's device must start with
    out: str = ""                   # where the run writes metrics.json
    needs: tuple = ()               # "module:x", "program:x", "horovod-nccl", "compile": missing means a recorded skip
    expect_error: str = ""          # an expected refusal: one distinct `error: ` line containing this
    min_accuracy: float | None = None
    visible: str | None = None      # CUDA_VISIBLE_DEVICES for this run (None: what the driver sees)
    notebook: str = ""              # a notebook to execute (command is the runner)
    env: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Node:
    """What the plan is for: n GPUs (1 to 8) named `visible`, the runs' folder `out`; rehearse: the CPU, smoke sizes."""
    n: int
    visible: tuple
    out: Path
    rehearse: bool
    device: str          # what a run must report: cuda, or cpu in the rehearsal
    preset: list         # the trainers' preset flags
    bound: float | None  # the accuracy a trainer check must reach: only the smoke preset trains to it in a check
    label: str           # the allocation: one GPU shared ("1gpu"), or the whole node ("8gpu")
    ranks: str           # the multi-rank trainers' launch: one GPU, or one rank per GPU over NCCL ("nccl-8")


def plan(gpus: int, out: Path, rehearse: bool = False, visible: list[str] | None = None,
         measured: dict | None = None) -> list[Check]:
    """Every check for a node with `gpus` GPUs, in priority order, each with its stage. With one GPU the multi-rank
    runs share it (the one-GPU allocation); with two or more they take one GPU each over NCCL (the full node), and
    the notebooks run under that allocation. rehearse: the same list on the CPU with the smoke preset (make test),
    with the negative controls. measured: seconds by check name (measured_seconds) that raise the estimates."""
    n = min(max(gpus, 1), 8)
    node = Node(n, tuple(visible or [str(i) for i in range(n)]), out, rehearse, device="cpu" if rehearse else "cuda",
                preset=REHEARSAL if rehearse else WORKSHOP, bound=ACCURACY_BOUND["smoke"] if rehearse else None,
                label=f"{n}gpu" if n >= 2 else "1gpu", ranks=f"nccl-{n}" if n >= 2 else "1gpu")
    found = [probe_check(node)]
    for stage in (stage_1, stage_2, stage_3, stage_4, stage_5, stage_6):
        found += stage(node)
    if rehearse:
        found += controls(out)
    for check in found:
        check.estimate = max(check.estimate, (measured or {}).get(check.name, 0))
    return found


def measured_seconds(results: Path) -> dict:
    """The seconds each check took in its last passing run on a GPU, from results/gpu_check.jsonl (none: {})."""
    path = Path(results) / "gpu_check.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return {line["results"]["check"]: line["results"]["seconds"] for line in lines
            if line["results"].get("status") == "pass" and not line["parameters"].get("rehearse")
            and line["parameters"].get("gpus")}


def stage_seconds(checks: list[Check], stage: int) -> float:
    """What a stage is expected to take: the setup, the probe and its checks."""
    return SETUP_SECONDS + sum(c.estimate for c in checks if c.stage in (0, stage))


# ------------------------------------------------------------------------------------------- kinds of checks
def trainer(node: Node, stage_no: int, stage: str, *args, name: str, estimate: float, nproc: int = 0,
            backend: str | None = None, preset: list | None = None, world: int | None = None,
            claims: tuple = TRAINER_CLAIMS, needs: tuple = (), **kw) -> Check:
    """A trainer launched as people launch it; a multi-rank launch costs ~1.5 s more per extra rank."""
    if node.rehearse:  # on the CPU: no compile, and fp32 for fp16 (which needs a GPU), in the same launch
        args = tuple("fp32" if a == "fp16" else a for a in args if a != "--compile")
    if "--compile" in args:  # a node without a C compiler or Python's headers: a recorded skip, not a FAIL
        needs = (*needs, "compile")
    run = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc else [PY]
    where = str(node.out / name)
    command = [*run, "-m", f"tutorial.train_{stage}", *(preset or node.preset), *args,
               *(["--backend", backend] if backend else []), "--out", where]
    kw.setdefault("min_accuracy", node.bound)
    return Check(name=name, stage=stage_no, estimate=estimate + 1.5 * max(nproc - 1, 0), command=command,
                 world=world or max(nproc, 1), device=node.device, out=where, claims=claims, needs=needs, **kw)


# What a notebook's code cells (comments left out) use that no wheel can carry, so a GPU node may lack it: Horovod
# (built against the node's torch and MPI) and its launcher, and an MPI launcher (a `!` command, a lesson's launch,
# MPI engines). 00 asserts that `tutorial doctor` finds Horovod and MPI.
NODE_TOOLS = {"module:horovod": re.compile(r"^\s*(import|from) horovod\b|train_horovod|cli\.doctor\(", re.M),
              "program:horovodrun": re.compile(r"^\s*!.*\bhorovodrun\b", re.M),
              "program:mpirun": re.compile(r'^\s*!.*\bmpirun\b|launcher="mpirun"|engines="mpi"|cli\.doctor\(', re.M)}


def node_tools(source: Path) -> tuple:
    """The NODE_TOOLS a notebook uses: where the node lacks one, the notebook is a recorded skip that names it, not a
    FAIL for the wrong reason (a launch cell that cannot start)."""
    code = "\n".join(re.sub(r"#.*", "", line) for c in json.loads(source.read_text())["cells"]
                     if c["cell_type"] == "code" for line in "".join(c["source"]).splitlines())
    return tuple(need for need, used in NODE_TOOLS.items() if used.search(code))


def notebook(node: Node, stage_no: int, stem: str, estimate: float, needs: tuple = ()) -> Check:
    """A notebook executed top to bottom under the node's allocation (its asserts are the check)."""
    source = CHECKOUT / "notebooks" / f"{stem}.ipynb"
    needs += node_tools(source)
    return Check(name=f"notebook-{stem}-{node.label}", stage=stage_no, estimate=estimate,
                 timeout=max(120, 2.5 * estimate), notebook=str(source), visible=",".join(node.visible[:node.n]),
                 needs=("module:nbclient", "module:ipykernel", *needs),
                 command=[*EXECUTE, str(source), str(node.out / "notebooks" / f"{stem}-{node.label}.ipynb")])


def sharded(node: Node, stage_no: int, precision: str) -> list[Check]:
    """FSDP, DeepSpeed, Lightning in one precision: one GPU, or one rank per GPU over NCCL."""
    return [trainer(node, stage_no, stage, "--precision", precision, nproc=node.n, estimate=estimate, needs=needs,
                    name=f"{stage}-{node.ranks}-{precision}")
            for stage, estimate, needs in (("fsdp", 18, ()), ("deepspeed", 25, ("module:deepspeed",)),
                                           ("lightning", 20, ("module:lightning",)))]


def probe_check(node: Node) -> Check:
    """Stage 0, before every stage: the node as the driver finds it (runner.probe)."""
    return Check(name="probe", stage=0, estimate=15, timeout=60, claims=("exit", "probe"), device=node.device,
                 command=[PY, "-m", "gpucheck", "--probe", *(["--rehearse"] if node.rehearse else [])])


# ---------------------------------------------------------------------------------------------- the stages
def stage_1(node: Node) -> list[Check]:
    """The core GPU paths, then the core day's notebooks."""
    first = node.visible[0]
    refusal = "backend nccl needs a GPU per rank" if node.rehearse else "NCCL cannot put two ranks on one GPU"
    resnet50 = REHEARSAL + ["--max-steps", "20", "--epochs", "1"] if node.rehearse else \
        ["--preset", "benchmark", "--max-steps", "200"]
    return [
        trainer(node, 1, "single", "--precision", "bf16", "--channels-last", name="single-bf16-channels-last",
                estimate=12),
        trainer(node, 1, "single", "--precision", "fp16", "--no-channels-last", name="single-fp16", estimate=12),
        trainer(node, 1, "ddp", "--precision", "bf16", nproc=node.n, name=f"ddp-nccl-{node.n}-bf16", estimate=16),
        # The one-GPU allocation on any node: two ranks on one GPU over gloo with CUDA tensors; NCCL refuses that
        # (on the CPU there is no GPU to share, and the refusal says so).
        trainer(node, 1, "ddp", nproc=2, backend="gloo", name="ddp-gloo-2-ranks-on-1-gpus", estimate=20,
                visible=first),
        trainer(node, 1, "ddp", nproc=2, backend="nccl", name="ddp-nccl-shared-gpu-refused", estimate=10,
                visible=first, claims=("refusal",), expect_error=refusal),
        *sharded(node, 1, "bf16"),
        trainer(node, 1, "dp", "--precision", "bf16", "--channels-last", name="dp-bf16-channels-last", estimate=12,
                world=1),
        trainer(node, 1, "single", name="resnet50-bf16-channels-last-trainer", estimate=35, timeout=120,
                preset=resnet50, claims=("exit", "metrics", "device", "replicas", "loss", "throughput"),
                min_accuracy=None),
        *(notebook(node, 1, stem, estimate)
          for stem, estimate in (("01_single_device", 45), ("03a_ddp_by_hand", 35), ("03b_ddp_trainer", 120))),
    ]


def stage_2(node: Node) -> list[Check]:
    """torch.compile, fp16 for every trainer that takes it, notebooks 04 (TF32, FP8's formats, compile under DDP with
    inductor: 120 s by guess, 70 before those sections) and 07 (MFU: 100 s)."""
    return [
        trainer(node, 2, "single", "--precision", "bf16", "--channels-last", "--compile", name="single-compile",
                estimate=100, timeout=240),
        trainer(node, 2, "ddp", "--precision", "fp16", nproc=node.n, name=f"ddp-nccl-{node.n}-fp16", estimate=16),
        *sharded(node, 2, "fp16"),
        notebook(node, 2, "04_mixed_precision", 120),
        notebook(node, 2, "07_scaling_study", 100),
    ]


def stage_3(node: Node) -> list[Check]:
    """fp32 of the sharded trainers and Lightning; notebooks 08 and 10 (with the debug server: 220 s)."""
    return [*sharded(node, 3, "fp32"), notebook(node, 3, "08_lightning", 110),
            notebook(node, 3, "10_when_things_go_wrong", 220)]


def stage_4(node: Node) -> list[Check]:
    """DDP + compile, the trainer against the bare loop, plain fp32, DataParallel in fp16, SyncBatchNorm (a GPU per
    rank), model parallel (a GPU per rank), notebooks 11, 00, 06."""
    n = node.n
    found = [trainer(node, 4, "ddp", "--compile", nproc=n, name=f"ddp-nccl-{n}-compile", estimate=90, timeout=240),
             trainer(node, 4, "dp", "--precision", "fp16", name="dp-fp16", estimate=12, world=1)]
    if n >= 2:
        found.append(trainer(node, 4, "ddp", "--sync-bn", nproc=n, name=f"ddp-nccl-{n}-sync-bn", estimate=20))
    found += [bare_loop(node),
              trainer(node, 4, "single", "--precision", "fp32", "--no-channels-last", name="single-fp32", estimate=15),
              trainer(node, 4, "ddp", "--precision", "fp32", nproc=n, name=f"ddp-nccl-{n}-fp32", estimate=16)]
    for stage, ranks, args in (("tp", 2, []), ("pp", 2, ["--schedule", "1f1b", "--micro-batches", "4"]),
                               ("2d", 4, ["--tp", "2"])):
        if n >= ranks:  # tensor, pipeline and 2D parallel (11): the GPT trainers, whose flags are their own
            where = str(node.out / stage)
            found.append(Check(name=f"{stage}-nccl-{ranks}", stage=4, estimate=20 + 1.5 * (ranks - 1), world=ranks,
                               device=node.device, out=where, claims=("exit", "metrics", "device", "world", "loss"),
                               command=[PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                        str(ranks), "-m", f"tutorial.train_{stage}", *args, "--out", where]))
    return found + [notebook(node, 4, stem, estimate)
                    for stem, estimate in (("11_model_parallelism", 35), ("00_setup", 15), ("06_multi_node", 60))]


def bare_loop(node: Node) -> Check:
    """ResNet-50's step in the trainer against a hand-written loop (benchmarks/bare_loop.py): the ratio is the claim."""
    out = node.out / "bare"
    return Check(name="resnet50-trainer-vs-bare-loop", stage=4, estimate=70, timeout=180, device=node.device,
                 claims=("exit", "overhead"), out=str(out), command=[
                     PY, str(CHECKOUT / "benchmarks" / "bare_loop.py"), "--stage", "single", "--preset",
                     "smoke" if node.rehearse else "benchmark", "--steps", "100", "--warmup", "20", "--repeats", "3",
                     "--results-dir", str(out)])


def stage_5(node: Node) -> list[Check]:
    """What the node usually lacks: Horovod (built with NCCL operations); notebooks 05, 09 (with activation
    checkpointing, offload, HSDP and async DCP: 290 s) and 02."""
    n, out = node.n, str(node.out / "horovod")
    horovod = Check(name=f"horovod-nccl-{n}", stage=5, estimate=20 + 1.5 * (n - 1), world=n, device=node.device,
                    out=out, needs=("program:horovodrun", "horovod-nccl"), claims=TRAINER_CLAIMS,
                    min_accuracy=node.bound, command=[
                        program("horovodrun"), "-np", str(n), "-H", f"localhost:{n}", "--gloo", PY, "-m",
                        "tutorial.train_horovod", *node.preset, "--out", out])
    return [horovod, notebook(node, 5, "05_horovod", 60),
            notebook(node, 5, "09_sharded_training", 290, needs=("module:deepspeed",)),
            notebook(node, 5, "02_data_parallel", 45)]


def stage_6(node: Node) -> list[Check]:
    """The performance clinic, notebook 12: memory per rank against the planner (torch.cuda.max_memory_allocated on
    GPU ranks), collectives counted by CommDebugMode over NCCL, one trace per rank, the bug hunt, the layout dry
    run. 60 s by guess (about 30 s on two CPU engines)."""
    return [notebook(node, 6, "12_performance_clinic", 60)]


def controls(out: Path) -> list[Check]:
    """The rehearsal's negative controls (make test, on the CPU): a check that hangs with a child in its own session
    (both must be killed at the timeout), one whose program is missing (a recorded skip), one that exits 0 but whose
    metrics.json says the replicas differ (it must FAIL), and a notebook whose assert fails (kept in DIR; the runner
    writes it, runner.write_failing_notebook)."""
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
        # A kernel's start and one failing cell: 6.4 s measured in the rehearsal on make test's 2-core machine.
        Check(name="control-failing-notebook", stage=0, estimate=10, timeout=120, notebook=str(failing),
              needs=("module:nbclient", "module:ipykernel"),
              command=[*EXECUTE, str(failing), str(out / "notebooks" / "control-failing.ipynb")]),
    ]


def program(name: str) -> str:
    """A program from this Python's environment (the venv's horovodrun), else its name, found on PATH at the start."""
    local = Path(PY).parent / name
    return str(local) if local.exists() else name

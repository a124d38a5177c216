"""`make gpu-check` as far as a machine without a GPU can take it: the stages fit 8 minutes by their estimates and
what their checks took where a run measured them, stage 1 holds the core paths, the bundle for an offline node is
pinned and small, Horovod's NCCL lookup finds pip's NCCL, every claim a check makes can fail, and a CPU rehearsal of the stage driver (make test) installs a bundle over this torch, records JSON lines, kills
a hung check with its children, records a skip, and fails a check that passes on its exit code alone."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import PYTHON, ROOT, env

from tutorial.core.config import STAGES as TRAINERS
sys.path.insert(0, str(ROOT / "tools"))  # gpu-check is a tool of the repository, as vcluster is
from gpucheck import plan, runner, verify  # noqa: E402

BUNDLE_LIST = ROOT / "scripts" / "gpu_bundle.txt"
MiB = 1024 * 1024


def _cli(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "gpucheck", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env=env(PYTHONPATH=str(ROOT / "tools")))


# ------------------------------------------------------------------------------------------------ the stages
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: make gpu-check runs instead of refusing")
def test_without_a_gpu_it_says_so_in_one_line():
    proc = subprocess.run(["make", "-s", "gpu-check", "RESULTS=/nonexistent-results"], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and errors == [errors[0]] and "no CUDA GPU is visible" in errors[0]


def over_budget(checks: list) -> list[str]:
    return [f"stage {stage}: {plan.stage_seconds(checks, stage):.0f} s" for stage in plan.STAGES
            if plan.stage_seconds(checks, stage) > plan.STAGE_SECONDS]


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_every_stage_fits_8_minutes_by_what_its_checks_take_and_every_check_has_one_stage(gpus, tmp_path):
    """A check counts at the larger of its estimate and what its last passing GPU run took (results/gpu_check.jsonl,
    where make gpu-check records every check's seconds), so an overrun measured on a node fails here (the control
    is the next test); the CPU rehearsal below holds the estimates against what its checks take here."""
    checks = plan.plan(gpus, tmp_path, measured=plan.measured_seconds(ROOT / "results"))
    names = [c.name for c in checks]
    assert len(names) == len(set(names))
    assert over_budget(checks) == []
    for stage in plan.STAGES:
        todo = [c for c in checks if c.stage in (0, stage)]
        assert todo[0].name == "probe" and all(c.estimate > 0 and c.timeout > 0 for c in todo)
    assert {c.stage for c in checks} == {0, *plan.STAGES}
    # every notebook, once, under the allocation of this node (one GPU, or all of them)
    label = f"{min(gpus, 8)}gpu" if gpus >= 2 else "1gpu"
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    assert sorted(n for n in names if n.startswith("notebook-")) == [f"notebook-{nb}-{label}" for nb in notebooks]


def test_a_check_measured_over_its_estimate_counts_at_what_it_took(tmp_path):
    """The control of the budget: a GPU run's record in which ddp-nccl-1-bf16 took 200 s puts stage 1 over its 8
    minutes; the same seconds from the CPU rehearsal, or from a failed run, are not evidence of a GPU's time."""
    from tutorial.bench.record import append_result

    def record(folder, status="pass", rehearse=False):
        append_result(folder, "gpu_check", ["make", "gpu-check"], dict(command=[], gpus=0 if rehearse else 1,
                      claims=[], rehearse=rehearse), dict(check="ddp-nccl-1-bf16", status=status, seconds=200.0))
        return plan.measured_seconds(folder)

    measured = record(tmp_path / "gpu")
    assert measured == {"ddp-nccl-1-bf16": 200.0}
    assert over_budget(plan.plan(1, tmp_path, measured=measured)) == ["stage 1: 602 s"]
    assert record(tmp_path / "rehearsal", rehearse=True) == {} and record(tmp_path / "failed", status="FAIL") == {}
    assert plan.measured_seconds(tmp_path / "nothing-recorded") == {}


def test_a_run_well_over_its_estimate_is_recorded_as_such(tmp_path):
    """The runner records every check's seconds, and where they pass 1.5 x its estimate + 5 s, says so (what the
    rehearsal below asserts of its checks); the control: the same seconds within a larger estimate are no overrun."""
    nap = plan.Check(name="nap", stage=1, command=[plan.PY, "-c", "import time; time.sleep(5.5)"], estimate=0)
    result = runner.run_check(nap, 30, dict(os.environ), tmp_path / "kept")
    assert result["status"] == "pass" and result["seconds"] >= 5.5
    assert "over 1.5 x its estimate of 0 s" in result["over_estimate"]
    nap.estimate = 10
    assert verify.over_estimate(nap, result["seconds"]) == ""


def trainer_of(check) -> str:
    found = re.search(r"tutorial\.train_(\w+)", " ".join(map(str, check.command)))
    return found[1] if found else ""


def stage_1_gaps(checks: list, n: int) -> list[str]:
    """What stage 1 misses of its job, on a node of n GPUs: the probe first; every image trainer the node has (all but
    Horovod, which it usually lacks: stage 5) in bf16 with every claim of a trainer check, the distributed ones on
    every GPU; the single trainer's fp16 (GradScaler) and channels_last; the one-GPU allocation (two ranks sharing a
    GPU over gloo, NCCL's refusal of it); then, after the trainers, notebooks of the core day only (README)."""
    gaps = [] if checks[0].name == "probe" and checks[0].stage == 0 else ["the probe does not come first"]
    stage1 = [c for c in checks if c.stage == 1]
    bf16 = {(trainer_of(c), c.world) for c in stage1 if "bf16" in c.command and c.claims == plan.TRAINER_CLAIMS}
    for stage in set(TRAINERS) - {"horovod"}:
        world = 1 if stage in ("single", "dp") else n
        if (stage, world) not in bf16:
            gaps.append(f"train_{stage} in bf16 on {world} GPU(s) with every trainer claim")
    if not any(trainer_of(c) == "single" and "fp16" in c.command for c in stage1):
        gaps.append("train_single in fp16")
    if not any("--channels-last" in c.command for c in stage1):
        gaps.append("channels_last")
    shared = [c for c in stage1 if c.world == 2 and c.visible == "0" and trainer_of(c) == "ddp"]
    if not any("gloo" in c.command and c.claims == plan.TRAINER_CLAIMS for c in shared):
        gaps.append("two ranks sharing one GPU over gloo")
    if not any("nccl" in c.command and c.claims == ("refusal",) for c in shared):
        gaps.append("NCCL's refusal of two ranks on one GPU")
    said = re.search(r"The core day is \d+ min of teaching \(([^)]*)\)", (ROOT / "README.md").read_text())[1]
    core_day = re.findall(r"(?:^|, (?:and )?)(\d\d[a-z]?)\b", said)  # "00, 01, ..., 06 without its ..., and 10 ..."
    notebooks = [i for i, c in enumerate(stage1) if c.notebook]
    if not notebooks or any(not c.notebook for c in stage1[notebooks[0]:]):
        gaps.append("the notebooks, after every trainer")
    gaps += [f"{stage1[i].name} is not the core day's" for i in notebooks
             if Path(stage1[i].notebook).stem.split("_")[0] not in core_day]
    return gaps


@pytest.mark.parametrize("gpus", [1, 8])
def test_stage_1_is_the_probe_the_core_paths_and_the_core_day_notebooks(gpus, tmp_path):
    assert stage_1_gaps(plan.plan(gpus, tmp_path), gpus) == []


def _moved(name: str, stage: int):
    return lambda checks: [dataclasses.replace(c, stage=stage) if c.name == name else c for c in checks]


def _a_notebook_first(checks):
    notebook = next(c for c in checks if c.stage == 1 and c.notebook)
    return [checks[0], notebook, *(c for c in checks[1:] if c is not notebook)]


@pytest.mark.parametrize("doctor, gap", [
    (_moved("fsdp-nccl-8-bf16", 3), "train_fsdp in bf16 on 8 GPU(s)"),
    (lambda cs: [dataclasses.replace(c, world=1) if c.name == "ddp-nccl-8-bf16" else c for c in cs], "train_ddp"),
    (_moved("single-fp16", 2), "train_single in fp16"),
    (lambda cs: [c for c in cs if c.name != "ddp-nccl-shared-gpu-refused"], "NCCL's refusal"),
    (_moved("notebook-09_sharded_training-8gpu", 1), "notebook-09_sharded_training-8gpu is not the core day's"),
    (_a_notebook_first, "the notebooks, after every trainer"),
    (lambda cs: cs[1:], "the probe does not come first"),
])
def test_stage_1_gaps_name_what_a_doctored_plan_lost(doctor, gap, tmp_path):
    """Negative controls of the property above: each doctored plan of an 8-GPU node loses one thing stage 1 holds."""
    gaps = stage_1_gaps(doctor(plan.plan(8, tmp_path)), 8)
    assert any(gap in g for g in gaps), gaps


def test_the_later_stages_hold_compile_fp16_sync_bn_the_bare_loop_model_parallel_and_horovod(tmp_path):
    one = {c.name: c for c in plan.plan(1, tmp_path)}
    eight = {c.name: c for c in plan.plan(8, tmp_path)}
    assert {"single-compile", "ddp-nccl-1-compile", "resnet50-trainer-vs-bare-loop", "horovod-nccl-1"} <= set(one)
    for stage in ("ddp-nccl-1", "fsdp-1gpu", "deepspeed-1gpu", "lightning-1gpu"):  # fp16 where a trainer takes it
        assert one[f"{stage}-fp16"].stage == 2
    assert not {n for n in one if "sync-bn" in n or n.startswith(("tp-", "pp-", "2d-"))}  # need a GPU per rank
    assert eight["ddp-nccl-8-sync-bn"].stage == 4 and {"tp-nccl-2", "pp-nccl-2", "2d-nccl-4"} <= set(eight)
    assert eight["ddp-nccl-8-bf16"].world == 8 and eight["ddp-gloo-2-ranks-on-1-gpus"].visible == "0"
    assert eight["notebook-03b_ddp_trainer-8gpu"].visible == "0,1,2,3,4,5,6,7"


def test_notebooks_that_use_horovod_or_mpirun_are_skipped_where_the_node_lacks_them(tmp_path, monkeypatch):
    """The offline node has neither Horovod nor, probably, mpirun (no wheel carries them): 00 (whose doctor cell
    asserts both), 05 and 06 (which also type horovodrun) need both, 08 and 09 launch with mpirun. Where one is
    missing the notebook is a recorded skip naming it; before, 00 and 06 in stage 4 and 08 in stage 3 would have
    FAILed at a cell that cannot start."""
    needs = {c.name.split("-")[1]: set(c.needs) - {"module:nbclient", "module:ipykernel"}
             for c in plan.plan(8, tmp_path) if c.name.startswith("notebook-")}
    both = {"module:horovod", "program:mpirun"}
    assert needs == {"01_single_device": set(), "03a_ddp_by_hand": set(), "03b_ddp_trainer": set(),
                     "04_mixed_precision": set(), "07_scaling_study": set(), "08_lightning": {"program:mpirun"},
                     "10_when_things_go_wrong": set(), "11_model_parallelism": set(), "00_setup": both,
                     "06_multi_node": both | {"program:horovodrun"}, "05_horovod": both | {"program:horovodrun"},
                     "09_sharded_training": {"module:deepspeed", "program:mpirun"}, "02_data_parallel": set(),
                     "12_performance_clinic": set()}
    # controls: a comment, a variable or a lesson module named so are no use (08, 05 have them); a launch is
    for source, found in ((["x = 1  # ranks from torchrun, mpirun or srun\n"], ()),
                          (['mpirun = json.load(open("m.json"))\n', "from tutorial.lessons import horovod\n"], ()),
                          (['run = launch(cfg, launcher="mpirun")\n'], ("program:mpirun",)),
                          (["!mpirun -np 2 python -m x\n"], ("program:mpirun",)),
                          (["import horovod.torch as hvd\n", "!horovodrun -np 2 python x.py\n"],
                           ("module:horovod", "program:horovodrun"))):
        (tmp_path / "a.ipynb").write_text(json.dumps({"cells": [{"cell_type": "code", "source": source}]}))
        assert plan.node_tools(tmp_path / "a.ipynb") == found, source
    # the skip's reason, where Horovod is missing, says that the bundle cannot bring it
    real = runner.importlib.util.find_spec
    monkeypatch.setattr(runner.importlib.util, "find_spec", lambda name: None if name == "horovod" else real(name))
    assert "make gpu-bundle cannot carry it" in runner.missing(("module:nbclient", "module:horovod"))
    assert runner.missing(("program:gpucheck-no-such-mpirun",)) == "gpucheck-no-such-mpirun is not installed here " \
                                                                   "(not on PATH)"


def test_list_prints_the_estimates_and_their_sum():
    proc = _cli("--list", "--stage", "1", "--gpus", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    listed = [float(line.split()[1]) for line in lines[2:-1]]
    total = float(lines[-1].split()[2])
    assert total == pytest.approx(plan.SETUP_SECONDS + sum(listed), abs=1) and total <= 480
    assert "estimate" in lines[0] and "H100" in lines[0]


def test_only_selects_by_name_prefix_and_a_bad_selection_is_one_line():
    proc = _cli("--list", "--gpus", "2", "--only", "deepspeed-nccl,notebook-07")
    names = [line.split()[0] for line in proc.stdout.splitlines()[2:-1]]
    assert names == ["deepspeed-nccl-2-bf16", "deepspeed-nccl-2-fp16", "notebook-07_scaling_study-2gpu",
                     "deepspeed-nccl-2-fp32"]  # in priority order, across stages
    for bad in (["--only", "nosuch"], ["--gpus", "-1"], ["--stage", "9"]):
        proc = _cli("--list", *bad)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_check_the_stage_budget_cannot_fit_is_a_recorded_skip(tmp_path):
    proc = _cli("--rehearse", "--only", "probe", "--budget", "5", "--results-dir", str(tmp_path))
    line = json.loads((tmp_path / "gpu_check.jsonl").read_text())
    assert proc.returncode == 0 and line["results"]["status"] == "skip"
    assert "not started" in line["results"]["skipped"] and "seconds" not in line["results"]


def test_a_check_the_stage_budget_cuts_short_is_a_recorded_skip_naming_the_budget(tmp_path):
    """A check that starts but meets the end of the stage's budget before its own timeout was recorded as a FAIL,
    "timed out", like a hang; it is a skip that names the budget. The control: the same check within a budget that
    leaves it its own timeout is the FAIL of a hang (control-hang sleeps for an hour; its own timeout is 3 s)."""
    for budget, status in ((2, "skip"), (30, "FAIL")):
        results = tmp_path / str(budget)
        _cli("--rehearse", "--only", "control-hang", "--budget", str(budget), "--results-dir", str(results))
        line = json.loads((results / "gpu_check.jsonl").read_text())["results"]
        assert line["status"] == status and line["timed_out"], line
        assert ("cut at the stage's budget: 2 s were left of 2 s" in line.get("skipped", "")) == (status == "skip")


def test_compile_checks_are_skipped_where_the_node_cannot_compile(monkeypatch, tmp_path):
    """torch.compile needs a C compiler and Python.h on the node; without them the compile checks are recorded skips
    that say what is missing, before anything starts. The control: with both, a one-line compile decides."""
    monkeypatch.setattr(runner, "_compile_checked", [])
    monkeypatch.setenv("CC", "gpucheck-no-such-compiler")
    assert "gpucheck-no-such-compiler is not on PATH" in runner.missing(("compile",))
    names = [c.name for c in plan.plan(1, tmp_path) if "compile" in c.needs]
    assert names and all("compile" in n for n in names)
    monkeypatch.setattr(runner, "_compile_checked", [])
    monkeypatch.setenv("CC", "true")  # a program that exists: the headers decide next
    import sysconfig
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert f"{tmp_path / 'Python.h'} does not exist" in runner.missing(("compile",))


# ------------------------------------------------------------------------------------------------ the claims
GOOD = dict(device="cuda:0", world_size=2, replicas_identical=True, replica_checksums=["x", "x"], test_accuracy=0.9,
            epochs=[dict(train_loss=2.2, test_loss=2.0, samples_per_second=900.0),
                    dict(train_loss=1.1, test_loss=1.0, samples_per_second=1000.0)])


def _claims(metrics, code=0, **check):
    c = plan.Check(name="t", stage=1, command=["x"], estimate=1, claims=plan.TRAINER_CLAIMS, world=2,
                       min_accuracy=0.85, **check)
    return verify.verify(c, code, "", metrics)[0]


@pytest.mark.parametrize("change, complaint", [
    (dict(replicas_identical=False), "replicas differ"),
    (dict(replica_checksums=["x", "y"]), "replicas differ"),
    (dict(replica_checksums=["x"]), "replicas differ"),   # only one rank checked
    (dict(world_size=1, replica_checksums=["x"]), "world size 1"),
    (dict(device="cpu"), "ran on 'cpu'"),
    (dict(test_accuracy=0.5), "below the preset's 0.85"),
    (dict(epochs=[dict(GOOD["epochs"][0]), dict(GOOD["epochs"][1], train_loss=2.5)]), "did not fall"),
    (dict(epochs=[dict(GOOD["epochs"][0])]), "did not fall"),  # one epoch cannot show it
    (dict(epochs=[dict(GOOD["epochs"][0], train_loss=float("nan")), GOOD["epochs"][1]]), "not finite"),
    (dict(epochs=[GOOD["epochs"][0], dict(GOOD["epochs"][1], samples_per_second=None)]), "no throughput"),
])
def test_each_claim_fails_when_its_fact_is_wrong(change, complaint):
    assert _claims(GOOD) == []
    bad = _claims(dict(GOOD, **change))
    assert any(complaint in b for b in bad), bad


def test_an_exit_code_of_0_without_metrics_fails_and_a_refusal_must_be_one_line_and_train_nothing():
    assert _claims(None) == ["no metrics.json"] and _claims(GOOD, code=None) == ["timed out"]
    refusal = plan.Check(name="r", stage=1, command=["x"], estimate=1, claims=("refusal",), expect_error="NCCL")
    assert verify.verify(refusal, 1, "error: NCCL cannot\nerror: NCCL cannot\n", None)[0] == []
    assert verify.verify(refusal, 0, "error: NCCL cannot\n", None)[0]            # it exited 0
    assert verify.verify(refusal, 1, "error: other\n", None)[0]                  # another error
    assert verify.verify(refusal, 1, "error: NCCL cannot\n", GOOD)[0]            # and it trained anyway


def test_the_accuracy_bounds_are_the_notebooks():
    from tutorial.lessons.notebook import EXPECTED_ACCURACY
    assert all(EXPECTED_ACCURACY[preset] == bound for preset, bound in plan.ACCURACY_BOUND.items())


# ------------------------------------------------------------------------------------------------ the bundle
def _pins() -> list[tuple[str, str, int]]:
    pins = []
    for line in BUNDLE_LIST.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([0-9][A-Za-z0-9.]*)\s+#\s*(\d+)", line.strip())
            assert m, f"not `name==version  # bytes`: {line!r}"
            pins.append((m[1], m[2], int(m[3])))
    return pins


def test_the_bundle_is_pinned_under_60_mib_and_carries_only_what_the_node_lacks():
    pins = _pins()
    names = {n.lower().replace("_", "-") for n, _, _ in pins}
    assert len(names) == len(pins)
    # the node has these (and what they need); carrying them would only spend the 60 MiB
    assert not names & {"torch", "torchvision", "triton", "lightning", "numpy", "scipy", "scikit-learn", "matplotlib",
                        "tensorboard", "psutil", "filelock", "mpi4py", "pillow", "pyyaml", "tqdm", "jinja2"}
    assert {"ipykernel", "nbclient", "ipyparallel", "py-spy", "deepspeed", "hjson", "pydantic",
            "ipython-pygments-lexers"} <= names
    required = {line.split("==")[0].lower(): line.split("==")[1].split()[0]
                for line in (ROOT / "requirements.txt").read_text().splitlines() if "==" in line}
    for name, version, _ in pins:  # one version of each package for the venv and the node
        assert required.get(name.lower(), version) == version, name
    # The recorded sizes are the cp312 wheels as make gpu-bundle downloaded them; a bundle built here from this very
    # list (its BUNDLE stamp names the list's hash) is measured instead.
    recorded = sum(size for _, _, size in pins)
    assert recorded <= 60 * MiB, f"{recorded / MiB:.1f} MiB"
    built = ROOT / ".whl"
    stamp = built / "BUNDLE"
    if stamp.exists() and stamp.read_text().split()[0] == hashlib.sha256(BUNDLE_LIST.read_bytes()).hexdigest()[:16]:
        wheels = list(built.glob("*.whl"))
        assert len(wheels) == len(pins) and sum(w.stat().st_size for w in wheels) <= 60 * MiB


def test_a_bundle_build_without_its_build_tools_says_which_in_one_line(tmp_path):
    """make gpu-bundle on a machine without .venv used the system python3 (no torch, no wheel) and ended with only
    "40 wheels for 41 pins"; now the missing tool is named before anything is downloaded. A bare venv stands in."""
    subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    proc = subprocess.run(["bash", "scripts/gpu_bundle.sh"], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env=dict(env(), WHEELS=str(tmp_path / "wheels"), BUILD_PYTHON=str(tmp_path / "bare/bin/python")))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "cannot build DeepSpeed's wheel: it has no torch" in lines[0]
    assert not list((tmp_path / "wheels").glob("*.whl"))


def _bundle_for_this_python() -> Path:
    """The pinned list's wheels for this Python (the node's is 3.12), built once and cached, as make gpu-bundle does."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    folder = Path.home() / ".cache" / "tutorial-workbook" / f"gpu-bundle-py{version}"
    proc = subprocess.run(["bash", "scripts/gpu_bundle.sh"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=dict(env(), WHEELS=str(folder), GPU_PYTHON_VERSION=version, BUILD_PYTHON=PYTHON))
    assert proc.returncode == 0 and "MiB of at most 60" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    return folder


# ------------------------------------------------------------------------------------------ Horovod's NCCL
def test_horovod_finds_pips_nccl_through_a_folder_with_libnccl_so(tmp_path):
    nccl = tmp_path / "site" / "nvidia" / "nccl"
    (nccl / "include").mkdir(parents=True)
    (nccl / "lib").mkdir()
    (nccl / "include" / "nccl.h").write_text("/* nccl */\n")
    (nccl / "lib" / "libnccl.so.2").write_text("")
    proc = subprocess.run(["bash", "scripts/install_horovod.sh", "--nccl-lookup", str(tmp_path / "site"),
                           str(tmp_path / "scratch")], capture_output=True, text=True, cwd=ROOT, timeout=60)
    found = dict(line.split("=", 1) for line in proc.stdout.splitlines())
    assert proc.returncode == 0, proc.stderr
    assert found["HOROVOD_NCCL_LINK"] == "SHARED" and found["HOROVOD_NCCL_HOME"] == str(tmp_path / "scratch")
    lib, include = Path(found["HOROVOD_NCCL_LIB"]), Path(found["HOROVOD_NCCL_INCLUDE"])
    assert (lib / "libnccl.so").resolve() == (nccl / "lib" / "libnccl.so.2").resolve()  # what FindNCCL looks for
    assert (include / "nccl.h").read_text() == "/* nccl */\n"
    (nccl / "lib" / "libnccl.so.2").unlink()  # negative control: no library, one error line
    proc = subprocess.run(["bash", "scripts/install_horovod.sh", "--nccl-lookup", str(tmp_path / "site"),
                           str(tmp_path / "scratch2")], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode != 0 and "no libnccl.so" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------ the CPU rehearsal
REHEARSED = ["probe", "single-bf16-channels-last", "ddp-gloo-2-ranks-on-1-gpus", "ddp-nccl-shared-gpu-refused",
             "control-hang", "control-missing-program", "control-exit-code-only", "control-failing-notebook"]


def late_checks(lines: list[dict]) -> dict:
    """The checks of gpu_check.jsonl lines that ran to their end in more than 1.5 x their estimate + 5 s (the
    runner's over_estimate) times how much busier than its cores the machine was (the line's load average: on make
    test's 2 cores the notebook lane, and here other work, run beside the rehearsal)."""
    late = {}
    for line in lines:
        r, slowdown = line["results"], max(1.0, line["load_average"][0] / line["hardware"]["usable_cores"])
        allowed = slowdown * (verify.OVERRUN * r["estimate_seconds"] + verify.OVERRUN_SLACK)
        if "seconds" in r and not r["timed_out"] and r["seconds"] > allowed:
            late[r["check"]] = f"{r['seconds']} s, {allowed:.0f} allowed"
    return late


def test_late_checks_counts_the_load_and_only_runs_that_ended():
    """The control of the rehearsal's time check: 60 s for an estimate of 12 on a quiet machine is late; on one ten
    times busier than its cores, or cut at its timeout, it is not evidence of an overrun."""
    def line(load, timed_out=False):
        return dict(load_average=[load], hardware=dict(usable_cores=2),
                    results=dict(check="c", seconds=60.0, estimate_seconds=12, timed_out=timed_out))
    assert late_checks([line(1.0)]) == {"c": "60.0 s, 23 allowed"}
    assert late_checks([line(20.0)]) == {} and late_checks([line(1.0, timed_out=True)]) == {}


def _leftovers(marker: str) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(marker in part for part in (p.info["cmdline"] or [])):
            found.append(p.pid)
    return found


def test_the_cpu_rehearsal_of_stage_1(tmp_path):
    """Stage 1's driver through scripts/gpu_check.sh as on an offline node (no venv: this Python plus the bundle in a
    scratch folder), on the CPU with the smoke preset: a subset of stage 1 (the probe, a single-process trainer, two
    ranks sharing a device over gloo, NCCL's refusal) and the negative controls. The rest of stage 1 runs the same
    driver on the same code paths; make test executes the notebooks (strict nbval, the simulated-GPU lane)."""
    wheels = _bundle_for_this_python()
    results = tmp_path / "results"
    start = time.monotonic()
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--stage", "1", "--rehearse", "--only", ",".join(REHEARSED),
                           "--results-dir", str(results)], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=dict(env(), VENV=str(tmp_path / "no-venv"), PYTHON=PYTHON, WHEELS=str(wheels),
                                   TMPDIR=str(tmp_path)))
    seconds = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out  # the controls fail, so the stage does
    assert re.search(r"gpu-check: \d+ wheels from .* installed into", out), out
    assert f"gpu-check stage 1: torch {torch.__version__}" in out  # it says which torch it found
    lines = [json.loads(x) for x in (results / "gpu_check.jsonl").read_text().splitlines()]
    got = {line["results"]["check"]: line["results"] for line in lines}
    assert list(got) == REHEARSED, out  # one line per check, in order, as each ended
    assert all(line["hardware"]["cores"] and line["versions"]["torch"] and line["date"] for line in lines)
    for name in REHEARSED[:4]:
        assert got[name]["status"] == "pass", (name, got[name])
    # An overrun of what every machine runs (Python's and torch's start, the launcher's rendezvous, the refusal, a
    # kernel's start) fails here (late_checks).
    assert late_checks(lines) == {}, out
    # the packages came from the bundle, not from this venv
    packages = got["probe"]["probe"]["packages"]
    assert all(str(tmp_path) in packages[p] for p in ("ipykernel", "nbclient", "ipyparallel", "deepspeed")), packages
    trained = got["ddp-gloo-2-ranks-on-1-gpus"]
    assert trained["world_size"] == 2 and trained["replicas_identical"] is True
    assert trained["train_losses"][-1] < trained["train_losses"][0] and trained["test_accuracy"] >= 0.95
    hang = got["control-hang"]
    assert hang["status"] == "FAIL" and hang["timed_out"] and hang["seconds"] < 15
    assert not _leftovers("gpucheck-control-orphan") and not _leftovers("gpucheck-control-hang")
    assert got["control-missing-program"]["status"] == "skip"
    assert "gpucheck-no-such-program is not installed" in got["control-missing-program"]["skipped"]
    fake = got["control-exit-code-only"]
    assert fake["status"] == "FAIL" and fake["exit_code"] == 0 and "replicas differ" in fake["failed_claims"][0]
    notebook = got["control-failing-notebook"]
    kept = [Path(p) for p in notebook["kept"] if p.endswith(".ipynb")]
    assert notebook["status"] == "FAIL" and kept and str(results) in str(kept[0])
    assert "control: the claim fails" in kept[0].read_text()  # the executed notebook, its error included
    print(f"rehearsal: {seconds:.0f} s")
    assert os.environ.get("CI") != "true" or seconds < 180

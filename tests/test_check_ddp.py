"""`tutorial check-ddp`: every mistake of the zoo (tests/ddp_zoo/) is found and named, the correct scripts get no
finding, bad input exits 2 in one line, the bounds stop every rank together, and nothing is left behind.

Each zoo script is checked once (a module fixture caches the reports); every test asserts one script's findings.
The correct scripts and the mistakes are each other's negative controls: a checker that names nothing fails the
mistakes, one that names too much fails the correct scripts (and every mistake must be the only finding).
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, env

from tutorial.checkddp.command import main
from tutorial.checkddp.findings import analyse
from tutorial.checkddp.recorder import REPORT_FILE
from tutorial.checkddp.run import check_ddp
from tutorial.launch.child_processes import TAG, leftovers

ZOO = ROOT / "tests" / "ddp_zoo"
STANDALONE = ROOT / "examples" / "ddp_standalone.py"
MISTAKES = {  # script -> the one finding it must get
    "no_process_group": "no-process-group",
    "world_size_1": "world-size-1",
    "no_distributed_sampler": "no-distributed-sampler",
    "set_epoch": "set-epoch",
    "overlapping_shards": "overlapping-shards",
    "changed_after_wrap": "changed-after-wrap",
    "replicas_differ": "replicas-differ",
    "unbroadcast_initial_weights": "unbroadcast-initial-weights",
    "every_rank_writes": "every-rank-writes",
    "wrapper_checkpoint": "wrapper-checkpoint",
    "lr_not_scaled": "lr-not-scaled",
    "unreduced_metrics": "unreduced-metrics",
    "no_sync": "no-sync",
    "same_augmentation": "same-augmentation",
    "uneven_inputs": "uneven-inputs",
    "hang": "hang",
    "rank_killed": "rank-died",
    "no_destroy": "no-destroy",
}
CORRECT = {"ok_grad_accumulation": [], "ok_multigpu_torchrun": ["2", "1"]}  # and ddp_standalone, from the shell
MAX_SECONDS = 60.0


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def files(folder: Path) -> set[str]:
    """Every file under folder, as a path relative to it; caches (__pycache__) left out."""
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """name -> Report; each script checked once, on first use, from an empty working directory of its own, with
    the scratch folder `check` inside it (the scratch-folder test looks there for anything else)."""
    reports = {}

    def get(name):
        if name not in reports:
            script = ZOO / f"{name}.py"
            before, home, cwd = digest(script), tmp_path_factory.mktemp(name), os.getcwd()
            os.chdir(home)
            try:  # the one-process lr run where it matters: the correct scripts and the unscaled lr (a launch each)
                report = check_ddp(script, CORRECT.get(name, []), out=home / "check", max_seconds=MAX_SECONDS,
                                   lr_check=name in CORRECT or name == "lr_not_scaled")
            finally:
                os.chdir(cwd)
            assert digest(script) == before, "the check changed the script"
            reports[name] = report
        return reports[name]
    get.zoo_files = files(ZOO)  # before any check: a script's files must not land beside it either
    return get


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_every_mistake_is_found_and_named(zoo, name):
    report = zoo(name)
    assert report.names == [MISTAKES[name]], report.text()
    assert report.exit_code == (0 if name == "lr_not_scaled" else 1)  # a warning does not fail the check
    assert all(len(f.line().splitlines()) == 1 for f in report.findings)


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_correct_scripts_get_no_finding(zoo, name):
    report = zoo(name)
    assert report.findings == [] and report.exit_code == 0, report.text()
    assert len(set(report.steps.values())) == 1 and report.steps[0] >= 8  # every rank trained, the same steps


def test_the_set_epoch_finding_names_the_training_loop(zoo):
    finding = zoo("set_epoch").findings[0]
    loop = next(i for i, line in enumerate((ZOO / "set_epoch.py").read_text().splitlines(), 1)
                if line.strip() == "for X, y in loader:")
    assert finding.where == f"tests/ddp_zoo/set_epoch.py:{loop}" or finding.where.endswith(f"set_epoch.py:{loop}")
    assert "set_epoch(epoch)" in finding.message


def test_findings_point_at_the_line_that_made_the_call(zoo):
    lines = {name: (ZOO / f"{name}.py").read_text().splitlines() for name in ("every_rank_writes", "no_sync",
                                                                              "wrapper_checkpoint")}
    for name, code in (("every_rank_writes", "torch.save("), ("wrapper_checkpoint", "torch.save("),
                       ("no_sync", "model(micro_X)")):
        line = int(zoo(name).findings[0].where.rsplit(":", 1)[1])
        assert code in lines[name][line - 1], (name, lines[name][line - 1])


def test_the_hang_and_the_killed_rank_are_stopped_and_leave_nothing(zoo):
    hang, killed = zoo("hang"), zoo("rank_killed")
    assert hang.seconds < MAX_SECONDS, "the hang was found by its ranks standing still, not by the deadline"
    assert "dist.barrier()" in hang.findings[0].message and "rank 1 at" in hang.findings[0].message
    assert "rank 1 was killed by SIGKILL" in killed.findings[0].message
    left = [p for p in leftovers(TAG) if not p["zombie"] and ("tutorial.checkddp.recorder" in p["cmdline"]
                                                              or "torch.distributed.run" in p["cmdline"])]
    assert left == []


def test_the_scripts_files_land_in_the_scratch_folder(zoo):
    """The script saves checkpoint.pt to a relative path. Its working directory (the folder the check ran from)
    gains nothing but the scratch folder, the script's own folder gains nothing, and every file the ranks opened for
    writing is in the scratch folder's run/. Negative control: a check that leaves the script in the caller's working
    directory (no TUTORIAL_CHECK_CWD) fails the first assertion with checkpoint.pt."""
    report = zoo("every_rank_writes")
    out = Path(report.out)
    assert [p.name for p in out.parent.iterdir()] == [out.name]
    assert files(ZOO) == zoo.zoo_files
    ranks = [json.loads((out / "ranks" / REPORT_FILE.format(r)).read_text()) for r in (0, 1)]
    written = {Path(w["path"]).resolve() for rank in ranks for w in rank["write_paths"]}
    assert written == {(out / "run" / "checkpoint.pt").resolve()} and (out / "run" / "checkpoint.pt").exists()
    assert (out / "report.txt").exists()


def test_the_analysis_finds_what_is_doctored_into_a_correct_run(zoo):
    """Negative controls of the analysis itself: a correct run's reports, changed to show a mistake."""
    out = Path(zoo("ok_grad_accumulation").out)
    reports = {r: json.loads((out / "ranks" / REPORT_FILE.format(r)).read_text()) for r in (0, 1)}
    run = {"reports": reports, "progress": {}, "output": "", "hung": False,
           "overran": False, "returncode": 0, "augment": {}, "max_seconds": 60}
    assert analyse(run, 2)[0] == []
    doctored = copy.deepcopy(run)
    for sampler in doctored["reports"][1]["samplers"].values():
        for it in sampler["iterations"]:
            it["epoch"], it["order"] = 0, 1
    assert [f.name for f in analyse(doctored, 2)[0]] == ["set-epoch"]
    doctored = copy.deepcopy(run)
    doctored["reports"][1]["checksums"]["ddp0"] = "0" * 16
    assert [f.name for f in analyse(doctored, 2)[0]] == ["replicas-differ"]
    doctored = copy.deepcopy(run)
    doctored["reports"][0]["sync_forwards"] = [4] * 8
    assert [f.name for f in analyse(doctored, 2)[0]] == ["no-sync"]


def test_max_steps_stops_every_rank_after_the_same_step(tmp_path):
    report = check_ddp(ZOO / "set_epoch.py", max_steps=6, out=tmp_path / "check", lr_check=False)
    assert report.steps == {0: 6, 1: 6}, report.text()  # 4 steps an epoch: stopped inside the second epoch
    assert report.findings == [] and any("--max-steps 6" in n for n in report.notes)  # one whole epoch: unchecked


def test_max_seconds_stops_every_rank_after_the_same_step(tmp_path):
    script = tmp_path / "forever.py"
    script.write_text((ZOO / "ok_grad_accumulation.py").read_text()
                      .replace("for epoch in range(2):", "for epoch in range(10**6):")
                      .replace("            optimizer.step()\n", "            optimizer.step()\n"
                               "            __import__('time').sleep(0.05)\n"))
    report = check_ddp(script, max_seconds=4, out=tmp_path / "check", lr_check=False)
    assert report.findings == [], report.text()
    assert len(set(report.steps.values())) == 1 and report.steps[0] > 0
    assert any("--max-seconds 4" in n for n in report.notes)


def test_the_command_line_accepts_the_standalone_example(tmp_path):
    """The third correct script, checked as the README says: `tutorial check-ddp examples/ddp_standalone.py`."""
    before = digest(STANDALONE)
    proc = subprocess.run([sys.executable, "-m", "tutorial", "check-ddp", str(STANDALONE), "--out",
                           str(tmp_path / "check")], capture_output=True, text=True, env=env(), cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    header, verdict = proc.stdout.strip().splitlines()  # no finding, no warning, no note
    assert "on 2 ranks" in header and "115 optimizer steps per rank" in header  # 5 epochs of 23 steps, all run
    assert verdict.startswith("ok: nothing wrong found")
    assert (tmp_path / "check" / "run" / "runs" / "ddp_standalone" / "model.pt").exists()  # its files, in scratch
    assert digest(STANDALONE) == before


@pytest.mark.parametrize("argv, named", [
    (["missing.py"], "script 'missing.py' is not a file"),
    ([str(STANDALONE), "--nproc", "0"], "--nproc 0 is not allowed"),
    ([str(STANDALONE), "--max-seconds", "0"], "--max-seconds 0.0 is not allowed"),
    ([str(STANDALONE), "--max-steps", "0"], "--max-steps 0 is not allowed"),
    ([str(STANDALONE), "--out", str(ROOT / "src")], "is not an empty folder"),
    ([str(STANDALONE), "--nproc", "two"], "argument --nproc: invalid int value: 'two'"),
    ([], "the following arguments are required: script"),
])
def test_bad_input_exits_2_with_one_line(argv, named, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and len(err.strip().splitlines()) == 1, err


def test_bad_input_from_the_shell_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "tutorial", "check-ddp", "missing.py"], capture_output=True,
                          text=True, env=env(), cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: script 'missing.py' is not a file: give the path of your Python training script"]

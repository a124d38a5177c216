"""10_when_things_go_wrong, section 13 (the hang lab): three hangs planted on two engines, every rank's flight
recorder written at the real timeout (`lesson.dump_on_timeout`, what TORCH_NCCL_DUMP_ON_TIMEOUT does for NCCL), and
torch's own analyzer (`torchfrtrace`) reading the files. The notebook's cells assert all three verdicts; here two of
the hangs, each the other's negative control (a skipped collective is a type mismatch at #4, a rank busy in its own
work is a rank that never joined #4, written while it was still busy), and the controls: the dump as gloo writes it
(its group table under '') breaks the analyzer, and a run without a hang writes nothing."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from tutorial.lessons import failures as lesson

TIMEOUT_S = 5  # the groups' timeout: how long each planted hang lasts

INIT = f"""
import datetime, time, torch, torch.distributed as dist
from tutorial.lessons import failures as lesson
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds={TIMEOUT_S}))
rank = dist.get_rank()
"""

HANGS = {  # what runs inside `with lesson.dump_on_timeout(folder):`, after three all-reduces every rank makes
    "skipped": """
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # a metric only rank 0 reduces
    dist.barrier()
""",
    "busy": f"""
    if rank == 1:
        start = time.monotonic()
        while time.monotonic() - start < {TIMEOUT_S + 3}:  # its own work on the CPU (a metric, a batch)
            torch.randn(256, 256) @ torch.randn(256, 256)
    dist.all_reduce(torch.ones(4))
""",
    "none": """
    dist.all_reduce(torch.ones(4))
""",
}

VERDICTS = {
    "skipped": ["collective #4: COLLECTIVE_TYPE_MISMATCH: Expected collective type: 'barrier' does not match found "
                "collective type: 'all_reduce' (culprit rank 0)"],
    "busy": ["collective #4: rank(s) {1} never joined all_reduce"],
    "none": ["no mismatch"],
}


def code(hang: str, folder: str) -> str:
    """What the engines run for `hang`: a fresh gloo group, three all-reduces and the hang in dump_on_timeout."""
    return (INIT + f"with lesson.dump_on_timeout({folder!r}):\n    for step in range(3):\n"
            f"        dist.all_reduce(torch.ones(4))\n{HANGS[hang]}" + "\ndist.destroy_process_group()\n")


def plant(cluster, hang: str, folder: str) -> list:
    """Run `hang` on both engines; each engine's stdout."""
    cluster.new_master_port()
    run = cluster.view.execute(code(hang, folder), block=False)
    run.get(timeout=4 * TIMEOUT_S + 60)
    return [out.strip() for out in run.stdout]


def analyze(folder: str) -> subprocess.CompletedProcess:
    """torchfrtrace on `folder`; it writes its report through logging, to stderr, so stdout carries both."""
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchfrtrace"), folder],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)


@pytest.fixture(scope="module")
def planted(cluster, tmp_path_factory):
    """Every hang planted once (about 5 + 8 s of timeouts): {hang: (folder, the engines' stdout)}."""
    root = tmp_path_factory.mktemp("hangs")
    return {hang: (str(root / hang), plant(cluster, hang, str(root / hang))) for hang in HANGS}


@pytest.mark.parametrize("hang", sorted(HANGS))
def test_the_analyzer_classifies_each_planted_hang_from_the_dumps_of_its_real_timeout(planted, hang):
    folder, stdout = planted[hang]
    if hang == "none":
        assert not os.path.exists(folder) and stdout == ["", ""], (folder, stdout)
    else:
        assert sorted(os.listdir(folder)) == [f"{lesson.FR_PREFIX}0", f"{lesson.FR_PREFIX}1"]
        assert all(line.endswith("; flight recorder written") for line in stdout), stdout
    report = analyze(folder) if hang != "none" else None
    if report is not None:
        assert report.returncode == 0, report.stdout[-2000:]
        assert lesson.fr_verdicts(report.stdout) == VERDICTS[hang], report.stdout
        # the summary's line is the compared call's in the code as the engine numbers it (IPython drops the first
        # blank line): rank 1's barrier for the skipped collective, rank 0's all-reduce that rank 1 never joined
        call = {"skipped": "    dist.barrier()", "busy": "    dist.all_reduce(torch.ones(4))"}[hang]
        line = next(i for i, text in enumerate(code(hang, folder).lstrip("\n").splitlines(), 1) if text == call)
        assert lesson.fr_summary(report.stdout).endswith(f"called at line {line} of the cell"), report.stdout
        assert "internal record id" not in lesson.fr_summary(report.stdout)
        for rank in (0, 1):  # each dump holds exactly this group's collectives: three all-reduces and the hang's
            with open(os.path.join(folder, f"{lesson.FR_PREFIX}{rank}"), "rb") as f:
                entries = pickle.load(f)["entries"]
            seqs = [e["collective_seq_id"] for e in entries]
            assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) == (3 if (hang, rank) == ("busy", 1) else 4)


def test_the_busy_rank_wrote_its_dump_while_still_in_its_own_work(planted):
    """Its dump has only the three all-reduces although its main thread later called a fourth: the watcher
    thread wrote it at rank 0's timeout, as NCCL's watchdog would."""
    folder, stdout = planted["busy"]
    assert stdout[0] == "rank 0: Timed out waiting 5000ms for recv operation to complete; flight recorder written"
    assert stdout[1].startswith("rank 1: ") and "Timed out" not in stdout[1], stdout


def test_control_gloo_s_own_group_table_breaks_the_analyzer(planted, tmp_path):
    """The dump as torch 2.14.1's gloo recorder writes it (every group under '') makes torchfrtrace fail, which is
    why write_flight_record writes the table again."""
    folder, _ = planted["skipped"]
    for rank in (0, 1):
        with open(os.path.join(folder, f"{lesson.FR_PREFIX}{rank}"), "rb") as f:
            record = pickle.load(f)
        record["pg_config"] = {"": {"name": "", "desc": "", "ranks": "[0, 1]"}}
        (tmp_path / f"{lesson.FR_PREFIX}{rank}").write_bytes(pickle.dumps(record))
    report = analyze(str(tmp_path))
    assert report.returncode != 0 and "KeyError" in report.stdout, (report.returncode, report.stdout[-500:])


def test_the_verdicts_are_read_from_the_analyzer_s_own_words():
    report = ("Not all ranks joining collective, sequence number: 7\ninternal record id: 6\n"
              "collective: gloo:broadcast\nmissing ranks: {2, 3}\n")
    assert lesson.fr_verdicts(report) == ["collective #7: rank(s) {2, 3} never joined broadcast"]
    assert lesson.fr_verdicts("") == ["no mismatch"]

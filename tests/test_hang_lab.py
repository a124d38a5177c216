"""10_when_things_go_wrong, section 13 (the hang lab): three hangs planted on two engines, every rank's flight
recorder written at the real timeout (`lesson.dump_on_timeout`, what TORCH_NCCL_DUMP_ON_TIMEOUT does for NCCL), and
torch's own analyzer (`torchfrtrace`) reading the files. The notebook's cells assert all three verdicts; here two of
the hangs, each the other's negative control (a skipped collective is a type mismatch at #4, a rank busy in its own
work is a rank that never joined #4, written while it was still busy), a rank that left its block before the other
timed out (it stays and writes; the two processes' record ids one apart before the block), and the controls: the
dump as gloo writes it (its group table under '') breaks the analyzer, and a run without a hang writes nothing."""
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
        while time.monotonic() - start < {TIMEOUT_S + 5}:  # its own work on the CPU (a metric, a batch)
            torch.randn(256, 256) @ torch.randn(256, 256)
    dist.all_reduce(torch.ones(4))
""",
    "none": """
    dist.all_reduce(torch.ones(4))
""",
    # rank 0 leaves its block normally and rank 1 times out later, alone in a collective; before the block rank 1
    # made a collective of its own (BEFORE), so the two processes' record ids are one apart
    "after": """
    if rank == 1:
        dist.all_reduce(torch.ones(1))
""",
}
BEFORE = {"after": """solo = dist.new_group([1])  # every rank makes the group; only rank 1 uses it
if rank == 1:
    dist.all_reduce(torch.ones(2), group=solo)
"""}

VERDICTS = {
    "skipped": ["collective #4: COLLECTIVE_TYPE_MISMATCH (all_reduce, barrier)"],
    "busy": ["collective #4: rank(s) {1} never joined all_reduce"],
    "none": ["no mismatch"],
    "after": ["collective #4: rank(s) {0} never joined all_reduce"],
}


def code(hang: str, folder: str) -> str:
    """What the engines run for `hang`: a fresh gloo group, three all-reduces and the hang in dump_on_timeout."""
    return (INIT + BEFORE.get(hang, "") + f"with lesson.dump_on_timeout({folder!r}):\n    for step in range(3):\n"
            f"        dist.all_reduce(torch.ones(4))\n{HANGS[hang]}" + "\ndist.destroy_process_group()\n")


def plant(cluster, hang: str, folder: str) -> list:
    """Run `hang` on both engines; each engine's stdout."""
    cluster.new_master_port()
    run = cluster.view.execute(code(hang, folder), block=False)
    run.get(timeout=4 * TIMEOUT_S + 60)
    run.wait_for_output(30)  # an engine's last lines may arrive after its result (fc33: rank 0's went missing)
    return [out.strip() for out in run.stdout]


def analyze(folder: str) -> subprocess.CompletedProcess:
    """torchfrtrace on `folder`; it writes its report through logging, to stderr, so stdout carries both."""
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchfrtrace"), folder],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)


@pytest.fixture(scope="module")
def planted(cluster, tmp_path_factory):
    """Every hang planted once (about 5 + 10 + 5 s of timeouts): {hang: (folder, the engines' stdout)}."""
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
        if hang == "after":  # rank 0 left its block before rank 1's timeout, and stayed to write
            assert stdout[0] == "rank 0: another rank's collective failed; flight recorder written", stdout
    report = analyze(folder) if hang != "none" else None
    if report is not None:
        assert report.returncode == 0, report.stdout[-2000:]
        assert lesson.fr_verdicts(report.stdout) == VERDICTS[hang], report.stdout
        # the summary's line is the compared call's in the code as the engine numbers it (IPython drops the first
        # blank line): rank 1's barrier for the skipped collective, rank 0's all-reduce that rank 1 never joined
        if hang == "busy":  # rank 0's all-reduce that rank 1 never joined, whichever file the analyzer read first
            line = next(i for i, text in enumerate(code(hang, folder).lstrip("\n").splitlines(), 1)
                        if text == "    dist.all_reduce(torch.ones(4))")
            assert lesson.fr_summary(report.stdout).endswith(f"called at line {line} of the cell"), report.stdout
        assert "internal record id" not in lesson.fr_summary(report.stdout)
        for rank in (0, 1):  # each dump holds exactly this group's collectives: three all-reduces and the hang's
            with open(os.path.join(folder, f"{lesson.FR_PREFIX}{rank}"), "rb") as f:
                entries = pickle.load(f)["entries"]
            seqs = [e["collective_seq_id"] for e in entries]
            assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) == (3 if (hang, rank) in (
                ("busy", 1), ("after", 0)) else 4)
            assert [e["record_id"] for e in entries] == list(range(len(entries)))  # numbered from 0 on each rank


def test_the_busy_rank_wrote_its_dump_while_still_in_its_own_work(planted):
    """Its dump has only the three all-reduces although its main thread later called a fourth: the watcher
    thread wrote it at rank 0's timeout, as NCCL's watchdog would."""
    folder, stdout = planted["busy"]
    assert stdout[0] == "rank 0: Timed out waiting 5000ms for recv operation to complete; flight recorder written"
    assert stdout[1].startswith("rank 1: ") and "Timed out" not in stdout[1], stdout


RAW = """
import datetime, os, torch, torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
dist.all_reduce(torch.ones(4))
raw = _dump_fr_trace(True, False, False)
with open(os.path.join(folder, f"fr_trace_rank_{dist.get_rank()}"), "wb") as f:
    f.write(raw)
dist.destroy_process_group()
"""


def test_control_gloo_s_own_dump_breaks_the_analyzer(cluster, tmp_path):
    """The dump as torch's gloo recorder writes it, taken on the engines: every group under '' in its table, and
    torchfrtrace fails on it (KeyError). Why write_flight_record writes the table again; when torch mends it, this
    fails and the mending can go."""
    cluster.new_master_port()
    cluster.view.push({"folder": str(tmp_path)}, block=True)
    cluster.view.execute(RAW, block=True).get(timeout=60)
    for rank in (0, 1):
        with open(tmp_path / f"{lesson.FR_PREFIX}{rank}", "rb") as f:
            assert set(pickle.load(f)["pg_config"]) == {""}
    report = analyze(str(tmp_path))
    assert report.returncode != 0 and "KeyError" in report.stdout, (report.returncode, report.stdout[-500:])


def test_the_verdicts_are_read_from_the_analyzer_s_own_words_and_nothing_else_is_no_mismatch():
    report = ("Not all ranks joining collective, sequence number: 7\ninternal record id: 6\n"
              "collective: gloo:broadcast\nmissing ranks: {2, 3}\n")
    assert lesson.fr_verdicts(report) == ["collective #7: rank(s) {2, 3} never joined broadcast"]
    either = "error msg: Culprit rank {}; Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective type: '{}' does " \
             "not match found collective type: '{}'"
    for culprit, expected, found in ((0, "barrier", "all_reduce"), (1, "all_reduce", "barrier")):  # either file first
        report = f"Collective sequence number: 4 has errors\n{either.format(culprit, expected, found)}\n"
        assert lesson.fr_verdicts(report) == ["collective #4: COLLECTIVE_TYPE_MISMATCH (all_reduce, barrier)"]
    assert lesson.fr_verdicts("") == ["no mismatch"]
    for unread in ("Traceback (most recent call last):\nKeyError: ('0', 1)",  # the analyzer failed
                   "ValueError: Missing dump files from ranks {1}",
                   "We cannot decide what's wrong with this collective entry because we missed FR dumps from ranks "
                   "({1}) so we don't have enough information."):
        with pytest.raises(ValueError):
            lesson.fr_verdicts(unread)


def test_an_error_of_the_learners_own_code_leaves_the_block_as_it_came_and_asks_for_nothing(cluster, tmp_path):
    """A RuntimeError raised by the code in the block, not by a collective, is no hang: it is raised as it came, on
    every rank, and no rank asks for dumps or writes one (nor waits for the others)."""
    cluster.new_master_port()
    folder = str(tmp_path / "mine")
    run = cluster.view.execute(INIT + f"""
try:
    with lesson.dump_on_timeout({folder!r}):
        dist.all_reduce(torch.ones(4))
        raise RuntimeError("a shape the learner got wrong")
except RuntimeError as exc:
    print("raised:", exc)
dist.destroy_process_group()
""", block=False)
    run.get(timeout=60)
    run.wait_for_output(30)
    assert [out.strip() for out in run.stdout] == ["raised: a shape the learner got wrong"] * 2
    assert not os.path.exists(folder)

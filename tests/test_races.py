"""No race: ports held from the moment they are chosen, rendezvous under contention, ranks that agree before they resume
(issue 38).

A fresh clone's `make test` hung in 08 [13]: rank 0's cell ended at once while rank 1 waited to connect to
127.0.0.1:36391, where nobody listened. The port was chosen free in [10] and bound seconds later in [13]; these tests
show how a port chosen that way is lost (and that a held one cannot be), run attendees' engines and torchrun at once
(two attendees in make test, four in the soak, TUTORIAL_SOAK=1), and make ranks that see different checkpoints stop
together instead of silently diverging.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import PYTHON, ROOT, env, torchrun_cmd

from tutorial.core.distributed import World, hold_port, init_process_group
from tutorial.core.process import free_port
from tutorial.launch import child_processes

HERE = Path(__file__).resolve().parent


def _rank_1(port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_process_group(World(1, 1, 2, 2), torch.device("cpu"), timeout=60)
    total = torch.ones(1)
    dist.all_reduce(total)
    queue.put(total.item())
    dist.destroy_process_group()


def test_a_port_chosen_free_can_be_lost_before_the_rendezvous_and_a_held_one_cannot(monkeypatch):
    """How 08 [13] can end rank 0's cell at once: between the cell that chose a free port and the one whose
    rendezvous binds it, another process on the node binds the same port (any bind, even one held for an instant:
    free_port itself is one, and the unit tests beside the notebook make hundreds). Rank 0's store then cannot
    listen (EADDRINUSE) and its cell fails; rank 1 retries connecting there, where nobody listens, for the rendezvous
    timeout. A port held by hold_port is taken over by the rendezvous itself, so nobody can bind it in between."""
    def thief(port):  # another process's socket on the port, at the wrong moment
        s = socket.socket()
        s.bind(("127.0.0.1", port))
        return s

    # Control: the port the engines used to be given (free when chosen) is lost to the thief.
    port = free_port()
    stolen = thief(port)
    with pytest.raises(RuntimeError, match="EADDRINUSE|address already in use"):
        dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=5))
    stolen.close()
    # Held: the thief cannot bind it, and rank 0's process group takes over the very server that holds it.
    port = hold_port()
    with pytest.raises(OSError):
        thief(port).close()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    other = ctx.Process(target=_rank_1, args=(port, queue))
    other.start()
    try:
        assert init_process_group(World(0, 0, 2, 2), torch.device("cpu"), timeout=60)
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == 2.0 and queue.get(timeout=60) == 2.0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        other.join(60)
    assert other.exitcode == 0


def _rendezvous_finds(port: int) -> bool:
    """Whether a process group of this process on `port` would find its server in torch's multi-tenant cache (as
    env:// and our init_process_group look it up) instead of binding the port again."""
    try:
        dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=10))
        return True
    except RuntimeError:
        return False


def stale_port() -> int:
    """A port whose multi-tenant server closed: torch's cache still holds its entry (see below)."""
    first = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False)
    port = first.port
    del first  # closed; its cache entry stays
    return port


def test_a_held_port_is_found_by_the_rendezvous_even_where_the_os_hands_out_a_port_again(monkeypatch):
    """torch keeps a closed multi-tenant server's cache entry and does not replace it, so a store the OS later puts on
    the same port is not found: the rendezvous binds the port again and fails with EADDRINUSE (3 of 192 holds in a
    row, and once in make test, before hold_port checked its port). The control shows torch's stale entry itself: a
    server on a port whose earlier multi-tenant server closed is not found. Whether the OS hands such a port out
    again is chance (about 1 hold in 60), so here it does, every time: hold_port's first store gets a stale port
    (as torch leaves it: a server there that the cache does not know), and hold_port must refuse it and hold
    another port, which the rendezvous finds. Without hold_port's check this fails every time."""
    port = stale_port()
    again = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=False, wait_for_workers=False)
    assert not _rendezvous_finds(port)  # torch's stale entry: EADDRINUSE, although a server is right there
    del again

    port, handed, store = stale_port(), [], dist.TCPStore

    def the_os_hands_out_the_stale_port_once(host, asked, *args, **kwargs):
        # what torch makes of a store on port 0 that the OS puts on `port`: a server there, and the cache's entry
        # for the port left as it was (the stale one)
        if asked == 0 and not handed:
            handed.append(port)
            return store(host, port, *args, **{**kwargs, "multi_tenant": False})
        return store(host, asked, *args, **kwargs)

    monkeypatch.setattr(dist, "TCPStore", the_os_hands_out_the_stale_port_once)
    held = hold_port()
    monkeypatch.undo()
    assert handed == [port], "hold_port was never handed the stale port: the test checked nothing"
    assert _rendezvous_finds(held), "the rendezvous binds the held port again: EADDRINUSE"
    assert held != port  # hold_port refused the stale port and held another


# A soak, not a control: the full size runs with TUTORIAL_SOAK=1 (make soak); make test runs a short one.
SOAK = os.environ.get("TUTORIAL_SOAK") == "1"
# notebooks starting engines at once, as on a shared 8-GPU node
ATTENDEES = 4 if SOAK else 2
# process groups typed by hand per attendee, then one by Lightning and one by a trainer
ROUNDS = 10 if SOAK else 3
# at least, beside them: torchrun --standalone, whose agent binds its own port
TORCHRUN_LAUNCHES = 4 if SOAK else 1


# The soak's own bounds, inside pytest-timeout's 300 s, so that a hang fails here with the stuck ranks' stacks.
SOAK_S, TORCHRUN_S = 270.0, 120.0


def launch_or_dump(command: list, tag: str, timeout: float) -> tuple[int | None, str]:
    """Run a torchrun launch; past `timeout`, SIGABRT its ranks and agent (PYTHONFAULTHANDLER prints where each one
    waits) and stop what is left. Returns the exit code (None after a timeout) and the tail of its output."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=env(PYTHONFAULTHANDLER="1", **{child_processes.TAG_VARIABLE: tag}))
    try:
        output, _ = proc.communicate(timeout=max(1.0, timeout))
        return proc.returncode, output[-3000:]
    except subprocess.TimeoutExpired:
        # the ranks, then torchrun's agent (a hang in its rendezvous shows there)
        ranks = sorted(child_processes.leftovers(tag, ("tutorial.train_ddp",)),
                       key=lambda p: "torch.distributed.run" in p["cmdline"])
        for p in ranks:  # one at a time: their stacks would interleave
            with contextlib.suppress(ProcessLookupError):
                os.kill(p["pid"], signal.SIGABRT)
            time.sleep(1.5)
        child_processes.stop([proc.pid] + [p["pid"] for p in child_processes.leftovers(tag, ("torch.distributed",))])
        output, _ = proc.communicate(timeout=30)
        stacks = output[output.find("Fatal Python error"):][:8000]
        return None, f"did not end within {timeout:.0f} s; its ranks' stacks (SIGABRT):\n{stacks}"


def test_attendees_rendezvous_at_once_beside_torchrun(tmp_path):
    """ATTENDEES attendees' engines (2 each) rendezvous again and again at once: ROUNDS groups made by hand as in
    00/03a, one made by Lightning on the engines (08 [13]) and one by train_ddp through cluster.run, while torchrun
    launches train DDP beside them (and, in make test, the notebooks run beside the unit tests). Every rendezvous
    must meet (sums and replicas checked by each attendee), and nothing may be left. A soak, not a control (the
    code before issue 38 passed it too): with TUTORIAL_SOAK=1, 4 x (10 + 2) = 48 engine process groups and at
    least 4 torchrun jobs (60-90 s on 2 cores); in make test, 2 x (3 + 2) = 10 and at least 1."""
    tag = child_processes.new_tag()
    attendees = [subprocess.Popen([PYTHON, str(HERE / "contention_attendee.py"), str(ROUNDS), str(tmp_path / f"a{i}")],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                  env=env(PYTHONPATH=os.pathsep.join([str(HERE), str(ROOT / "src")]),
                                          **{child_processes.TAG_VARIABLE: tag}))
                 for i in range(ATTENDEES)]
    launches, deadline = [], time.monotonic() + SOAK_S
    try:
        while len(launches) < TORCHRUN_LAUNCHES or any(a.poll() is None for a in attendees):
            out = tmp_path / f"torchrun{len(launches)}"
            returncode, output = launch_or_dump(
                torchrun_cmd(2, "ddp", "--preset", "smoke", "--epochs", "1", "--max-steps", "3", "--out", str(out)),
                tag, min(TORCHRUN_S, deadline - time.monotonic()))
            assert returncode == 0, f"torchrun launch {len(launches)}: {output}"
            launches.append(json.loads((out / "metrics.json").read_text())["replicas_identical"])
        reports = []
        for a in attendees:
            stdout, stderr = a.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert a.returncode == 0, stderr[-3000:]
            reports.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for a in attendees:
            if a.poll() is None:
                a.kill()
    print(f"{ATTENDEES} attendees: {[r['seconds'] for r in reports]} s; {len(launches)} torchrun launches beside them")
    assert all(launches)
    assert [(r["by_hand"], r["lightning"], r["trainer"], r["left_after_stop"]) for r in reports] == \
        [(ROUNDS, 1, 1, 0)] * ATTENDEES
    deadline = time.monotonic() + 15
    while child_processes.leftovers(tag, child_processes.PROCESS_NAMES) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert child_processes.leftovers(tag, child_processes.PROCESS_NAMES) == []


# A rank on node-local disk: the same --out, but rank 1 sees an empty folder there (a private mount of its own).
ON_ITS_OWN_DISK = """
if [ "$RANK" = "$LOCAL_DISK_RANK" ]; then
    exec unshare --mount sh -c 'mount -t tmpfs node-local "$0" && exec "$@"' "$OUT" "$@"
fi
exec "$@"
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="a private mount per rank needs root")
def test_ranks_that_find_different_checkpoints_stop_together_instead_of_diverging(tmp_path):
    """--resume where out/ is on node-local disks: rank 0 finds the checkpoint, rank 1 (a mount namespace of its own
    with an empty folder at the same path) finds none. Before, rank 0 resumed and rank 1 started afresh: replicas
    that differ without a word. Now both stop at once with one line naming what each rank found, and nothing is
    trained or written. The control: the same launch without the private disk resumes normally."""
    out = tmp_path / "run"
    first = subprocess.run(torchrun_cmd(2, "ddp", "--preset", "smoke", "--epochs", "1", "--max-steps", "5",
                                        "--out", str(out)), capture_output=True, text=True, timeout=240, cwd=ROOT,
                           env=env())
    assert first.returncode == 0, first.stderr[-3000:]
    saved = (out / "checkpoint.pt").read_bytes()
    wrapper = tmp_path / "node_local.sh"
    wrapper.write_text(ON_ITS_OWN_DISK)

    def resume(local_disk_rank: str) -> subprocess.CompletedProcess:
        cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--no-python",
               "sh", str(wrapper), PYTHON, "-m", "tutorial.train_ddp", "--preset", "smoke", "--epochs", "2",
               "--max-steps", "8", "--out", str(out), "--resume"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                              env=env(OUT=str(out), LOCAL_DISK_RANK=local_disk_rank))

    split = resume("1")
    text = split.stdout + split.stderr
    lines = [line for line in text.splitlines() if "--resume: the ranks found different things" in line]
    assert split.returncode != 0 and lines, text[-3000:]
    assert "rank 0: a checkpoint of" in lines[0] and "rank 1: no checkpoint" in lines[0], lines[0]
    ranks_said = text.split("torch/distributed/elastic")[0]  # before torchrun's own report of the failure
    assert len(lines) == 2 and "Traceback" not in ranks_said and "exitcode: 2" in text, text[-3000:]
    assert (out / "checkpoint.pt").read_bytes() == saved  # nothing trained, nothing overwritten
    together = resume("none")  # control: every rank sees the same disk
    assert together.returncode == 0, together.stderr[-3000:]
    assert json.loads((out / "metrics.json").read_text())["steps"] == 8


def test_the_rendezvous_answers_where_to_meet_and_leaves_the_environment_alone(monkeypatch):
    """A launcher's MASTER_ADDR and MASTER_PORT are used as given; without them a lone process holds a port of its
    own for each process group and tells its caller, editing no one's environment (a notebook kernel's second run
    once found the first run's port there and had to guess whether a launcher had set it). Two trainings in one
    process on that path: test_frameworks' DCP resume; Lightning's adopted group: 08 and test_lightning_launch."""
    from tutorial.core.distributed import rendezvous
    from tutorial.core.lightning_glue import WorldEnvironment
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    before = dict(os.environ)
    (addr, first), (_, second) = rendezvous(World()), rendezvous(World())
    assert addr == "127.0.0.1" and first != second and dict(os.environ) == before
    lightning = WorldEnvironment(World())
    meeting = (lightning.main_address, lightning.main_port)  # Lightning reads them one after the other: one choice
    assert meeting == (lightning.main_address, lightning.main_port) and meeting[0] == addr
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    assert rendezvous(World(0, 0, 4, 2)) == ("10.0.0.1", 29511)
    assert rendezvous(World(1, 1, 2, 2, "torchrun")) == ("10.0.0.1", 29511)

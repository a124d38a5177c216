"""10_when_things_go_wrong, section 5: torch's debug server on two engines, a real hang provoked, its stacks and
flight-recorder events fetched over HTTP as the notebook does, and the lesson's diagnosis of them; then nothing may
be left listening.

Two hangs, so that the diagnosis has to tell them apart (each is the other's negative control): section 1's bug
(rank 0 calls an all_reduce rank 1 skips, and rank 1 waits in the next collective, a barrier), and a rank that is
late rather than wrong (rank 1 sleeps outside any collective while rank 0 waits in the all_reduce)."""
from __future__ import annotations

import time
import urllib.request

import psutil
import pytest

from tutorial.core.process import free_port
from tutorial.lessons import failures as lesson

GROUP_TIMEOUT_S = 10  # how long the provoked hang lasts: the process group's timeout ends it on both ranks (the
# pages are fetched 2 s in, and take well under a second each)

START = f"""
import datetime, torch, torch.distributed as dist, torch.distributed.debug
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds={GROUP_TIMEOUT_S}))
rank = dist.get_rank()
torch.distributed.debug.start_debug_server(port=debug_port, start_method="spawn")
"""

HANGS = {
    "skipped": """
for step in range(3):
    dist.all_reduce(torch.ones(4))
try:
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    dist.barrier()
except RuntimeError:
    pass
""",
    "late": """
import time
for step in range(3):
    dist.all_reduce(torch.ones(4))
try:
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep({timeout} + 2)  # past rank 0's timeout, in no collective
except RuntimeError:
    pass
""".format(timeout=GROUP_TIMEOUT_S),
}

STOP = """
from tutorial.lessons.failures import stop_debug_server
stop_debug_server()
dist.destroy_process_group()
"""


def line_of(code: str, call: str) -> int:
    """The line of `call` in `code` as the engine numbers it (IPython drops the leading blank line)."""
    return next(i for i, line in enumerate(code.lstrip("\n").splitlines(), 1) if call in line)


def fetch(port: int, page: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{page}", timeout=30) as answer:
        return answer.read().decode()


@pytest.mark.parametrize("hang", sorted(HANGS))
def test_the_debug_server_names_the_rank_and_collective_of_a_real_hang_and_stops(cluster, hang):
    debug_port = free_port()
    cluster.new_master_port()
    cluster.view.push({"debug_port": debug_port}, block=True)
    cluster.view.execute(START, block=True).get(timeout=60)
    running = None
    try:
        lesson.wait_for_front_end(debug_port)  # before the hang: its start (seconds) must not eat the group's timeout
        running = cluster.view.execute(HANGS[hang], block=False)
        time.sleep(2)  # both ranks are where they hang well within this (the collectives before take milliseconds)
        stacks, events = fetch(debug_port, "stacks"), fetch(debug_port, "fr_trace_json")
        servers = [debug_port, *lesson.worker_ports(stacks)]
        children = [" ".join(p.cmdline()) for p in psutil.Process(cluster.engines[0].pid).children(recursive=True)]
        assert [c for c in children if "multiprocessing.spawn" in c], children  # what must be gone after the stop
        assert len(servers) == 3 and set(lesson.listening(servers)) == set(servers)
    finally:
        if running is not None:
            running.get(timeout=GROUP_TIMEOUT_S + 60)  # the group's timeout ends the hang
        cluster.view.execute(STOP, block=True).get(timeout=60)
    assert lesson.listening(servers) == {}, "a debug server still listens after stop_debug_server"
    # The front end ran in a spawned process (multiprocessing.spawn); spawning also started multiprocessing's
    # resource tracker, which holds no port and ends with the engine.
    children = [" ".join(p.cmdline()) for p in psutil.Process(cluster.engines[0].pid).children(recursive=True)]
    assert not [c for c in children if "multiprocessing.spawn" in c], f"the front end still runs: {children}"

    assert [c["seq"] for c in lesson.last_collectives(lesson.by_rank(events)[0])] == [1, 2, 3, 4]
    lines = lesson.diagnose(stacks, events)
    at = line_of(HANGS[hang], "dist.all_reduce(torch.ones(1))")
    assert lines[0] == f"rank 0: waits in all_reduce #4 (line {at} of the cell); collectives #1-#3 completed", lines
    if hang == "skipped":
        at = line_of(HANGS[hang], "dist.barrier()")
        assert lines[1] == f"rank 1: waits in barrier #4 (line {at} of the cell); collectives #1-#3 completed", lines
        assert lines[2].startswith("so: collective #4 differs between the ranks (all_reduce on rank 0, barrier on "
                                   "rank 1)"), lines
    else:
        assert lines[1] == "rank 1: in no collective; collectives #1-#3 completed", lines
        assert lines[2].startswith("so: rank(s) [1] never reached the collective the others wait in"), lines


def test_the_pages_are_taken_apart_per_rank_and_a_rank_that_did_not_answer_is_named():
    page = ("<h2>Rank 0: http://node:4000/handler/dump_traceback?</h2>\n<pre>stack 0</pre>\n"
            "<h2>Rank 1: http://node:4001/handler/dump_traceback?</h2>\n<p>Failed to fetch: status=408</p>\n"
            "<pre>Timeout</pre>")
    assert lesson.by_rank(page) == {0: "stack 0", 1: "failed: status 408"}
    assert lesson.worker_ports(page) == [4000, 4001]

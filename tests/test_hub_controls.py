"""The negative controls of tests/test_hub.py's isolation and fault checks (issue 53): the same workshop, on a
hub whose config (tools/hub/jupyterhub_config.py, loaded and then changed by one setting) breaks what the check
guards, must fail at that check. Each runs a whole hub (about 2-3 minutes on 2 cores), so they are not part of
`make test`; run them after changing the hub or the checks:

    HUB_CONTROLS=1 .venv/bin/python -m pytest -p no:cacheprovider tests/test_hub_controls.py -v -s

- open-labs: the hub's `user` role also grants access:servers (and reading users), as a hub that opens every lab
  to every logged-in user would: A's browser then gets into B's lab, and the cross-attendee check fails.
- failed-poll-is-gone: the spawner reads a failed squeue as batchspawner 1.3.0 does (its own query_job_status: an
  error message it does not know is a finished job): the lab is dropped while squeue fails, and the fault check fails.
- restart-ends-labs: JupyterHub's default cleanup_servers=True: stopping the hub for its restart stops every lab
  (cancels its job), and the restart check fails.
- poll-never-gone: a spawner whose poll asks squeue and always says the job runs: the hub never notices the job Slurm killed, and the
  killed-job check fails.

And of `make hub-rehearsal` (tools/hub/load.py), on two attendees and two nodes of one GPU (about 2-3 minutes each):
- requeued-lab: the lab's batch script without --no-requeue (Slurm's default, JobRequeue=1): when node2 is lost, its
  lab's job goes back to the queue, the hub reads it as alive, and the node-loss check fails naming the pending job.
- lab-cannot-start: the course's venv where the compute nodes cannot see it: every lab's job fails at once, each
  attendee's spawn page says so with the job log's last lines (not after start_timeout), the rehearsal counts every
  lab lost, and nothing is left.
"""
from __future__ import annotations

import os

import pytest
import test_hub
from hub import load, rehearsal

CONTROLS = {
    "open-labs": ('c.JupyterHub.load_roles = [*c.JupyterHub.load_roles, {"name": "user", "scopes": '
                  '["self", "access:servers", "read:users", "list:users", "read:servers"]}]',
                  "hubtest1 in hubtest2's lab"),
    "failed-poll-is-gone": ("from batchspawner import SlurmSpawner\n\n"
                            "class FailedPollIsGone(c.JupyterHub.spawner_class):\n"
                            "    query_job_status = SlurmSpawner.query_job_status  # batchspawner's reading\n\n"
                            "c.JupyterHub.spawner_class = FailedPollIsGone",
                            "hubtest1's lab is gone for the hub after squeue failed"),
    "restart-ends-labs": ("c.JupyterHub.cleanup_servers = True  # JupyterHub's default",
                          "hubtest1's lab is gone for the hub after the hub restarted"),
    "poll-never-gone": ("class PollNeverGone(c.JupyterHub.spawner_class):\n"
                        "    async def poll(self):\n"
                        "        await self.query_job_status()  # squeue asked, as every poll does\n"
                        "        return None  # and the job never reported gone\n\n"
                        "c.JupyterHub.spawner_class = PollNeverGone",
                        "the hub notices that hubtest2's job \\d+ was killed"),
}

pytestmark = [pytest.mark.usefixtures("nothing_left_behind"),
              pytest.mark.skipif(not os.environ.get("HUB_CONTROLS"), reason="a hub per control: HUB_CONTROLS=1"),
              pytest.mark.skipif(bool(test_hub.WHY_NOT), reason=test_hub.WHY_NOT or "ready")]


def broken_config(tmp_path, change: str):
    """The course's hub config, loaded, then changed by one control's setting."""
    config = tmp_path / "jupyterhub_config.py"
    config.write_text(f"c = get_config()  # noqa: F821\nload_subconfig({str(rehearsal.CONFIG)!r})  # noqa: F821\n"
                      f"{change}\n")
    return config


@pytest.mark.timeout(test_hub.BUDGET_S + 120)
@pytest.mark.parametrize("control", CONTROLS)
def test_the_hub_test_fails_on_a_broken_hub(control, tmp_path):
    change, failure = CONTROLS[control]
    with pytest.raises(AssertionError, match=failure) as failed:
        test_hub.workshop(tmp_path, config=broken_config(tmp_path, change))
    print(f"{control}: the hub test failed as it must: {str(failed.value)[:600]}")


def requeued(record: dict) -> None:
    lost = record["node_lost"]
    assert lost["failed"].startswith("the hub did not notice within"), lost
    assert "PENDING" in lost["failed"], lost  # the requeued job, which the hub reads as a lab still there
    assert record["labs_lost"] == 1 == len(lost["labs"]), record


def cannot_start(record: dict) -> None:
    assert record["labs_lost"] == record["attendees"] == 2, record
    for lab in record["labs"]:
        assert lab["seconds"] is None and "/nonexistent/venv/bin/batchspawner-singleuser" in lab["failed"] \
            and "Its log, ~/.workbook-lab-" in lab["failed"], lab
        assert lab["messages"][-1][0] < 120, lab  # said at once, not after start_timeout (600 s)
    assert record["node_lost"] == {"skipped": "not every lab started"}, record["node_lost"]


REHEARSAL_CONTROLS = {
    "requeued-lab": ("c.SlurmJobSpawner.batch_script = c.SlurmJobSpawner.batch_script.replace("
                     "'#SBATCH --no-requeue\\n', '')  # Slurm's default: requeued when the node fails", requeued),
    "lab-cannot-start": ('c.SlurmJobSpawner.batchspawner_singleuser_cmd = "/nonexistent/venv/bin/'
                         'batchspawner-singleuser"  # a venv the compute nodes cannot see', cannot_start),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("control", REHEARSAL_CONTROLS)
def test_the_rehearsal_fails_on_a_broken_hub(control, tmp_path):
    change, check = REHEARSAL_CONTROLS[control]
    (tmp_path / "rehearsal").mkdir()
    record = load.rehearse(2, 2, 1, 1, tmp_path / "rehearsal", config=broken_config(tmp_path, change))
    print(load.report(record))
    check(record)
    assert not any(record["left"].values()), record["left"]  # a broken hub too leaves nothing behind

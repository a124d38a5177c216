"""How the workshop's hub reads squeue (tools/hub/jupyterhub_config.py's SlurmJobSpawner.query_job_status), without a
hub or Slurm: the spawner of the course's config, with squeue's possible answers played by shell commands.

A squeue that fails is no answer (UNKNOWN: poll() says the lab still runs, the job id is kept), whatever its message;
only Slurm's own "Invalid job id specified", no line, or a state past running mean the job ended. The control is
batchspawner 1.3.0's own query_job_status on the same spawner: it reads a failure whose message it does not know as a
finished job, and its poll() then forgets the job. tests/test_hub.py makes squeue fail under a running hub.
"""
from __future__ import annotations

import asyncio
import os
import pwd
import re
import runpy
import types

import pytest

from conftest import ROOT

batchspawner = pytest.importorskip("batchspawner")
pytest.importorskip("jupyterhub")
from batchspawner import JobStatus, SlurmSpawner  # noqa: E402

BUSY = "slurm_load_jobs error: Zero Bytes were transmitted or received"  # what an overloaded slurmctld answers
ANSWERS = [  # what squeue does; what the course's spawner reads; what batchspawner 1.3.0 reads
    ("echo 'RUNNING None node2'", JobStatus.RUNNING, JobStatus.RUNNING),
    ("echo 'PENDING Resources n/a'", JobStatus.PENDING, JobStatus.PENDING),
    ("echo 'COMPLETED None node2'", JobStatus.NOTFOUND, JobStatus.NOTFOUND),
    ("true", JobStatus.NOTFOUND, JobStatus.NOTFOUND),  # no line: the job left the queue
    ("echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1", JobStatus.NOTFOUND, JobStatus.NOTFOUND),
    ("echo 'slurm_load_jobs error: Unable to contact slurm controller (connect failure)' >&2; exit 1",
     JobStatus.UNKNOWN, JobStatus.UNKNOWN),
    (f"echo '{BUSY}' >&2; exit 1", JobStatus.UNKNOWN, JobStatus.NOTFOUND),
    ("echo 'runuser: cannot set groups: Resource temporarily unavailable' >&2; exit 1",
     JobStatus.UNKNOWN, JobStatus.NOTFOUND),
    ("exit 1", JobStatus.UNKNOWN, JobStatus.NOTFOUND),  # killed or failed without a word
]


@pytest.fixture
def spawner(tmp_path, monkeypatch):
    """The course's SlurmJobSpawner with the course's config (site.toml, the hub's state in tmp_path), for job 7."""
    site = re.sub(r"^state_dir = [^#\n]*", f'state_dir = "{tmp_path / "state"}"  ',
                  (ROOT / "tools" / "hub" / "site.toml").read_text(), flags=re.M)
    (tmp_path / "site.toml").write_text(site)
    monkeypatch.setenv("HUB_SITE", str(tmp_path / "site.toml"))
    from jupyterhub.objects import Hub
    from traitlets.config import Config
    config = runpy.run_path(str(ROOT / "tools" / "hub" / "jupyterhub_config.py"), init_globals={"get_config": Config})
    name = pwd.getpwuid(os.getuid()).pw_name  # an account that exists: the batch variables name its home
    user = types.SimpleNamespace(name=name, escaped_name=name, url=f"/user/{name}/")
    made = config["SlurmJobSpawner"](user=user, hub=Hub(), config=config["c"])
    assert made.batch_query_cmd.startswith("squeue ")  # the course's command; the tests replace it
    made.exec_prefix, made.job_id = "", "7"
    return made


@pytest.mark.parametrize("squeue, course, stock", ANSWERS, ids=[a[0][:40] for a in ANSWERS])
def test_a_failed_squeue_is_no_answer(spawner, squeue, course, stock):
    spawner.batch_query_cmd = squeue
    assert asyncio.run(spawner.query_job_status()) == course
    assert asyncio.run(SlurmSpawner.query_job_status(spawner)) == stock  # the control: batchspawner's reading


def test_a_lab_outlives_squeue_failing_for_a_while(spawner):
    """Polls while squeue answers RUNNING, fails three times, answers again: the lab is never read as ended. The same
    polls with batchspawner's reading end the lab at the first failure and forget its job (which runs on)."""
    answers = ["echo 'RUNNING None node2'", *[f"echo '{BUSY}' >&2; exit 1"] * 3, "echo 'RUNNING None node2'"]

    async def polls() -> list:
        seen = []
        for answer in answers:
            spawner.batch_query_cmd = answer
            seen.append((await spawner.poll(), spawner.job_id))
        return seen
    assert asyncio.run(polls()) == [(None, "7")] * len(answers)
    assert spawner.job_status == "RUNNING None node2"
    spawner.query_job_status = types.MethodType(SlurmSpawner.query_job_status, spawner)  # the control
    assert asyncio.run(polls())[1] == (1, "")  # batchspawner: ended, job id gone


@pytest.mark.parametrize("squeue, said", [
    ("echo 'NODE_FAIL NodeDown node3'", "Slurm job 7 ended: NODE_FAIL on node3"),
    ("echo 'TIMEOUT TimeLimit node2'", "Slurm job 7 ended: TIMEOUT on node2"),
    ("true", "Slurm job 7 has left the queue"),
    ("echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1", "Slurm job 7 has left the queue"),
    ("echo 'RUNNING None node2'", ""),
    (f"echo '{BUSY}' >&2; exit 1", ""),
], ids=lambda value: value[:30])
def test_the_page_says_how_the_job_ended_even_after_the_hub_drops_the_spawner(spawner, squeue, said):
    """How a lab's job ended (templates/not_running.html shows it) is read from squeue's last answer and kept in the
    spawner's state: JupyterHub drops a stopped lab's spawner and makes the page's from the database."""
    spawner.batch_query_cmd = squeue
    asyncio.run(spawner.poll())
    assert spawner.ended == said
    again = type(spawner)(user=spawner.user, hub=spawner.hub, config=spawner.config)
    again.load_state(spawner.get_state())
    assert again.ended == said


def test_a_job_that_ends_before_jupyterlab_answers_fails_the_start_at_once(spawner, tmp_path, monkeypatch):
    """The job starts (squeue: RUNNING), then ends before the lab reports its port (JupyterLab failed in it): the
    course's start fails at the next poll, saying how the job ended and what its log ends with. Control:
    batchspawner 1.3.0's start, on the same answers, is still waiting for the port seconds later (it would wait
    until start_timeout)."""
    polls = tmp_path / "polls"
    spawner.batch_submit_cmd = "cat > /dev/null; echo 7"
    spawner.batch_query_cmd = (f"n=$(cat {polls} 2>/dev/null || echo 0); echo $((n + 1)) > {polls}; "
                               f"if [ $n = 0 ]; then echo 'RUNNING None node2'; else echo 'FAILED NonZeroExitCode node2'; fi")
    spawner.startup_poll_interval = 0.1
    home = tmp_path / "home"
    home.mkdir()
    (home / ".workbook-lab-7.log").write_text("workbook-lab: job 7 on node2\n/x/bin/batchspawner-singleuser: "
                                              "No such file or directory\n")
    monkeypatch.setitem(spawner.job_log.__func__.__globals__, "pwd",
                        types.SimpleNamespace(getpwnam=lambda name: types.SimpleNamespace(pw_dir=str(home))))
    with pytest.raises(RuntimeError) as failed:
        asyncio.run(asyncio.wait_for(spawner.start(), 10))
    assert str(failed.value) == ("Slurm job 7 ended: FAILED on node2 before JupyterLab answered. Its log, "
                                 "~/.workbook-lab-7.log, ends: workbook-lab: job 7 on node2 | "
                                 "/x/bin/batchspawner-singleuser: No such file or directory")
    polls.unlink()
    with pytest.raises(asyncio.TimeoutError):  # the control: batchspawner's start waits on
        asyncio.run(asyncio.wait_for(SlurmSpawner.start(spawner), 3))

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

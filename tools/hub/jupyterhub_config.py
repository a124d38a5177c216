"""The workshop's JupyterHub: each attendee logs in with their own account (PAM) and gets their JupyterLab as a Slurm
job on a compute node (batchspawner's SlurmSpawner, the template in batch_script.sh), with the course's shared,
read-only environment and kernel and the GPUs Slurm gives the job. What differs per site is in site.toml.

    jupyterhub -f tools/hub/jupyterhub_config.py           # as root, on the login node (or `make hub` to rehearse)

What the day needs, and where it is:
- the job's state while a lab waits in the queue (SlurmJobSpawner.progress: job id, state and Slurm's reason);
- a lab nobody uses is stopped after site.toml's idle_seconds and its job ends (jupyterhub-idle-culler, a service of
  this hub), and File > Log Out stops it at once;
- `end-my-session` (tools/hub/bin) ends one's own lab from a notebook cell or a terminal;
- two attendees on one node get disjoint GPUs (Slurm's gres) and ports (each server picks a free one);
- a squeue that fails for a while (a busy or restarting slurmctld) does not end a lab
  (SlurmJobSpawner.query_job_status);
- the hub restarted while labs run finds them again (cleanup_servers=False below), and a lab whose job Slurm ended
  (scancel, wall time, its node lost: the batch script's --no-requeue) is noticed within poll_interval: the
  attendee's page says how the job ended (templates/not_running.html) and offers to start it again;
- no attendee reaches another's lab (JupyterHub's default roles: a user may access their own server only; no role
  here grants access:servers to users), and the hub's database and cookie secret are readable by root only.
"""
import asyncio
import os
import pwd
import shlex
import socket
import sys
import tomllib
from pathlib import Path

import batchspawner  # noqa: F401 - registers the API handler through which a lab tells the hub its port
from batchspawner import JobStatus, SlurmSpawner, format_template
from traitlets import Unicode

HERE = Path(__file__).resolve().parent
SITE_FILE = Path(os.environ.get("HUB_SITE") or HERE / "site.toml")
site = tomllib.loads(SITE_FILE.read_text())
slurm, course, hub = site["slurm"], site["course"], site["hub"]
checkout = Path(course["checkout"] or HERE.parents[1])
venv = Path(course["venv"] or checkout / ".venv")
state_dir = Path(hub["state_dir"])
state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
state_dir.chmod(0o700)  # it holds the database (every lab's token hash and state) and the cookie secret: root's only
db_file = state_dir / "jupyterhub.sqlite"
db_file.touch(mode=0o600)  # sqlite would make it with the hub's umask (0644); its journals take the file's mode
db_file.chmod(0o600)
idle = int(hub["idle_seconds"])
# How often a lab reports activity to the hub and the hub reads the proxy's: often enough that a lab in use is never
# taken for idle (the defaults, 5 min, would be longer than a short idle time), rarely enough for 50 labs.
report_every = max(2, min(300, idle // 6))


class SlurmJobSpawner(SlurmSpawner):
    """batchspawner's SlurmSpawner, with the course's paths in the batch script and a progress line that names the
    job, its state and Slurm's reason ("PENDING (Reservation)"), where batchspawner says "Pending in queue...". """

    req_course = Unicode(str(checkout))
    req_venv = Unicode(str(venv))
    req_data_dir = Unicode(course["data_dir"] or str(checkout / "data"))
    req_workbook = Unicode(course["workbook"])
    ended = ""      # how the lab's last job ended, as squeue last said: templates/not_running.html shows it
    submitted = ""  # the last job's id, kept after batchspawner clears job_id: its log's name

    # `ended` is kept in the hub's database with the job id: JupyterHub drops a stopped lab's spawner and makes a new
    # one (from this state) for the "Server not running" page, and a restarted hub reads it back.
    def get_state(self):
        return dict(super().get_state(), **({"ended": self.ended} if self.ended else {}))

    def load_state(self, state):
        super().load_state(state)
        self.ended = state.get("ended", "")

    async def submit_batch_script(self):
        self.submitted = await super().submit_batch_script()
        return self.submitted

    async def start(self):
        """batchspawner's start, watched. batchspawner 1.3.0 stops asking Slurm once the job runs and then waits for
        the lab's port until start_timeout, even when JupyterLab failed in the job and the job has ended; here a
        running job is asked every startup_poll_interval, and a job gone fails the start at once. A failed start's
        message (the page shows it) ends with the job log's last lines."""
        self.ended = self.submitted = ""
        starting = asyncio.ensure_future(super().start())
        try:
            while True:
                done, _ = await asyncio.wait([starting], timeout=self.startup_poll_interval)
                if done:
                    return starting.result()
                if self.job_id and self.state_isrunning() and await self.query_job_status() == JobStatus.NOTFOUND:
                    raise RuntimeError(f"{self.ended or f'Slurm job {self.job_id} ended'} before JupyterLab answered.")
        except Exception as exc:
            raise RuntimeError(f"{exc}{await self.job_log()}") from exc
        finally:
            starting.cancel()  # a no-op once it is done; JupyterHub's start_timeout cancels this coroutine

    async def job_log(self) -> str:
        """The last lines of the last job's log (batch_script.sh's --output), for a failed start's message, read
        as the attendee (exec_prefix), never as the hub: the file is theirs, and as root a link in its place would
        show the hub's secrets on their page; its last 4 kB within 5 s, so a pipe or an endless file cannot stall
        the hub."""
        if not self.submitted:
            return ""
        try:
            log = Path(pwd.getpwnam(self.user.name).pw_dir) / f".workbook-lab-{self.submitted}.log"
            prefix = format_template(self.exec_prefix, **self.get_req_subvars())
            text = await self.run_command(f"{prefix} timeout 5 tail -c 4096 -- {shlex.quote(str(log))}")
        except Exception:  # noqa: BLE001 - no log (or no account): the message goes without it
            return ""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return f" Its log, ~/{log.name}, ends: {' | '.join(lines[-3:])}" if lines else ""

    async def query_job_status(self):
        """batchspawner's query, except for a squeue that fails. batchspawner 1.3.0 takes squeue's error message as
        the job's state: unless it matches state_unknown_re (two slurm_load_jobs messages), the job reads as gone,
        poll() clears the job id and the hub drops the lab while its job runs on, out of the hub's sight. Here a
        failed squeue is no answer (UNKNOWN: the lab stays and the next poll asks again), except Slurm's own answer
        for a job it no longer knows, "Invalid job id specified". A job that ends during an outage is noticed at the
        first poll that succeeds."""
        if not self.job_id:
            self.job_status = ""
            return JobStatus.NOTFOUND
        subvars = dict(self.get_req_subvars(), job_id=self.job_id)
        cmd = " ".join(format_template(part, **subvars) for part in (self.exec_prefix, self.batch_query_cmd))
        try:
            answer = await self.run_command(cmd)
        except Exception as exc:  # run_command raises RuntimeError(stderr) when squeue exits non-zero
            if "Invalid job id specified" in str(exc):
                self.job_status, self.ended = "", f"Slurm job {self.job_id} has left the queue"
                return JobStatus.NOTFOUND
            self.log.warning("Slurm job %s of %s: squeue failed (%s); its state is unknown, the lab is kept",
                             self.job_id, self.user.name, str(exc).strip()[-300:] or type(exc).__name__)
            return JobStatus.UNKNOWN  # job_status keeps squeue's last answer (the progress line, the node)
        self.job_status = answer
        if self.state_isrunning():
            return JobStatus.RUNNING
        if self.state_ispending():
            return JobStatus.PENDING
        # no line (the job left the queue) or a state past running: COMPLETED, CANCELLED, TIMEOUT, NODE_FAIL...
        words = answer.split()
        self.ended = (f"Slurm job {self.job_id} ended: {words[0]}" + (f" on {words[2]}" if len(words) == 3 else "")
                      if words else f"Slurm job {self.job_id} has left the queue")
        return JobStatus.NOTFOUND

    async def progress(self):
        while True:
            words = (self.job_status or "").split()  # batch_query_cmd's "STATE REASON HOST"
            if self.job_id and len(words) == 3 and self.state_isrunning():
                yield {"message": f"Slurm job {self.job_id} is running on {words[2]}: starting JupyterLab"}
                return
            if self.job_id and len(words) == 3:
                yield {"message": f"Slurm job {self.job_id} is {words[0]} ({words[1]}): waiting for a node"}
            else:
                yield {"message": "submitting the Slurm job"}
            await asyncio.sleep(1)


c = get_config()  # noqa: F821 - JupyterHub provides it

# -- the hub and its proxy
c.JupyterHub.bind_url = hub["bind_url"]
c.JupyterHub.hub_ip = "0.0.0.0"  # the labs on the compute nodes call back
c.JupyterHub.hub_connect_ip = hub["hub_connect_host"] or socket.gethostname()
c.JupyterHub.db_url = f"sqlite:///{state_dir / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(state_dir / "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.command = [str(HERE / "node_modules" / ".bin" / "configurable-http-proxy")]
c.ConfigurableHTTPProxy.pid_file = str(state_dir / "proxy.pid")
c.JupyterHub.template_paths = [str(HERE / "templates")]  # the "Server not running" page says how the job ended
c.JupyterHub.last_activity_interval = report_every
c.JupyterHub.shutdown_on_logout = True  # File > Log Out ends the attendee's job too
# A hub restarted during the day (an upgrade, a changed setting, a crash) finds its labs again: stopping the hub leaves
# every lab's job running; the new hub reads each lab's job id from its database, asks Slurm (poll), and its new proxy
# gets the labs' routes from the database. Labs end with their job (wall time, idle culler, Log Out); at the
# workshop's end, cancel them (the admin page, or scancel --name=workbook-lab: `make hub`'s Ctrl-C does).
c.JupyterHub.cleanup_servers = False

# -- who may log in: the site's own accounts, checked by PAM
c.JupyterHub.authenticator_class = "pam"
if hub["allowed_users"]:
    c.Authenticator.allowed_users = set(hub["allowed_users"])
else:
    c.Authenticator.allow_all = True
c.Authenticator.admin_users = set(hub["admin_users"])

# -- each lab: a Slurm job submitted as the attendee
c.JupyterHub.spawner_class = SlurmJobSpawner
c.SlurmJobSpawner.exec_prefix = slurm["submit_as"]
c.SlurmJobSpawner.batch_script = (HERE / "batch_script.sh").read_text()
# --states=all: a job that ended (NODE_FAIL, TIMEOUT, CANCELLED) is listed too, as long as Slurm keeps it (MinJobAge,
# 300 s by default), so the page can say how the lab ended; without it squeue prints nothing for such a job.
c.SlurmJobSpawner.batch_query_cmd = "squeue -h -j {job_id} --states=all -o '%T %r %B'"
c.SlurmJobSpawner.startup_poll_interval = 2.0  # squeue per waiting attendee: every 2 s, not batchspawner's 0.5 s
c.SlurmJobSpawner.req_srun = ""  # the lab is the batch step itself; its engines are its children
c.SlurmJobSpawner.req_partition = slurm["partition"]
c.SlurmJobSpawner.req_account = slurm["account"]
c.SlurmJobSpawner.req_reservation = slurm["reservation"]
c.SlurmJobSpawner.req_qos = slurm["qos"]
c.SlurmJobSpawner.req_runtime = slurm["time_limit"]
c.SlurmJobSpawner.req_nprocs = str(slurm["cpus"])
c.SlurmJobSpawner.req_gres = f"gpu:{slurm['gpus']}" if slurm["gpus"] else ""
c.SlurmJobSpawner.req_memory = slurm["memory"]
c.SlurmJobSpawner.req_options = " ".join(slurm["extra"])
c.SlurmJobSpawner.start_timeout = int(hub["start_timeout"])
c.SlurmJobSpawner.http_timeout = 120  # from the job's start to JupyterLab answering (imports on a shared file system)
# A job that ended (scancel, wall time, a node lost) is noticed this soon: JupyterHub's default, 30 s, or sooner with
# a short idle time; one squeue per lab per poll.
c.Spawner.poll_interval = min(30, report_every)
c.Spawner.cmd = [str(venv / "bin" / "jupyterhub-singleuser")]
c.SlurmJobSpawner.batchspawner_singleuser_cmd = str(venv / "bin" / "batchspawner-singleuser")
c.Spawner.notebook_dir = f"~/{course['workbook']}"
c.Spawner.default_url = "/lab/tree/00_setup.ipynb"
c.Spawner.args = ["--MappingKernelManager.default_kernel_name=tutorial"]
c.Spawner.environment = {"JUPYTERHUB_ACTIVITY_INTERVAL": str(report_every)}
# The lab's token may also stop its own server: end-my-session asks the hub, which cancels the job.
c.Spawner.server_token_scopes = ["users:activity!user", "access:servers!server", "servers!server"]

# -- idle labs end: the culler stops a lab nobody used for idle_seconds (the hub then cancels its job)
c.JupyterHub.services = [{"name": "idle-culler", "command": [
    sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={idle}", f"--cull-every={max(2, idle // 4)}"]}]
c.JupyterHub.load_roles = [{"name": "idle-culler", "services": ["idle-culler"],
                            "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"]}]

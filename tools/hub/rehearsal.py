"""`make hub`: the workshop's hub rehearsed on one machine, as root, with virtual nodes and a real Slurm.

tests/test_hub.py uses the same pieces.

    make hub                                  # or: PYTHONPATH=tools .venv/bin/python -m hub.rehearsal --help
    make hub HUB_ATTENDEES=alice,bob          # also make these two accounts (random passwords), removed at the end

The virtual cluster (tools/vcluster: node1..nodeN, a real Slurm, GPUs that Slurm hands out as it would real ones)
stands in for the site: node1 is the login node, where the hub and its proxy run as on a site's login node, and
each attendee's lab is a Slurm job on a node. The nodes' network is private to them, so a forwarder makes the
proxy reachable at http://127.0.0.1:PORT here (from a laptop: ssh -L PORT:127.0.0.1:PORT this-machine). Ctrl-C cancels
every lab's job, stops the hub and the nodes, and removes the attendees it made.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import re
import secrets
import signal
import socket
import stat
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOGIN = "node1"            # the virtual login node: hub, proxy, slurmctld
CONFIG = HERE / "jupyterhub_config.py"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # bad input: one line and exit code 2, as every command of the workbook
        print(f"error: {message} (see make hub's --help)", file=sys.stderr)
        raise SystemExit(2)


class HubError(RuntimeError):
    """The hub did not come up (the message ends with its log's last lines), or an attendee account exists."""


# ------------------------------------------------------------------------------------------------ attendees
@contextlib.contextmanager
def attendees(names: list[str]):
    """Local accounts with random passwords, as a site's attendees have (PAM checks them); yields {name: password}.
    Afterwards their processes are stopped and the accounts removed with their homes. An existing account is never
    touched: it is an error."""
    from tutorial.launch.child_processes import stop
    made: dict[str, str] = {}
    try:
        for name in names:
            with contextlib.suppress(KeyError):
                pwd.getpwnam(name)
                raise HubError(f"user {name!r} exists already; the rehearsal makes (and removes) its own attendees")
            subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True, timeout=30,
                           capture_output=True)
            # Private, as a site's homes are (Debian's useradd makes them 0755): no attendee lists another's files.
            Path(pwd.getpwnam(name).pw_dir).chmod(0o700)
            made[name] = secrets.token_urlsafe(9)
            subprocess.run(["chpasswd"], input=f"{name}:{made[name]}\n", text=True, check=True, timeout=30,
                           capture_output=True)
        yield dict(made)
    finally:
        for name in made:
            uid = pwd.getpwnam(name).pw_uid
            stop(processes_of(uid))
            subprocess.run(["userdel", "--remove", name], timeout=30, capture_output=True)


def processes_of(uid: int) -> list[int]:
    import psutil
    return [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid]


@contextlib.contextmanager
def reachable_by_attendees(checkout: Path, venv: Path):
    """The attendees' jobs read the course's checkout and venv, and the Python the venv was made from, as on a
    shared file system. Where one of them is under a private home (a clone in /root, a pyenv Python), the folders on
    the way there are opened for traversal (o+x), and closed again afterwards."""
    opened = []
    try:
        for path in (checkout, venv.resolve(), (venv / "bin" / "python").resolve()):
            for folder in [*reversed(Path(path).resolve().parents), Path(path).resolve()]:
                mode = folder.stat().st_mode
                if not mode & stat.S_IXOTH:
                    folder.chmod(mode | stat.S_IXOTH)
                    opened.append((folder, mode))
        yield
    finally:
        for folder, mode in reversed(opened):
            folder.chmod(stat.S_IMODE(mode))


def site_file(folder: Path, **values: str) -> Path:
    """folder/site.toml: tools/hub/site.toml with `values` (TOML, e.g. gpus="1", account='"trn011"') on the lines
    of those keys, as a site administrator changes them (the rehearsals' and the tests' sites)."""
    text = (HERE / "site.toml").read_text()
    for key, value in values.items():
        text, count = re.subn(rf"^{key} = [^#\n]*", f"{key} = {value}  ", text, flags=re.M)
        if count != 1:
            raise HubError(f"site.toml has no single line for {key}")
    path = Path(folder) / "site.toml"
    path.write_text(text)
    return path


def jobs() -> dict[str, str]:
    """Slurm's queue on the virtual cluster: job id -> 'STATE USER NODE'."""
    from vcluster import nodes
    out = nodes.run(LOGIN, ["squeue", "-h", "-o", "%i %T %u %N"], timeout=30).stdout
    return {line.split()[0]: " ".join(line.split()[1:]) for line in out.splitlines() if line.strip()}


# ----------------------------------------------------------------------------------------------------- the hub
class Hub:
    """tools/hub/jupyterhub_config.py's hub on the login node, reached at self.url on this machine's loopback.
    `env` is the hub's environment (PYTHONPATH in it reaches the labs); every process it starts carries it. `config`
    is another config file for the tests' controls (one that load_subconfig()s this one and changes a setting)."""

    def __init__(self, site_file: Path, state_dir: Path, env: dict, port: int = 0, timeout: float = 90.0,
                 config: Path = CONFIG):
        from vcluster import nodes
        site = tomllib.loads(Path(site_file).read_text())
        venv = Path(site["course"]["venv"] or HERE.parents[1] / ".venv")
        proxy_port = int(site["hub"]["bind_url"].rsplit(":", 1)[1].strip("/"))
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.log_path = state_dir / "hub.log"
        self.log = open(self.log_path, "w")
        subprocess.run([venv / "bin" / "python", HERE.parents[1] / "scripts" / "lab_settings.py", venv], check=True,
                       timeout=60)
        self._command = nodes.command(LOGIN, [venv / "bin" / "jupyterhub", "-f", config])
        self._start = dict(env=dict(env, HUB_SITE=str(site_file)), cwd=state_dir, stdout=self.log,
                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.hub = subprocess.Popen(self._command, **self._start)
        # The forwarder: a socket on this machine's loopback, handed to a process inside the login node.
        listener = socket.create_server(("127.0.0.1", port))
        self.port = listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        with listener:
            fd = listener.fileno()
            self.forwarder = subprocess.Popen(
                nodes.command(LOGIN, [venv / "bin" / "python", HERE / "forward.py", "--fd", fd, "127.0.0.1",
                                      proxy_port]),
                env=env, pass_fds=[fd], stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/hub/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            if self.hub.poll() is not None or time.monotonic() > deadline:
                raise HubError(f"the hub did not answer at {self.url}/hub/health within {timeout:.0f} s"
                               f"{' (it exited)' if self.hub.poll() is not None else ''}; {self.log_path}:\n"
                               + "\n".join(self.log_path.read_text(errors="replace").splitlines()[-15:]))
            time.sleep(0.5)

    def restart(self, timeout: float = 90.0) -> float:
        """The hub restarted as a site restarts it (an upgrade, a changed setting): SIGTERM, as a service manager
        stops it, and the same command again. The labs' jobs run on (the config's cleanup_servers=False); the hub's
        proxy stops with the hub and the new hub starts a new one, with the routes rebuilt from the database (the
        labs' addresses), after asking Slurm about each lab's job (batchspawner's state: the job id). Returns the
        seconds from SIGTERM to the new hub's /hub/health."""
        begun = time.monotonic()
        self.hub.send_signal(signal.SIGTERM)
        self.hub.wait(timeout)
        self.hub = subprocess.Popen(self._command, **self._start)
        self._wait_healthy(timeout)
        return time.monotonic() - begun

    def stop(self, timeout: float = 90.0) -> None:
        """The workshop's end: every lab's job still in Slurm is cancelled (the hub leaves labs running when it stops,
        so that a restart finds them), then SIGTERM, as a service manager stops the hub; it stops its proxy. What is
        left after `timeout` seconds is killed."""
        from vcluster import nodes
        with contextlib.suppress(OSError, subprocess.SubprocessError):  # also when the hub is gone: its labs are not
            nodes.run(LOGIN, ["scancel", "--name=workbook-lab"], timeout=30, check=False)
        for proc, grace in ((self.hub, timeout), (self.forwarder, 10)):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


# -------------------------------------------------------------------------------------------------- make hub
def main(argv: list[str] | None = None) -> int:
    args = _Parser(prog="make hub", description=__doc__.splitlines()[0], allow_abbrev=False)
    args.add_argument("--nodes", type=int, default=2, help="virtual nodes (node1 is also the login node)")
    args.add_argument("--gpus", type=int, default=2, help="GPUs per node, as Slurm hands them out")
    args.add_argument("--port", type=int, default=8000, help="the hub's address here: http://127.0.0.1:PORT")
    args.add_argument("--attendees", default="", help="accounts to make for the rehearsal, e.g. alice,bob")
    ns = args.parse_args(argv)
    from vcluster import cluster, nodes
    try:
        nodes.require_root()
        if not (HERE / "node_modules" / ".bin" / "configurable-http-proxy").exists():
            raise nodes.NodesError("the hub's proxy is not installed: make install (npm ci in tools/hub)")
        site_file = Path(os.environ.get("HUB_SITE") or HERE / "site.toml")
        site = tomllib.loads(site_file.read_text())
        state_dir = Path(site["hub"]["state_dir"])
        venv = Path(site["course"]["venv"] or HERE.parents[1] / ".venv")
        names = [n for n in ns.attendees.split(",") if n]
        with cluster.cluster(ns.nodes, with_slurm=True, lock_timeout=5, gpus=ns.gpus), attendees(names) as made, \
                reachable_by_attendees(HERE.parents[1], venv), \
                Hub(site_file, state_dir, dict(os.environ), ns.port) as hub:
            print(f"hub: {hub.url} (log: {hub.log_path}); labs run as Slurm jobs on {', '.join(nodes.nodes())}")
            for name, password in made.items():
                print(f"hub: attendee {name}, password {password}")
            if not made:
                print("hub: log in with an account of this machine (PAM); HUB_ATTENDEES=alice,bob makes some")
            print("hub: Ctrl-C stops the hub, the labs' jobs and the nodes")
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            with contextlib.suppress(KeyboardInterrupt):
                hub.hub.wait()
    except nodes.NodesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (HubError, nodes.SetupError, subprocess.SubprocessError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A real Slurm on the virtual nodes: munged and slurmctld on node1, one slurmd per node (`slurmd -N nodei`),
configuration in /etc/netns/nodei/slurm/ (mounted over /etc/slurm inside the node), state and logs under
/run/tutorial-cluster/. Root runs every daemon and every job, as it made the nodes.

Debian's slurm-wlm and munge are not part of `make install` (attendees do not need them). `install()` (the command
line's `install`) installs them with apt-get; nothing else here does, so a notebook never installs system packages:
without them `up()` says so in one line with the command to run.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

from .nodes import (NETNS_ETC, STATE, STATE_FILE, NodesError, SetupError, address, last_line, netns_list, netns_pids,
                    nodes, read_state, require_root, run, stop_pids, write_state)

PACKAGES = {"slurm-wlm": "slurmctld", "munge": "munged"}   # Debian package: a program it installs
FIREWALL = {"nftables": "nft"}                             # the tests' blocked port
DAEMONS = ("slurmctld", "slurmscriptd", "slurmd", "slurmstepd", "munged")
ACTIVE_JOB_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}
INSTALL_HINT = "scripts/virtual_cluster.sh install"


def _slurm_dir() -> Path:
    return STATE / "slurm"


def _munge_dir() -> Path:
    return STATE / "munge"


def missing(packages: dict[str, str] = PACKAGES) -> list[str]:
    """The packages whose program is not on this machine."""
    return [package for package, program in packages.items() if shutil.which(program) is None]


def install(packages: dict[str, str] | None = None) -> None:
    """apt-get install the rehearsal's Debian packages whose program is missing (default: Slurm, munge, nftables).
    Only the command line's `install` and the tests call it."""
    packages = {**PACKAGES, **FIREWALL} if packages is None else packages
    absent = missing(packages)
    if not absent:
        return
    require_root()
    if shutil.which("apt-get") is None:
        raise SetupError(f"{' '.join(absent)} not installed, and there is no apt-get here to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    apt = ["apt-get", "install", "-y", "--no-install-recommends", *absent]
    proc = subprocess.run(apt, capture_output=True, text=True, timeout=900, env=env, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update"], capture_output=True, timeout=600, env=env, stdin=subprocess.DEVNULL)
        proc = subprocess.run(apt, capture_output=True, text=True, timeout=900, env=env, stdin=subprocess.DEVNULL)
    if proc.returncode != 0 or missing({p: packages[p] for p in absent}):
        raise SetupError(f"could not install {' '.join(absent)}: {last_line(proc)}")


def slurm_conf(all_nodes: list[str], cpus: int, gpus: int = 0) -> str:
    """A small slurm.conf: root runs the daemons, no cgroups, one partition `debug` with every node, each with
    `gpus` GPUs that Slurm hands out as it hands out real ones (gres.conf)."""
    state = _slurm_dir()
    lines = [
        "# slurm.conf of the tutorial's virtual cluster (scripts/virtual_cluster.sh slurm up)",
        "ClusterName=vcluster",
        f"SlurmctldHost={all_nodes[0]}({address(all_nodes[0])})",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={_munge_dir() / 'munge.socket'}",
        f"StateSaveLocation={state / 'ctld'}",
        f"SlurmctldPidFile={state / 'slurmctld.pid'}",
        f"SlurmctldLogFile={state / 'slurmctld.log'}",
        # %n: each slurmd of this machine gets its own spool, pid file and log (several slurmd on one host)
        f"SlurmdSpoolDir={state / '%n'}",
        f"SlurmdPidFile={state / '%n' / 'slurmd.pid'}",
        f"SlurmdLogFile={state / '%n' / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/builtin",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "MessageTimeout=20",
        "KillWait=5",
        "MinJobAge=300",  # Slurm's default: an ended job's state (NODE_FAIL, TIMEOUT...) stays in squeue 5 min
        "InactiveLimit=0",
        *(["GresTypes=gpu"] if gpus else []),
        # More cores than this machine has (a workshop's node, rehearsed here): slurmd would drain the node for it
        *(["SlurmdParameters=config_overrides"] if cpus > (os.cpu_count() or 1) else []),
    ]
    gres = f" Gres=gpu:{gpus}" if gpus else ""
    lines += [f"NodeName={node} NodeAddr={address(node)} CPUs={cpus}{gres} State=UNKNOWN" for node in all_nodes]
    lines.append(f"PartitionName=debug Nodes={','.join(all_nodes)} Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def cgroup_conf() -> str:
    """slurmd loads a cgroup plugin even with proctrack/linuxproc and task/none. `ip netns exec` mounts a fresh /sys
    inside the node, without /sys/fs/cgroup, so slurmd is pointed at this machine's cgroup tree as PID 1 sees it."""
    fstype = ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[1] == "/sys/fs/cgroup":
            fstype = fields[2]
    version = "v2" if fstype == "cgroup2" else "v1"
    lines = [f"CgroupPlugin=cgroup/{version}", "CgroupMountpoint=/proc/1/root/sys/fs/cgroup"]
    if version == "v2":
        lines.append("IgnoreSystemd=yes")
    return "\n".join(lines) + "\n"


def gres_conf(node: str, gpus: int) -> str:
    """The node's GPUs for Slurm: device files standing in for /dev/nvidia0.. (Slurm counts them and sets each job's
    CUDA_VISIBLE_DEVICES from their numbers, as on a GPU node; nothing opens them)."""
    return f"AutoDetect=off\nName=gpu File={_slurm_dir() / node / 'nvidia'}[0-{gpus - 1}]\n"


def up(quiet: bool = False, timeout: float = 60.0, gpus: int = 0, cpus: int | None = None) -> None:
    """munged and slurmctld on node1, slurmd on every node, each with `gpus` GPUs (gres.conf) and `cpus` cores
    (default: this machine's); returns when every node is idle."""
    require_root()
    all_nodes = nodes()
    if not all_nodes:
        raise NodesError("no virtual cluster is up: virtual_cluster.sh up N first")
    absent = missing()
    if absent:
        raise NodesError(f"{' and '.join(absent)} not installed here; install them with: {INSTALL_HINT} "
                         f"(apt-get install {' '.join(absent)})")
    if not Path("/etc/slurm").is_dir():  # `ip netns exec` mounts the node's slurm/ over it, so it must exist
        raise SetupError("/etc/slurm does not exist: Slurm was not installed from Debian's slurm-wlm package")
    down(quiet=True)
    head, state = all_nodes[0], read_state()
    write_state(dict(state, slurm=True))  # before anything starts, so down stops it
    try:
        munge = _munge_dir()
        munge.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o755)  # users' sbatch reach munged's socket here (a site's /run/munge is 0755 too)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        run(head, ["munged", "--force", f"--key-file={key}", f"--socket={munge / 'munge.socket'}",
                   f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                   f"--seed-file={munge / 'munged.seed'}"])
        _wait(lambda: (munge / "munge.socket").exists(), 10, "munged did not create its socket", munge / "munged.log")
        slurm = _slurm_dir()
        (slurm / "ctld").mkdir(parents=True, exist_ok=True)
        conf = slurm_conf(all_nodes, cpus or os.cpu_count() or 1, gpus)
        for node in all_nodes:
            (slurm / node).mkdir(parents=True, exist_ok=True)
            for i in range(gpus):  # Slurm wants device files: /dev/null's numbers, which no job opens here
                os.mknod(slurm / node / f"nvidia{i}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            etc = NETNS_ETC / node / "slurm"  # mounted over /etc/slurm on the node: plain `sbatch` finds it
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "slurm.conf").write_text(conf)
            (etc / "cgroup.conf").write_text(cgroup_conf())
            if gpus:
                (etc / "gres.conf").write_text(gres_conf(node, gpus))
            # PMIx's per-step directory is named by job and step only: two slurmd sharing /tmp would collide.
            (etc / "mpi.conf").write_text(f"PMIxCliTmpDirBase={slurm / node}\n")
        run(head, ["slurmctld"])
        for node in all_nodes:
            run(node, ["slurmd", "-N", node])

        def idle() -> bool:
            out = run(head, ["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=15).stdout.split()
            return out.count("idle") == len(all_nodes)
        _wait(idle, timeout, "the Slurm nodes did not become idle", slurm / "slurmctld.log")
    except BaseException:
        down(quiet=True)
        raise
    if not quiet:
        print(f"slurm: slurmctld on {head}, slurmd on {', '.join(all_nodes)}, partition debug")


def node_state(node: str) -> str:
    """Slurm's state of one node as sinfo prints it ("idle", "mixed", "down*": * is not responding), from the login
    node; "" when slurmctld did not answer."""
    out = run(nodes()[0], ["sinfo", "-h", "-n", node, "-N", "-o", "%T"], check=False, timeout=15).stdout.split()
    return out[0] if out else ""


def start_node(node: str, timeout: float = 60.0) -> None:
    """slurmd on `node` (again, after vcluster.nodes.power_on); returns when Slurm has the node back (ReturnToService=2:
    a node that was down is used again once its slurmd registers)."""
    run(node, ["slurmd", "-N", node])
    _wait(lambda: node_state(node).rstrip("*~#") in ("idle", "mixed", "allocated"), timeout,
          f"Slurm did not take {node} back", _slurm_dir() / node / "slurmd.log")


def _wait(ready, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            raise SetupError(f"{what} within {timeout:.0f} s" + (f"; {log}: {tail[0]}" if tail else ""))
        time.sleep(0.5)


def job_info(job_id: str, node: str | None = None) -> dict:
    """`scontrol show job -o ID` as a dict (JobState, ExitCode, NodeList, StdOut, ...); {} once Slurm forgot it."""
    proc = run(node or nodes()[0], ["scontrol", "show", "job", "-o", str(job_id)], check=False, timeout=15)
    return dict(word.split("=", 1) for word in proc.stdout.split() if "=" in word) if proc.returncode == 0 else {}


def submit(script, *args, node: str | None = None, env: dict | None = None, output=None, chdir=None) -> str:
    """`sbatch SCRIPT ARGS...` from `node` (default: the first), the job starting in `chdir` (default: here);
    returns the job id."""
    cmd = ["sbatch", "--parsable", *(["--output", str(output)] if output else []),
           *(["--chdir", str(chdir)] if chdir else []), str(script), *map(str, args)]
    return run(node or nodes()[0], cmd, env=env, timeout=30).stdout.strip().split(";")[0]


def wait(job_id: str, timeout: float = 300.0, node: str | None = None) -> dict:
    """Wait for a job to end, at most `timeout` seconds (then it is cancelled); returns its `job_info`. `sbatch
    --wait` polls at ever longer intervals and notices the end up to a minute late; this polls twice a second."""
    deadline, info = time.monotonic() + timeout, {}
    while True:
        info = job_info(job_id, node) or info
        if info.get("JobState") not in ACTIVE_JOB_STATES:
            return info
        if time.monotonic() > deadline:
            run(node or nodes()[0], ["scancel", str(job_id)], check=False, timeout=15)
            raise TimeoutError(f"Slurm job {job_id} did not finish within {timeout:.0f} s; cancelled")
        time.sleep(0.5)


def down(quiet: bool = False) -> None:
    """Cancel every job, stop the Slurm daemons and munged, remove their files. Safe to repeat."""
    state = read_state()
    if not state.get("slurm") and not _slurm_dir().exists() and not _munge_dir().exists():
        return
    all_nodes = [n for n in state.get("nodes", []) if n in netns_list()]
    if all_nodes and state.get("complete") and shutil.which("scancel"):
        with contextlib.suppress(subprocess.SubprocessError, OSError, SetupError, NodesError):
            run(all_nodes[0], ["scancel", "--full", "--user", "root"], check=False, timeout=15)
    pids = []
    for pidfile in [_slurm_dir() / "slurmctld.pid", _munge_dir() / "munged.pid",
                    *(_slurm_dir() / n / "slurmd.pid" for n in state.get("nodes", []))]:
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(pidfile.read_text().split()[0]))
    for node in all_nodes:  # job steps and anything the daemons started, inside our namespaces only
        for pid in netns_pids(node):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip() in DAEMONS:
                    pids.append(pid)
    stop_pids(sorted(set(pids)))
    for node in state.get("nodes", []):
        shutil.rmtree(NETNS_ETC / node / "slurm", ignore_errors=True)
    shutil.rmtree(_slurm_dir(), ignore_errors=True)
    shutil.rmtree(_munge_dir(), ignore_errors=True)
    if state and STATE_FILE.exists():
        write_state(dict(state, slurm=False))
    if not quiet:
        print("slurm: stopped")

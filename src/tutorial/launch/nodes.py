"""Virtual nodes: a real multi-node cluster on one Linux machine, for rehearsals and tests (06_multi_node).

    scripts/virtual_cluster.sh up 2            # node1, node2: 10.77.0.1 and 10.77.0.2 on one switch
    scripts/virtual_cluster.sh exec node2 CMD  # run CMD "on" node2
    scripts/virtual_cluster.sh slurm up        # munge, slurmctld on node1, slurmd on every node
    scripts/virtual_cluster.sh down            # remove everything (idempotent, also after a crash)

Each node is a network namespace with its own interface `eth0`, address and host name (a UTS namespace), so what
makes multi-node launches fail can happen for real: an address the other node cannot reach, a process that advertises
the wrong interface (seed 003), a blocked port. The nodes share this machine's file system, so the project's virtual
environment, the code and the data are at the same path everywhere, as on a cluster with a shared file system.

Layout, all of it inside namespaces this module creates (nothing is added to this machine's own network):
- the switch: a namespace `vcluster-switch` holding a Linux bridge; one veth pair per node joins node and bridge;
- node i: namespace `nodei`, `eth0` with 10.77.0.i/24, loopback up, no route anywhere else; host name `nodei`
  from a persistent UTS namespace under /run/tutorial-cluster/uts/;
- names: /etc/netns/nodei/hosts, which `ip netns exec` mounts over /etc/hosts inside the node, lists every node;
  /etc/netns/nodei/resolv.conf names no DNS server, so no lookup leaves the node;
- Slurm (optional): munged, slurmctld on node1, one slurmd per node (`slurmd -N nodei`), configuration in
  /etc/netns/nodei/slurm/ (mounted over /etc/slurm inside the node), state and logs under /run/tutorial-cluster/.

Needs root. The state file /run/tutorial-cluster/cluster.json is written before anything is created, so `down` finds
everything a crashed `up` left.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..core.config import ConfigError

STATE = Path("/run/tutorial-cluster")
STATE_FILE = STATE / "cluster.json"
LOCK_FILE = Path("/run/tutorial-cluster.lock")
LOCK_HELD = "TUTORIAL_CLUSTER_LOCK_HELD"   # set while this process holds the lock, inherited by its children
NETNS_ETC = Path("/etc/netns")
SWITCH = "vcluster-switch"
BRIDGE = "br0"
IFNAME = "eth0"                 # every node's interface on the cluster network: GLOO_SOCKET_IFNAME=eth0
NETWORK = "10.77.0"             # private, and used only inside the namespaces made here
MAX_NODES = 250
LOOPBACK_SELF = "127.0.1.1"     # what Debian's installer maps a machine's own name to in /etc/hosts
SLURM_PACKAGES = {"slurm-wlm": "slurmctld", "munge": "munged"}
SLURM_DAEMONS = ("slurmctld", "slurmscriptd", "slurmd", "slurmstepd", "munged")
COMMAND_TIMEOUT = 60.0


class NodesError(ConfigError):
    """Bad input (a node count, a node name, a missing command) or a missing privilege: one line, exit code 2."""


class SetupError(RuntimeError):
    """Creating the nodes or starting a daemon failed; the message ends with what the failing command said."""


# ------------------------------------------------------------------------------------------------------ names
def address(node: str) -> str:
    """node3 -> 10.77.0.3."""
    return f"{NETWORK}.{_index(node)}"


def _index(node: str) -> int:
    match = re.fullmatch(r"node([1-9][0-9]*)", node)
    if not match:
        raise NodesError(f"{node!r} is not a node name like node1")
    return int(match.group(1))


def node_count(text) -> int:
    """N from the command line: a whole number from 1 to MAX_NODES, anything else is one clear line."""
    try:
        n = int(str(text), 10)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_NODES or str(text).strip() != str(n):
        raise NodesError(f"N={text!r} is not a number of nodes; use a whole number from 1 to {MAX_NODES}")
    return n


def _read_state() -> dict:
    try:
        return json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return {}


def _write_state(state: dict) -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    tmp = STATE_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(STATE_FILE)


def nodes() -> list[str]:
    """The nodes that are up (empty when no virtual cluster is)."""
    return list(_read_state().get("nodes", [])) if _read_state().get("complete") else []


def _known(node: str) -> str:
    up = nodes()
    if node not in up:
        where = f"the nodes are {', '.join(up)}" if up else "no virtual cluster is up (virtual_cluster.sh up N)"
        raise NodesError(f"unknown node {node!r}: {where}")
    return node


def _uts(node: str) -> Path:
    return STATE / "uts" / node


# ------------------------------------------------------------------------------------------------- commands
def command(node: str, cmd: list[str]) -> list[str]:
    """cmd as it runs on `node`: in its network namespace (with its /etc/hosts) and with its host name. The process
    keeps this process's environment and working directory, like a job on a cluster with a shared file system."""
    _known(node)
    return ["ip", "netns", "exec", node, "nsenter", f"--uts={_uts(node)}", "--", *[str(c) for c in cmd]]


def run(node: str, cmd: list[str], timeout: float = COMMAND_TIMEOUT, check: bool = True,
        env: dict | None = None) -> subprocess.CompletedProcess:
    """Run cmd on node and wait for it (at most `timeout` seconds)."""
    proc = subprocess.run(command(node, cmd), capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise SetupError(f"{' '.join(map(str, cmd))} on {node} exited with code {proc.returncode}: "
                         f"{_last_line(proc)}")
    return proc


# ssh options that take a value (OpenSSH's getopt string): their value is not the host.
_SSH_VALUE_OPTIONS = set("BbcDEeFIiJLlmOopQRSWw")


def rsh_command(argv: list[str]) -> list[str]:
    """What `ssh [options] HOST CMD...` would run, on the virtual node HOST instead: Open MPI's rsh agent
    (`mpirun -mca plm_rsh_agent scripts/netns_rsh`) and horovodrun's `ssh` call it like ssh. As ssh does, the words
    of CMD are joined by spaces and run by the shell."""
    words, host = list(argv), None
    while words:  # options may come before and after the host (horovodrun puts -o ConnectTimeout=N after it)
        word = words.pop(0)
        if word == "--":
            break
        if word.startswith("-"):
            if len(word) == 2 and word[1] in _SSH_VALUE_OPTIONS and words:
                words.pop(0)
            continue
        if host is not None:
            words.insert(0, word)
            break
        host = word.split("@")[-1]
    if host is None and words:
        host = words.pop(0).split("@")[-1]
    if host is None:
        raise NodesError("rsh needs a host and a command: rsh [ssh options] HOST CMD...")
    if not words:
        raise NodesError(f"rsh {host}: an interactive login is not supported; give a command")
    node = _node_for_host(host)
    shell = shutil.which("bash") or "/bin/sh"
    return command(node, [shell, "-c", " ".join(words)])


def _node_for_host(host: str) -> str:
    """node2, node2.anything or 10.77.0.2 -> node2."""
    name = host.split(".")[0] if not host.startswith(NETWORK + ".") else f"node{host.rsplit('.', 1)[1]}"
    return _known(name)


# --------------------------------------------------------------------------------------------- plumbing
def _last_line(proc) -> str:
    text = ((proc.stderr or "") + "\n" + (proc.stdout or "")).strip().splitlines()
    return text[-1].strip() if text else "(no output)"


def _do(*cmd, timeout: float = COMMAND_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SetupError(f"{' '.join(map(str, cmd))} did not finish within {timeout:.0f} s") from None
    if check and proc.returncode != 0:
        raise SetupError(f"{' '.join(map(str, cmd))} failed: {_last_line(proc)}")
    return proc


def require_root() -> None:
    """Network namespaces need root, and `ip netns` must work here; otherwise one line saying so."""
    if os.geteuid() != 0:
        raise NodesError("the virtual cluster needs root (network namespaces); run it as root, e.g. with sudo")
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        raise NodesError("the virtual cluster needs `ip` (iproute2) and `nsenter` (util-linux)")
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    if probe.returncode != 0:
        raise NodesError(f"`ip netns` does not work here: {_last_line(probe)}")


def available() -> str:
    """'' when this machine can make virtual nodes, else why not (for skips and for notebook 06)."""
    try:
        require_root()
    except NodesError as exc:
        return str(exc)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns` does not work here: {exc}"
    return ""


def _netns_list() -> set[str]:
    out = _do("ip", "netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _netns_pids(name: str) -> list[int]:
    out = _do("ip", "netns", "pids", name, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def _signal_all(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever is still there after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, OSError):
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _hosts_text(node: str, all_nodes: list[str], self_on_loopback: bool = False) -> str:
    lines = [f"# {node} of the tutorial's virtual cluster (scripts/virtual_cluster.sh)", "127.0.0.1 localhost",
             "::1 localhost ip6-localhost ip6-loopback"]
    for other in all_nodes:
        if other == node and self_on_loopback:
            lines.append(f"{LOOPBACK_SELF} {node}  # as Debian's installer writes it: gloo will advertise this")
        else:
            lines.append(f"{address(other)} {other}")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ up, down
def up(n: int, slurm: bool = False, quiet: bool = False) -> list[str]:
    """Create node1..nodeN (replacing a virtual cluster that is up), and start Slurm on them if asked."""
    n = node_count(n)
    require_root()
    down(quiet=True)
    names = [f"node{i}" for i in range(1, n + 1)]
    foreign = sorted(set(names + [SWITCH]) & _netns_list())
    if foreign:  # not ours (ours are gone after down): never touch them
        raise NodesError(f"network namespace(s) {', '.join(foreign)} exist and were not made by virtual_cluster.sh; "
                         f"remove them first (ip netns del NAME)")
    _write_state(dict(nodes=names, switch=SWITCH, complete=False, slurm=False))  # before anything exists
    try:
        _do("ip", "netns", "add", SWITCH)
        _do("ip", "-n", SWITCH, "link", "set", "lo", "up")
        _do("ip", "-n", SWITCH, "link", "add", BRIDGE, "type", "bridge")
        _do("ip", "-n", SWITCH, "link", "set", BRIDGE, "up")
        (STATE / "uts").mkdir(parents=True, exist_ok=True)
        for i, node in enumerate(names, start=1):
            _do("ip", "netns", "add", node)
            _do("ip", "-n", SWITCH, "link", "add", f"v{node}", "type", "veth", "peer", "name", IFNAME,
                "netns", node)
            _do("ip", "-n", SWITCH, "link", "set", f"v{node}", "master", BRIDGE, "up")
            _do("ip", "netns", "exec", node, "sysctl", "-qw", f"net.ipv6.conf.{IFNAME}.disable_ipv6=1")
            _do("ip", "-n", node, "addr", "add", f"{NETWORK}.{i}/24", "dev", IFNAME)
            _do("ip", "-n", node, "link", "set", IFNAME, "up")
            _do("ip", "-n", node, "link", "set", "lo", "up")
            etc = NETNS_ETC / node
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(_hosts_text(node, names))
            (etc / "resolv.conf").write_text("# no DNS server on the virtual cluster: names come from /etc/hosts\n"
                                             "options timeout:1 attempts:1\n")
            _uts(node).touch()
            _do("unshare", f"--uts={_uts(node)}", "hostname", node)
        _write_state(dict(nodes=names, switch=SWITCH, complete=True, slurm=False))
        if slurm:
            slurm_up(quiet=True)
    except BaseException:
        down(quiet=True)
        raise
    if not quiet:
        print(f"up: {', '.join(f'{m} ({address(m)})' for m in names)} on {SWITCH}"
              f"{'; Slurm: slurmctld on node1, slurmd on every node' if slurm else ''}")
    return names


def down(quiet: bool = False) -> None:
    """Remove every node, the switch, their files and whatever runs inside them. Safe to repeat."""
    require_root()
    state = _read_state()
    names = list(state.get("nodes", []))
    slurm_down(quiet=True)
    existing = _netns_list()
    for node in names:
        if node in existing:
            _signal_all(_netns_pids(node))
            _do("ip", "netns", "del", node, check=False)
        uts = _uts(node)
        if uts.exists():
            _do("umount", uts, check=False)
            with contextlib.suppress(OSError):
                uts.unlink()
        shutil.rmtree(NETNS_ETC / node, ignore_errors=True)
    if state and SWITCH in existing:
        _do("ip", "netns", "del", SWITCH, check=False)
    with contextlib.suppress(OSError):
        NETNS_ETC.rmdir()  # only when empty: other namespaces' files stay
    shutil.rmtree(STATE / "uts", ignore_errors=True)
    with contextlib.suppress(OSError):
        STATE_FILE.unlink()
    with contextlib.suppress(OSError):
        STATE.rmdir()
    left = sorted(set(names + [SWITCH]) & _netns_list()) if state else []
    if left:
        raise SetupError(f"could not remove namespace(s) {', '.join(left)}")
    if not quiet:
        print(f"down: {'removed ' + ', '.join(names) if names else 'nothing was up'}")


def status() -> str:
    """One line per node: address, host name and how many processes run there; Slurm's view when it is up."""
    up_nodes = nodes()
    if not up_nodes:
        return "no virtual cluster is up (virtual_cluster.sh up N)"
    lines = []
    for node in up_nodes:
        name = run(node, ["hostname"], check=False).stdout.strip()
        lines.append(f"{node}: {address(node)} on {IFNAME}, host name {name}, {len(_netns_pids(node))} process(es)")
    if _read_state().get("slurm"):
        sinfo = run(up_nodes[0], ["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=15)
        lines.append("slurm: " + (", ".join(sinfo.stdout.split("\n")).strip(", ") or _last_line(sinfo)))
    return "\n".join(lines)


def self_on_loopback(on: bool = True) -> None:
    """Seed 003's pitfall for real: every node's /etc/hosts maps its own name to 127.0.1.1 (on=True), or back to its
    cluster address. gloo finds its address by resolving the host name, so with on=True every rank advertises an
    address nobody else can reach unless GLOO_SOCKET_IFNAME names the interface."""
    require_root()
    all_nodes = nodes()
    if not all_nodes:
        raise NodesError("no virtual cluster is up (virtual_cluster.sh up N)")
    for node in all_nodes:
        (NETNS_ETC / node / "hosts").write_text(_hosts_text(node, all_nodes, self_on_loopback=on))


@contextlib.contextmanager
def lock(timeout: float = 900.0):
    """Hold the machine's virtual-cluster lock (bounded wait): two test runs or notebooks on one machine would
    otherwise use, and remove, each other's nodes. The node names are fixed, so there is one cluster per machine."""
    if os.environ.get(LOCK_HELD) == str(LOCK_FILE):  # a parent process holds it for us (the tests' CLI calls)
        yield
        return
    LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK_FILE, "w") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SetupError(f"the virtual cluster is in use by a test or a notebook (lock {LOCK_FILE}, "
                                     f"waited {timeout:.0f} s)") from None
                time.sleep(1.0)
        os.environ[LOCK_HELD] = str(LOCK_FILE)
        try:
            yield
        finally:
            os.environ.pop(LOCK_HELD, None)
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def cluster(n: int = 2, slurm: bool = False, lock_timeout: float = 900.0):
    """`with nodes.cluster(2) as names:` a fresh virtual cluster, removed afterwards, even after an error."""
    require_root()
    with lock(lock_timeout):
        try:
            yield up(n, slurm=slurm, quiet=True)
        finally:
            down(quiet=True)


# ---------------------------------------------------------------------------------------------------- Slurm
def _slurm_dir() -> Path:
    return STATE / "slurm"


def _munge_dir() -> Path:
    return STATE / "munge"


def install(packages: dict[str, str]) -> None:
    """Debian packages only the rehearsal needs ({package: a program it installs}), installed with apt-get when that
    program is missing: Slurm, munge, nftables. Never part of `make install`: attendees do not need them."""
    missing = [package for package, program in packages.items() if shutil.which(program) is None]
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise SetupError(f"{' '.join(missing)} not installed, and there is no apt-get here to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    apt = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    proc = subprocess.run(apt, capture_output=True, text=True, timeout=900, env=env, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update"], capture_output=True, timeout=600, env=env, stdin=subprocess.DEVNULL)
        proc = subprocess.run(apt, capture_output=True, text=True, timeout=900, env=env, stdin=subprocess.DEVNULL)
    if proc.returncode != 0 or any(shutil.which(packages[p]) is None for p in missing):
        raise SetupError(f"could not install {' '.join(missing)}: {_last_line(proc)}")


def slurm_conf(all_nodes: list[str], cpus: int) -> str:
    """A small slurm.conf: root runs the daemons, no cgroups, one partition `debug` with every node."""
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
        "MinJobAge=30",
        "InactiveLimit=0",
    ]
    lines += [f"NodeName={node} NodeAddr={address(node)} CPUs={cpus} State=UNKNOWN" for node in all_nodes]
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


def slurm_up(quiet: bool = False, timeout: float = 60.0) -> None:
    """munged and slurmctld on node1, slurmd on every node; returns when every node is idle."""
    require_root()
    all_nodes = nodes()
    if not all_nodes:
        raise NodesError("no virtual cluster is up: virtual_cluster.sh up N first")
    slurm_down(quiet=True)
    install(SLURM_PACKAGES)
    if not Path("/etc/slurm").is_dir():  # `ip netns exec` mounts the node's slurm/ over it, so it must exist
        raise SetupError("/etc/slurm does not exist: Slurm was not installed from Debian's slurm-wlm package")
    head, state = all_nodes[0], _read_state()
    _write_state(dict(state, slurm=True))  # before anything starts, so down stops it
    try:
        munge = _munge_dir()
        munge.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        run(head, ["munged", "--force", f"--key-file={key}", f"--socket={munge / 'munge.socket'}",
                   f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                   f"--seed-file={munge / 'munged.seed'}"])
        _wait(lambda: (munge / "munge.socket").exists(), 10, "munged did not create its socket", munge / "munged.log")
        slurm = _slurm_dir()
        (slurm / "ctld").mkdir(parents=True, exist_ok=True)
        conf = slurm_conf(all_nodes, os.cpu_count() or 1)
        for node in all_nodes:
            (slurm / node).mkdir(parents=True, exist_ok=True)
            etc = NETNS_ETC / node / "slurm"  # mounted over /etc/slurm on the node: plain `sbatch` finds it
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "slurm.conf").write_text(conf)
            (etc / "cgroup.conf").write_text(cgroup_conf())
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
        slurm_down(quiet=True)
        raise
    if not quiet:
        print(f"slurm: slurmctld on {head}, slurmd on {', '.join(all_nodes)}, partition debug")


def _wait(ready, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            raise SetupError(f"{what} within {timeout:.0f} s" + (f"; {log}: {tail[0]}" if tail else ""))
        time.sleep(0.5)


ACTIVE_JOB_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


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


def slurm_down(quiet: bool = False) -> None:
    """Cancel every job, stop the Slurm daemons and munged, remove their files. Safe to repeat."""
    state = _read_state()
    if not state.get("slurm") and not _slurm_dir().exists() and not _munge_dir().exists():
        return
    all_nodes = [n for n in state.get("nodes", []) if n in _netns_list()]
    if all_nodes and state.get("complete") and shutil.which("scancel"):
        with contextlib.suppress(subprocess.SubprocessError, OSError, SetupError, NodesError):
            run(all_nodes[0], ["scancel", "--full", "--user", "root"], check=False, timeout=15)
    pids = []
    for pidfile in [_slurm_dir() / "slurmctld.pid", _munge_dir() / "munged.pid",
                    *(_slurm_dir() / n / "slurmd.pid" for n in state.get("nodes", []))]:
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(pidfile.read_text().split()[0]))
    for node in all_nodes:  # job steps and anything the daemons started, inside our namespaces only
        for pid in _netns_pids(node):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip() in SLURM_DAEMONS:
                    pids.append(pid)
    _signal_all([p for p in set(pids) if _alive(p)])
    for node in state.get("nodes", []):
        shutil.rmtree(NETNS_ETC / node / "slurm", ignore_errors=True)
    shutil.rmtree(_slurm_dir(), ignore_errors=True)
    shutil.rmtree(_munge_dir(), ignore_errors=True)
    if state and STATE_FILE.exists():
        _write_state(dict(state, slurm=False))
    if not quiet:
        print("slurm: stopped")


# ------------------------------------------------------------------------------------------------------ CLI
USAGE = """usage: virtual_cluster.sh up N [--slurm] | exec NODE CMD... | rsh [ssh options] HOST CMD... | status | down
       virtual_cluster.sh slurm up|down | hosts loopback|cluster"""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if not args or args[0] in ("-h", "--help", "help"):
            print(USAGE)
            return 0 if args else 2
        verb, rest = args[0], args[1:]
        if verb == "up":
            flags = [a for a in rest if a.startswith("--")]
            counts = [a for a in rest if not a.startswith("--")]
            if len(counts) != 1 or set(flags) - {"--slurm"}:
                raise NodesError(f"up takes N and optionally --slurm, got {' '.join(rest) or 'nothing'}")
            n = node_count(counts[0])
            require_root()
            with lock(timeout=5):  # not while a test or a notebook uses the nodes
                up(n, slurm="--slurm" in flags)
        elif verb == "down" and not rest:
            require_root()
            with lock(timeout=5):
                down()
        elif verb == "status" and not rest:
            require_root()
            print(status())
        elif verb == "exec":
            if len(rest) < 2:
                raise NodesError("exec needs a node and a command: exec NODE CMD...")
            require_root()
            cmd = command(rest[0], rest[1:])
            os.execvp(cmd[0], cmd)
        elif verb == "rsh":
            require_root()
            cmd = rsh_command(rest)
            os.execvp(cmd[0], cmd)
        elif verb == "slurm" and rest in (["up"], ["down"]):
            slurm_up() if rest == ["up"] else (require_root(), slurm_down())
        elif verb == "hosts" and rest in (["loopback"], ["cluster"]):
            self_on_loopback(rest == ["loopback"])
            print(f"hosts: every node's own name maps to "
                  f"{LOOPBACK_SELF if rest == ['loopback'] else 'its cluster address'}")
        else:
            raise NodesError(f"unknown command {' '.join(args)!r}\n{USAGE}".splitlines()[0])
    except NodesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (SetupError, subprocess.SubprocessError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

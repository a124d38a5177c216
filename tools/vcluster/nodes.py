"""The nodes: network namespaces joined by a bridge, each with its own eth0, address and host name.

Each node is a network namespace with its own interface `eth0`, address and host name (a UTS namespace), so what
makes multi-node launches fail can happen for real: an address the other node cannot reach, a process that advertises
the wrong interface, a blocked port. The nodes share this machine's file system, so the project's virtual
environment, the code and the data are at the same path everywhere, as on a cluster with a shared file system.

Layout, all of it inside namespaces made here (nothing is added to this machine's own network):
- the switch: a namespace `vcluster-switch` holding a Linux bridge; one veth pair per node joins node and bridge;
- node i: namespace `nodei`, `eth0` with 10.77.0.i/24, loopback up, no route anywhere else; host name `nodei`
  from a persistent UTS namespace under /run/tutorial-cluster/uts/;
- names: /etc/netns/nodei/hosts, which `ip netns exec` mounts over /etc/hosts inside the node, lists every node;
  /etc/netns/nodei/resolv.conf names no DNS server, so no lookup leaves the node.

Every process on the nodes runs as root, the user who made them, so the checkout may sit in a directory nobody
else can enter. The state file /run/tutorial-cluster/cluster.json is written before anything is created, so `down`
finds everything a crashed `up` left.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

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
COMMAND_TIMEOUT = 60.0


class NodesError(ValueError):
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


def read_state() -> dict:
    try:
        return json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return {}


def write_state(state: dict) -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    tmp = STATE_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(STATE_FILE)


def nodes() -> list[str]:
    """The nodes that are up (empty when no virtual cluster is)."""
    state = read_state()
    return list(state.get("nodes", [])) if state.get("complete") else []


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
                         f"{last_line(proc)}")
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
def last_line(proc) -> str:
    text = ((proc.stderr or "") + "\n" + (proc.stdout or "")).strip().splitlines()
    return text[-1].strip() if text else "(no output)"


def do(*cmd, timeout: float = COMMAND_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command on this machine (not in a node); a failure is a SetupError with its last line."""
    try:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SetupError(f"{' '.join(map(str, cmd))} did not finish within {timeout:.0f} s") from None
    if check and proc.returncode != 0:
        raise SetupError(f"{' '.join(map(str, cmd))} failed: {last_line(proc)}")
    return proc


def require_root() -> None:
    """Network namespaces need root, and `ip netns` must work here; otherwise one line saying so."""
    if os.geteuid() != 0:
        raise NodesError("the virtual cluster needs root (network namespaces); run it as root, e.g. with sudo")
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        raise NodesError("the virtual cluster needs `ip` (iproute2) and `nsenter` (util-linux)")
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    if probe.returncode != 0:
        raise NodesError(f"`ip netns` does not work here: {last_line(probe)}")


def available() -> str:
    """'' when this machine can make virtual nodes, else why not (for skips and for notebook 06)."""
    try:
        require_root()
    except NodesError as exc:
        return str(exc)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns` does not work here: {exc}"
    return ""


def netns_list() -> set[str]:
    out = do("ip", "netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def netns_pids(name: str) -> list[int]:
    out = do("ip", "netns", "pids", name, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]


def stop_pids(pids: list[int]) -> None:
    """Terminate, then kill, the processes: the package's one implementation (psutil's wait_procs)."""
    from tutorial.launch.child_processes import stop
    stop(pids)


def _hosts_text(node: str, all_nodes: list[str], self_on_loopback: bool = False) -> str:
    lines = [f"# {node} of the tutorial's virtual cluster (scripts/virtual_cluster.sh)", "127.0.0.1 localhost",
             "::1 localhost ip6-localhost ip6-loopback"]
    for other in all_nodes:
        if other == node and self_on_loopback:
            lines.append(f"{LOOPBACK_SELF} {node}  # as Debian's installer writes it: gloo will advertise this")
        else:
            lines.append(f"{address(other)} {other}")
    return "\n".join(lines) + "\n"


def power_off(node: str) -> list[int]:
    """The node lost, as a power cut loses it: its cable pulled (the switch's end of its veth pair down: nothing it
    sent arrives, nothing sent to it is answered) and every process inside it killed at once (SIGKILL: no process
    gets to say goodbye). Its files stay, as a node's local disk does. Returns the pids killed."""
    import signal
    _known(node)
    do("ip", "-n", SWITCH, "link", "set", f"v{node}", "down")
    killed: list[int] = []
    for _ in range(10):  # until none is left: a process may fork between the listing and the kill
        pids = [pid for pid in netns_pids(node) if pid not in killed]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed += pids
    return killed


def power_on(node: str) -> None:
    """The node back after power_off (rebooted): its cable in again. Nothing runs on it: vcluster.slurm.start_node
    starts its slurmd, as a node's boot does."""
    _known(node)
    do("ip", "-n", SWITCH, "link", "set", f"v{node}", "up")


# ------------------------------------------------------------------------------------------------ up, down
def up(n: int, quiet: bool = False) -> list[str]:
    """Create node1..nodeN (replacing nodes that are up). The nodes only: vcluster.cluster.up also starts Slurm, and
    stops a Slurm that runs on the nodes being replaced."""
    n = node_count(n)
    require_root()
    down(quiet=True)
    names = [f"node{i}" for i in range(1, n + 1)]
    foreign = sorted(set(names + [SWITCH]) & netns_list())
    if foreign:  # not ours (ours are gone after down): never touch them
        raise NodesError(f"network namespace(s) {', '.join(foreign)} exist and were not made by virtual_cluster.sh; "
                         f"remove them first (ip netns del NAME)")
    write_state(dict(nodes=names, switch=SWITCH, complete=False, slurm=False))  # before anything exists
    try:
        do("ip", "netns", "add", SWITCH)
        do("ip", "-n", SWITCH, "link", "set", "lo", "up")
        do("ip", "-n", SWITCH, "link", "add", BRIDGE, "type", "bridge")
        do("ip", "-n", SWITCH, "link", "set", BRIDGE, "up")
        (STATE / "uts").mkdir(parents=True, exist_ok=True)
        for i, node in enumerate(names, start=1):
            do("ip", "netns", "add", node)
            do("ip", "-n", SWITCH, "link", "add", f"v{node}", "type", "veth", "peer", "name", IFNAME, "netns", node)
            do("ip", "-n", SWITCH, "link", "set", f"v{node}", "master", BRIDGE, "up")
            do("ip", "netns", "exec", node, "sysctl", "-qw", f"net.ipv6.conf.{IFNAME}.disable_ipv6=1")
            do("ip", "-n", node, "addr", "add", f"{NETWORK}.{i}/24", "dev", IFNAME)
            do("ip", "-n", node, "link", "set", IFNAME, "up")
            do("ip", "-n", node, "link", "set", "lo", "up")
            etc = NETNS_ETC / node
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(_hosts_text(node, names))
            (etc / "resolv.conf").write_text("# no DNS server on the virtual cluster: names come from /etc/hosts\n"
                                             "options timeout:1 attempts:1\n")
            _uts(node).touch()
            do("unshare", f"--uts={_uts(node)}", "hostname", node)
        write_state(dict(nodes=names, switch=SWITCH, complete=True, slurm=False))
    except BaseException:
        down(quiet=True)
        raise
    if not quiet:
        print(f"up: {', '.join(f'{m} ({address(m)})' for m in names)} on {SWITCH}")
    return names


def down(quiet: bool = False) -> None:
    """Remove every node, the switch, their files and whatever runs inside them. Safe to repeat. The nodes only:
    vcluster.cluster.down stops Slurm first (its daemons' files and munged live outside the namespaces)."""
    require_root()
    state = read_state()
    names = list(state.get("nodes", []))
    existing = netns_list()
    for node in names:
        if node in existing:
            stop_pids(netns_pids(node))
            do("ip", "netns", "del", node, check=False)
        uts = _uts(node)
        if uts.exists():
            do("umount", uts, check=False)
            with contextlib.suppress(OSError):
                uts.unlink()
        shutil.rmtree(NETNS_ETC / node, ignore_errors=True)
    if state and SWITCH in existing:
        do("ip", "netns", "del", SWITCH, check=False)
    with contextlib.suppress(OSError):
        NETNS_ETC.rmdir()  # only when empty: other namespaces' files stay
    shutil.rmtree(STATE / "uts", ignore_errors=True)
    with contextlib.suppress(OSError):
        STATE_FILE.unlink()
    with contextlib.suppress(OSError):
        STATE.rmdir()
    left = sorted(set(names + [SWITCH]) & netns_list()) if state else []
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
        lines.append(f"{node}: {address(node)} on {IFNAME}, host name {name}, {len(netns_pids(node))} process(es)")
    if read_state().get("slurm"):
        sinfo = run(up_nodes[0], ["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=15)
        lines.append("slurm: " + (", ".join(sinfo.stdout.split("\n")).strip(", ") or last_line(sinfo)))
    return "\n".join(lines)


def self_on_loopback(on: bool = True) -> None:
    """A classic pitfall for real: every node's /etc/hosts maps its own name to 127.0.1.1 (on=True), or back to its
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
    from filelock import FileLock, Timeout
    held = FileLock(str(LOCK_FILE))
    try:
        held.acquire(timeout=timeout)
    except Timeout:
        raise SetupError(f"the virtual cluster is in use by a test or a notebook (lock {LOCK_FILE}, "
                         f"waited {timeout:.0f} s)") from None
    os.environ[LOCK_HELD] = str(LOCK_FILE)
    try:
        yield
    finally:
        os.environ.pop(LOCK_HELD, None)
        held.release()


"""06_multi_node: the ranks' reports, interfaces, recipes and their checkers, and rehearsal 5's virtual nodes (the
hand-written ranks and seed 001's killed launcher are typed in the notebook's cells)."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..core.distributed import hold_port
from ..launch.child_processes import Launch, launcher_env


def rank_reports(run: Launch) -> list[dict]:
    """The JSON lines the tutorial.launch.worker processes of a launch printed, in rank order."""
    lines = [line for text in run.outputs for line in text.splitlines() if line.startswith('{"rank"')]
    return sorted((json.loads(line) for line in lines), key=lambda r: r["rank"])


def interfaces() -> dict[str, list[str]]:
    """This machine's network interfaces and IPv4 addresses: the names NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME take."""
    try:
        import psutil
        return {name: [a.address for a in addrs if a.family == socket.AF_INET]
                for name, addrs in psutil.net_if_addrs().items()}
    except ImportError:
        return {name: [] for _, name in socket.if_nameindex()}


CHECKOUT = Path(__file__).resolve().parents[3]  # src/tutorial/lessons/ -> the checkout (an editable install)


def script(relpath: str) -> None:
    """Print one of the repository's launch recipes (scripts/pbs/..., scripts/slurm/...), never a pasted copy."""
    path = CHECKOUT / "scripts" / relpath
    if not path.exists():
        raise FileNotFoundError(f"no launch recipe scripts/{relpath} (this needs the repository checkout)")
    print(path.read_text().rstrip())


def vcluster():
    """The virtual-cluster tool of the checkout (tools/vcluster/, behind scripts/virtual_cluster.sh): its `nodes`
    and `slurm` modules. It is not part of the installed package (it needs root and writes system files), so it is
    imported by its path; None without a checkout."""
    if "vcluster" not in sys.modules:
        init = CHECKOUT / "tools" / "vcluster" / "__init__.py"
        if not init.exists():
            return None
        spec = importlib.util.spec_from_file_location("vcluster", init, submodule_search_locations=[str(init.parent)])
        package = importlib.util.module_from_spec(spec)
        sys.modules["vcluster"] = package
        spec.loader.exec_module(package)
    return importlib.import_module("vcluster.nodes"), importlib.import_module("vcluster.slurm")


class RehearsalNodes:
    """Rehearsal 5's nodes: virtual nodes (scripts/virtual_cluster.sh: network namespaces, each with its own interface,
    address and host name) with Slurm when this machine can make them (root, `ip netns`, and for Slurm its packages),
    otherwise "nodes" on localhost as in the rehearsals before. Installs nothing: without Slurm it says which command
    installs it. `close()` removes the nodes, the daemons and whatever runs on them."""

    def __init__(self, n: int = 2, slurm: bool = True, lock_timeout: float = 300):
        self.names = [f"node{i}" for i in range(1, n + 1)]
        self.slurm, self.slurm_note = False, ""
        self._stack = contextlib.ExitStack()
        tool = vcluster()
        self.why_not = tool[0].available() if tool else "no tools/vcluster (this needs the repository checkout)"
        self._nodes, self._slurm = tool or (None, None)
        if not self.why_not:
            try:
                whole = importlib.import_module("vcluster.cluster")  # nodes and Slurm, taken down together
                self._stack.enter_context(whole.cluster(n, lock_timeout=lock_timeout))
            except (self._nodes.SetupError, OSError, subprocess.SubprocessError) as exc:
                self.why_not = f"could not make virtual nodes: {exc}"
        if self.virtual and slurm:
            try:
                self._slurm.up(quiet=True)
                self.slurm = True
            except (self._nodes.NodesError, self._nodes.SetupError, OSError, subprocess.SubprocessError) as exc:
                self.slurm_note = f"no Slurm: {exc}"

    @property
    def virtual(self) -> bool:
        return not self.why_not

    @property
    def interface(self) -> str:
        """The interface the nodes reach each other on: what GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME should name."""
        return self._nodes.IFNAME if self.virtual else "lo"

    @property
    def hostnames(self) -> list[str]:
        return list(self.names) if self.virtual else [socket.gethostname()] * len(self.names)

    def endpoint(self) -> str:
        """Where node1 listens: a fixed port on the virtual node1 (every node has ports of its own), else a port this
        process holds and serves the rendezvous on (the agents join it as clients; core.distributed.hold_port)."""
        return f"{self.names[0]}:29400" if self.virtual else f"127.0.0.1:{hold_port()}"

    def on(self, node: str, cmd: list[str]) -> list[str]:
        """cmd as it runs on node (`virtual_cluster.sh exec node CMD`); on localhost, cmd itself."""
        return self._nodes.command(node, cmd) if self.virtual else list(cmd)

    def names_on_loopback(self, on: bool = True) -> None:
        """Every node's /etc/hosts maps its own name to 127.0.1.1 (on) or to its address (off); nothing on localhost."""
        if self.virtual:
            self._nodes.self_on_loopback(on)

    def sbatch(self, recipe: str, *args: str, out: str, timeout: float = 300) -> dict | None:
        """Submit scripts/<recipe> from node1 with OUT=out, wait for it (bounded), return Slurm's record of the job
        and its metrics.json; None where Slurm does not run."""
        if not self.slurm:
            return None
        env = dict(launcher_env(), OUT=str(out))
        job = self._slurm.submit(CHECKOUT / "scripts" / recipe, *args, env=env, chdir=CHECKOUT, output=f"{out}.log")
        info = self._slurm.wait(job, timeout=timeout)
        metrics = Path(out) / "metrics.json"
        return dict(info, metrics=json.loads(metrics.read_text()) if metrics.exists() else {})

    @property
    def running(self) -> bool:
        """Whether virtual nodes are up (after close(): none)."""
        return self.virtual and bool(self._nodes.nodes())

    def close(self) -> None:
        self._stack.close()

    def __str__(self) -> str:
        if not self.virtual:
            return f"no virtual nodes ({self.why_not}): the cells below run on localhost"
        where = ", ".join(f"{m} ({self._nodes.address(m)})" for m in self.names)
        slurm = "slurmctld on node1, slurmd on every node" if self.slurm else self.slurm_note
        return f"virtual nodes {where} on {self._nodes.IFNAME}; Slurm: {slurm}"


# ---------------------------------------------------------------------------------------------------- exercises
MASTER = "10.0.0.1"  # node 0's address in exercise 1
_LOCAL = ("localhost", "127.0.0.1", "127.0.1.1", "0.0.0.0", "::1")


def _torchrun_args(command: list) -> list[str] | None:
    """The arguments after `torchrun` or `python -m torch.distributed.run`; None if the command is neither."""
    words = [str(w) for w in command]
    for i, w in enumerate(words):
        if Path(w).name == "torchrun":
            return words[i + 1:]
        if w == "torch.distributed.run" and i and words[i - 1] == "-m":
            return words[i + 1:]
    return None


def check_torchrun_node(torchrun_node) -> str:
    """Exercise 1: torchrun_node() returns the command for the second node (node rank 1) of 2 nodes with 4 GPUs each,
    whose node 0 is 10.0.0.1 (port 29500, static rendezvous, or c10d at 10.0.0.1:29500)."""
    from torch.distributed.run import get_args_parser
    command = torchrun_node()
    args = _torchrun_args(command) if isinstance(command, (list, tuple)) else None
    if args is None:
        return f"wrong: {command!r} is not a torchrun command (a list starting with torchrun or python -m torch.distributed.run)"
    try:
        ns = get_args_parser().parse_args(args)
    except SystemExit:
        return f"wrong: torchrun cannot parse {' '.join(args)!r}"
    problems = []
    if str(ns.nnodes) not in ("2", "2:2"):
        problems.append(f"--nnodes {ns.nnodes}: the job has 2 nodes")
    if str(ns.nproc_per_node) != "4":
        problems.append(f"--nproc_per_node {ns.nproc_per_node}: it counts the processes on *this* node, one per GPU "
                        "(4), not the world size (2 x 4 = 8)")
    c10d = ns.rdzv_backend == "c10d"
    where = ns.rdzv_endpoint if c10d else f"{ns.master_addr}:{ns.master_port}"
    host = where.rsplit(":", 1)[0] if ":" in where else where
    if host in _LOCAL:
        problems.append(f"rank 0 is looked for at {where}: on node 1, {host} is node 1 itself, where nobody "
                        f"listens; name node 0 ({MASTER}), the same address on every node")
    elif host != MASTER:
        problems.append(f"rank 0 is looked for at {host}, not at node 0's address {MASTER}")
    elif where.rsplit(":", 1)[-1] != "29500":
        problems.append(f"the port of {where} is not node 0's 29500")
    if not c10d and ns.node_rank != 1:
        problems.append(f"--node_rank {ns.node_rank}: the second node is node 1 (node 0 is {MASTER}); two nodes "
                        "with the same node rank wait for a node that never comes")
    if not ns.training_script or "tutorial.train_ddp" not in [ns.training_script, *ns.training_script_args]:
        problems.append("the trainer is missing: end with -m tutorial.train_ddp --preset workshop")
    if problems:
        return "wrong: " + "; ".join(problems)
    return (f"correct: 2 nodes x 4 processes = 8 ranks, this one is node 1, rank 0 at {where}"
            + (" (c10d numbers the nodes itself)" if c10d else ""))


def solution_torchrun_node() -> list[str]:
    return ["torchrun", "--nnodes", "2", "--nproc_per_node", "4", "--node_rank", "1",
            "--master_addr", MASTER, "--master_port", "29500",
            "-m", "tutorial.train_ddp", "--preset", "workshop"]


def _logical_lines(script: str) -> list[tuple[int, str]]:
    """(first line number, text) of each shell line, with backslash continuations joined."""
    out, pending, start = [], "", 0
    for n, line in enumerate(script.splitlines(), 1):
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


# Where a per-node name comes from: on every node it names that node, so each torchrun meets only itself.
_PER_NODE = ("hostname", "uname -n", "SLURMD_NODENAME", "HOSTNAME", "SLURM_TOPOLOGY_ADDR")
# What names the job's first node on every node alike.
_FIRST_NODE_VARIABLES = ("SLURM_LAUNCH_NODE_IPADDR",)


def _endpoint_host_problem(host: str, variables: dict, depth: int = 0) -> str | None:
    """Why `host` (as written in the script, variables unexpanded) is not the job's first node on every node;
    None if it is."""
    host = host.strip().strip('"').strip("'")
    if not host:
        return "it is empty"
    command = re.fullmatch(r"\$\((.*)\)|`(.*)`", host)
    if command:
        text = command.group(1) or command.group(2) or ""
        if re.search(r"\bscontrol\s+show\s+hostnames?\b", text):  # the job's node list, the same on every node
            return None
        if any(re.search(rf"(?<![\w-]){re.escape(p)}(?![\w-])", text) for p in _PER_NODE):
            return (f"{host} runs on every node and gives that node's own name, so every node's torchrun waits at a "
                    "rendezvous of its own")
        return f"{host} is not the job's first node"
    variable = re.fullmatch(r"\$\{?(\w+)\}?", host)
    if variable:
        name = variable.group(1)
        if name in _PER_NODE:
            return (f"${name} differs from node to node (each node's own name), so every node's torchrun waits at "
                    "a rendezvous of its own")
        if name in _FIRST_NODE_VARIABLES:
            return None
        if name not in variables:
            return (f"${name} is set nowhere in the script, so the endpoint is empty (Slurm sets no such "
                    "variable)")
        if depth > 5:
            return f"${name} refers to itself"
        why = _endpoint_host_problem(variables[name], variables, depth + 1)
        return f"${name}={variables[name]}: {why}" if why else None
    if host in _LOCAL or host.startswith("127."):
        return f"{host} is each node itself, where only that node's torchrun listens"
    return None  # a fixed host name or address: right if it is the job's first node


@dataclass(frozen=True)
class _Sbatch:
    """A batch script read once: what check_sbatch's rules look at, so each rule is a function of this alone."""
    lines: list  # (first line number, text) of each shell line, continuations joined
    options: dict  # #SBATCH option without its dashes -> (value, line number, the line)
    variables: dict  # shell variable -> what the script assigns it, unexpanded
    srun: tuple | None  # (line number, line) of the first srun line; None if there is none
    unreadable: str  # why the srun line is not valid shell; "" if it is
    torchrun: object  # the argparse.Namespace torchrun's own parser makes of what srun starts; None if none
    unparsed: str  # why torchrun's parser refused those arguments; "" if it did not or srun starts no torchrun
    node_rank: str  # --node_rank as written: "$SLURM_NODEID" is right on every node, and no int for the parser
    tasks: tuple  # --ntasks-per-node (value, line number, line): srun's own, in front of torchrun, wins over #SBATCH


def _read_sbatch(text: str) -> _Sbatch:
    """The script read once; the srun line's torchrun arguments read by torchrun's own parser."""
    import io
    import shlex
    from torch.distributed.run import get_args_parser
    lines = _logical_lines(text)
    options, variables = {}, {}
    for n, line in lines:
        words = line.split()[1:] if line.startswith("#SBATCH") else []
        for i, option in enumerate(words):
            if not option.startswith("-"):
                continue
            key, eq, value = option.partition("=")
            if not eq and i + 1 < len(words) and not words[i + 1].startswith("-"):
                value = words[i + 1]
            options[key.lstrip("-")] = (value, n, line.strip())
        assigned = re.match(r"^\s*(?:export\s+)?(\w+)=(.*)$", line)
        if assigned:
            variables[assigned.group(1)] = assigned.group(2).strip()
    srun = next(((n, line.strip()) for n, line in lines if line.strip().startswith("srun")), None)
    tasks, args, ns = options.get("ntasks-per-node", ("1", None, "")), None, None
    unreadable = unparsed = node_rank = ""
    if srun:
        n, line = srun
        try:
            words = shlex.split(line, comments=True)
        except ValueError as exc:
            unreadable = f"line {n} `{line}` is not valid shell ({exc})"
        else:
            args = _torchrun_args(words)
    if args is not None:
        srun_words = words[:len(words) - len(args)]
        for i, w in enumerate(srun_words):
            if w.startswith("--ntasks-per-node"):
                tasks = (w.partition("=")[2] or (srun_words[i + 1:] or [""])[0], n, line)
        for i, w in enumerate(args):
            if re.fullmatch(r"--node[-_]rank(=.*)?", w):
                j, node_rank = (i, w.partition("=")[2]) if "=" in w else (i + 1, (args[i + 1:] or [""])[0])
                if node_rank.startswith("$"):  # parse a stand-in; node_rank keeps what was written
                    args = [*args[:j], "--node_rank=0" if j == i else "0", *args[j + 1:]]
                break
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                ns = get_args_parser().parse_args(args)
        except SystemExit:
            unparsed = f"line {n}: torchrun cannot parse `{' '.join(args)}`"
    return _Sbatch(lines, options, variables, srun, unreadable, ns, unparsed, node_rank, tasks)


# check_sbatch's rules: each a pure function of the script as read, giving its problem or None (it does not apply).
def _an_srun_line(s: _Sbatch) -> str | None:
    return None if s.srun else "no srun line starts the job's tasks"


def _two_nodes(s: _Sbatch) -> str | None:
    value, n, line = s.options.get("nodes", (None, None, ""))
    return None if value == "2" else f"line {n} `{line}`: the job needs --nodes=2" if n else "no #SBATCH --nodes=2"


def _four_gpus_per_node(s: _Sbatch) -> str | None:
    value, n, line = s.options.get("gpus-per-node", (None, None, ""))
    return None if value == "4" else f"line {n} `{line}`: 4 GPUs per node" if n else "no #SBATCH --gpus-per-node=4"


def _one_torchrun_per_node(s: _Sbatch) -> str | None:
    value, n, line = s.tasks
    if (s.torchrun is None and not s.unparsed) or value == "1":
        return None
    return (f"line {n} `{line}`: srun starts that many torchruns per node, and each starts --nproc_per_node "
            f"processes: {value} x 4 per node, {value} torchruns per node fight over the same GPUs; torchrun needs "
            "--ntasks-per-node=1")


def _one_task_per_gpu(s: _Sbatch) -> str | None:
    (value, n, line), gpus = s.tasks, s.options.get("gpus-per-node", (None,))[0]
    if s.srun is None or s.unreadable or s.torchrun is not None or s.unparsed or value == gpus:
        return None
    return f"line {n} `{line}`: without torchrun, srun starts one task per GPU: --ntasks-per-node={gpus}"


def _torchrun_parses(s: _Sbatch) -> str | None:
    return s.unparsed or None


def _rendezvous_on_first_node(s: _Sbatch) -> str | None:
    ns = s.torchrun
    if ns is None:
        return None
    c10d = ns.rdzv_backend == "c10d"
    endpoint = ns.rdzv_endpoint if c10d else f"{ns.master_addr}:{ns.master_port}"
    host = endpoint.rsplit(":", 1)[0] if ":" in endpoint else endpoint
    why = _endpoint_host_problem(host, s.variables) if c10d or ns.master_addr != "127.0.0.1" else "it is unset"
    if not why:
        return None
    why = "; every node's torchrun would meet itself" if host in _LOCAL else f", but {why}"
    return (f"line {s.srun[0]} `{s.srun[1]}`: rendezvous at {endpoint or 'nowhere'}{why}. Use the first node of the "
            "job: head=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) and \"$head:29500\"")


def _own_node_rank(s: _Sbatch) -> str | None:
    if s.torchrun is None or s.torchrun.rdzv_backend == "c10d" or re.search(r"SLURM_(NODEID|PROCID)", s.node_rank):
        return None
    return (f"line {s.srun[0]}: with the static rendezvous every node needs its own --node_rank: "
            "--node_rank \"$SLURM_NODEID\", or --rdzv_backend c10d, which numbers the nodes itself")


def _one_process_per_gpu(s: _Sbatch) -> str | None:
    nproc = "4" if s.torchrun is None else str(s.torchrun.nproc_per_node)
    if nproc in ("4", "gpu", "auto") or re.fullmatch(r"\$\{?SLURM_GPUS_(PER|ON)_NODE\}?", nproc):
        return None
    return f"line {s.srun[0]}: --nproc_per_node {nproc} should be 4, one per GPU"


def _torchrun_nodes(s: _Sbatch) -> str | None:
    nnodes = "2" if s.torchrun is None else str(s.torchrun.nnodes)
    if nnodes in ("2", "2:2", "$SLURM_NNODES", "${SLURM_NNODES}", "$SLURM_JOB_NUM_NODES"):
        return None
    return f"line {s.srun[0]}: --nnodes {nnodes}: the job has 2 nodes"


def _no_loopback(s: _Sbatch) -> str | None:
    if s.srun is None or s.unparsed:  # no srun line, or one torchrun refuses: the verdict is that line and #SBATCH's
        return None
    return "; ".join(f"line {n} `{line.strip()}`: lo is the loopback interface, which the other node cannot reach; "
                     "name the interface the nodes share (ib0, hsn0, eth0)" for n, line in s.lines
                     if "SOCKET_IFNAME=lo" in line.replace(" ", "").replace('"', "").replace("'", "")) or None


# A verdict names its problems in this order.
_SBATCH_RULES = (_an_srun_line, _two_nodes, _four_gpus_per_node, _one_torchrun_per_node, _one_task_per_gpu,
                 _torchrun_parses, _rendezvous_on_first_node, _own_node_rank, _one_process_per_gpu, _torchrun_nodes,
                 _no_loopback)


def check_sbatch(ddp_sbatch) -> str:
    """Exercise 2: ddp_sbatch() returns a Slurm batch script for 2 nodes x 4 GPUs: one srun task per node, torchrun
    on each with one process per GPU, a c10d rendezvous on the first node. Names every wrong line. The torchrun
    line is read with torchrun's own parser, so every spelling torchrun accepts is accepted here."""
    text = ddp_sbatch()
    if not isinstance(text, str):
        return f"wrong: ddp_sbatch returned {type(text).__name__}, not the script's text"
    script = _read_sbatch(text)
    if script.unreadable:  # shlex cannot split the srun line: that alone is said
        return f"wrong: {script.unreadable}"
    problems = [problem for problem in (rule(script) for rule in _SBATCH_RULES) if problem]
    if problems:
        return "wrong: " + "; ".join(problems)
    return "correct: 2 nodes, one torchrun per node with 4 processes each, meeting on the job's first node"


def solution_ddp_sbatch() -> str:
    return """#!/bin/bash
#SBATCH --job-name=ddp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --time=00:30:00
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun torchrun --nnodes 2 --nproc_per_node 4 --rdzv_backend c10d --rdzv_endpoint "$head:29500" --rdzv_id "$SLURM_JOB_ID" -m tutorial.train_ddp --preset workshop
"""

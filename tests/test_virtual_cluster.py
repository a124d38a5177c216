"""06_multi_node's launches across real (virtual) nodes: network namespaces node1 and node2 on one machine, each with
its own interface, address and host name (scripts/virtual_cluster.sh, tools/vcluster/), and a real Slurm on them.

Needs root and `ip netns` (CI has both); skipped otherwise. Every test ends with nothing of its own running inside the
nodes, and the module ends with no namespace, daemon or process left (the fixtures call `down`, also after a failure).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import ROOT

from tutorial.launch import child_processes, commands
from tutorial.lessons import multi_node

nodes, slurm = multi_node.vcluster()  # the tool, imported from this checkout's tools/vcluster/
import vcluster.cluster as whole_cluster  # noqa: E402 - importable once vcluster() registered the package

WHY_NOT = nodes.available()
pytestmark = [pytest.mark.skipif(bool(WHY_NOT), reason=f"no virtual nodes here: {WHY_NOT}"),
              pytest.mark.usefixtures("nothing_left_behind")]  # conftest's: every test stops what it started

SCRIPT = ROOT / "scripts" / "virtual_cluster.sh"
RSH = ROOT / "scripts" / "netns_rsh"
SSH_DIR = ROOT / "scripts" / "virtual_cluster_bin"  # `ssh` for horovodrun, which calls ssh by name
PAIR = ("node1", "node2")
FAST = ["--preset", "smoke", "--epochs", "1", "--max-steps", "5"]  # the launch is the subject, not the model


def cli(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def ours_inside() -> dict:
    """Processes running inside the nodes, Slurm's daemons aside: what a test must not leave behind."""
    found = {}
    for node in nodes.nodes():
        for pid in nodes.netns_pids(node):
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if name not in slurm.DAEMONS:
                found[pid] = f"{node}: {name}"
    return found


# ------------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def machine():
    """This module's hold on the machine's one virtual cluster; removes it at the end, whatever happened."""
    with nodes.lock():
        try:
            yield
        finally:
            whole_cluster.down(quiet=True)
            assert not set(PAIR) & nodes.netns_list(), "namespaces left behind"


@pytest.fixture
def pair(machine):
    """node1 and node2 (made again when a test removed them), names resolving to the cluster network."""
    if nodes.nodes() != list(PAIR):
        whole_cluster.up(2, quiet=True)
    nodes.self_on_loopback(False)
    yield PAIR
    nodes.self_on_loopback(False)
    deadline = time.monotonic() + 10
    while ours_inside() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = ours_inside()
    child_processes.stop(list(left))
    assert not left, f"left running inside the nodes: {left}"


@pytest.fixture
def slurm_pair(pair):
    """Slurm on the pair: slurmctld on node1, slurmd on both (the tests install it with apt-get the first time, as
    `virtual_cluster.sh install` does; the notebook never installs anything)."""
    try:
        slurm.install(slurm.PACKAGES)
    except slurm.SetupError as exc:
        pytest.skip(f"no Slurm: {exc}")
    if not nodes.read_state().get("slurm"):
        slurm.up(quiet=True)
    return pair


def on_pair(cmd_for_rank, env=None, timeout=240, check=True) -> child_processes.Launch:
    """One command per node, started together (06's rehearsal, on real nodes): cmd_for_rank(rank) -> argv."""
    return child_processes.launch([nodes.command(node, cmd_for_rank(rank)) for rank, node in enumerate(PAIR)],
                            env=child_processes.launcher_env(**(env or {})), timeout=timeout, check=check)


def torchrun_c10d(program: list[str], port: int = 29400) -> list[str]:
    """The same command on every node: torchrun numbers the nodes at a c10d rendezvous on node1 (ddp.sbatch's way)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"node1:{port}", "--rdzv_id", "rehearsal", *program]


WORKER = ["-m", "tutorial.launch.worker"]


# --------------------------------------------------------------------------------------------- the script itself
def test_bad_input_is_one_line_and_exit_code_2(machine):
    for args, expected in [(["up", "0"], "N='0' is not a number of nodes"), (["up", "two"], "N='two' is not"),
                           (["up"], "the following arguments are required: N"),
                           (["exec", "node7", "true"], "unknown node 'node7'"),
                           (["exec", "node7"], "exec needs a node and a command"),
                           (["slurm", "sideways"], "invalid choice: 'sideways'"),
                           (["rsh"], "rsh needs a host and a command"),
                           (["frobnicate"], "invalid choice: 'frobnicate'")]:
        proc = cli(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], (args, proc.stderr)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed")
def test_without_root_it_says_so_in_one_line(machine):
    """As `nobody`. The checkout may sit in a directory only root can enter (a clone under a private home), so the
    tool is copied where `nobody` can read it and run by the system's Python: up to its root check it needs only
    the standard library."""
    with tempfile.TemporaryDirectory() as public:
        shutil.copytree(ROOT / "tools" / "vcluster", Path(public, "vcluster"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        for folder, _, files in os.walk(public):
            os.chmod(folder, 0o755)
            for name in files:
                os.chmod(Path(folder, name), 0o644)
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               os.path.realpath(sys.executable), "-m", "vcluster", "up", "2"],
                              capture_output=True, text=True, timeout=60, cwd="/", env=dict(PYTHONPATH=public))
    assert proc.returncode == 2 and proc.stderr.strip() == \
        "error: the virtual cluster needs root (network namespaces); run it as root, e.g. with sudo", proc.stderr


def test_without_slurm_it_says_how_to_install_it_and_installs_nothing(pair, monkeypatch):
    """The notebook's path (RehearsalNodes -> slurm.up) never runs apt-get: a missing Slurm is one line naming the
    command that installs it."""
    monkeypatch.setattr(slurm, "missing", lambda packages=slurm.PACKAGES: list(packages))
    monkeypatch.setattr(slurm, "install", lambda *a, **k: pytest.fail("slurm.up ran the installer"))
    with pytest.raises(nodes.NodesError) as exc:
        slurm.up(quiet=True)
    assert str(exc.value) == ("slurm-wlm and munge not installed here; install them with: "
                              "scripts/virtual_cluster.sh install (apt-get install slurm-wlm munge)")


def test_up_exec_down_and_down_again_after_a_crash(machine):
    assert cli("up", "2").returncode == 0
    names = cli("exec", "node2", "sh", "-c", "hostname; getent hosts node1; ip -4 -o addr show eth0").stdout
    assert names.split()[:3] == ["node2", "10.77.0.1", "node1"] and "10.77.0.2/24" in names
    # a "crash": a process left running on a node and no orderly end; down still removes everything
    orphan = subprocess.Popen(nodes.command("node1", ["sleep", "300"]), start_new_session=True)
    time.sleep(0.5)
    down = cli("down")
    assert down.returncode == 0 and down.stdout.strip() == "down: removed node1, node2", down.stderr
    assert orphan.wait(timeout=10) != 0
    assert not {"node1", "node2", nodes.SWITCH} & nodes.netns_list() and not nodes.STATE.exists()
    assert not any((nodes.NETNS_ETC / n).exists() for n in PAIR)
    assert cli("down").stdout.strip() == "down: nothing was up"


# ------------------------------------------------------------------------------------------------ the recipes
def test_torchrun_c10d_across_two_nodes(pair):
    run = on_pair(lambda rank: torchrun_c10d(WORKER))
    seen = multi_node.rank_reports(run)
    assert [(r["rank"], r["world_size"], r["all_reduce_sum"]) for r in seen] == [(0, 2, 3), (1, 2, 3)]
    assert sorted(r["host"] for r in seen) == ["node1", "node2"] and all(r["weights_match_rank_0"] for r in seen)


def test_mpirun_with_an_rsh_agent_trains_across_two_nodes(pair, tmp_path):
    # Open MPI starts the remote ranks with `<agent> node2 orted ...`; the agent enters node2 where ssh would log in
    agent = ["-mca", "plm_rsh_agent", str(RSH)]
    where = child_processes.launch(
        [nodes.command("node1", ["mpirun", *agent, "-np", "2", "-H", "node1,node2", "hostname"])], timeout=60)
    assert sorted(where.outputs[0].split()) == ["node1", "node2"]
    mpirun = commands.mpirun_command(tmp_path, np=2, hosts="node1,node2")
    mpirun[1:1] = agent
    run = child_processes.launch([nodes.command("node1", mpirun + FAST[2:])], out=tmp_path, timeout=240)
    assert run.metrics["world_size"] == 2 and run.metrics["replicas_identical"]


def test_horovodrun_across_two_nodes(pair, tmp_path):
    if not (Path(sys.executable).parent / "horovodrun").exists():
        pytest.skip("Horovod is not built yet (make install builds it)")
    horovodrun = commands.horovodrun_command(tmp_path, np=2, hosts="node1:1,node2:1", controller="--gloo")
    # horovodrun reaches node2 with `ssh node2 ...`; the ssh on the PATH enters the namespace. --network-interface
    # names the cluster network, as seed 003 learned to (and spares horovodrun probing every interface over ssh).
    horovodrun[1:1] = ["--network-interface", nodes.IFNAME]
    env = child_processes.launcher_env(PATH=f"{SSH_DIR}{os.pathsep}{os.environ['PATH']}")
    run = child_processes.launch([nodes.command("node1", horovodrun + FAST[2:])], out=tmp_path, env=env, timeout=240)
    assert run.metrics["world_size"] == 2 and run.metrics["replicas_identical"]


@pytest.mark.parametrize("init", ["tcp", "file"])
def test_hand_written_ranks_across_two_nodes(pair, init, tmp_path):
    # file://: a path both nodes see (this machine's file system is shared by the nodes, like NFS on a cluster)
    method = "tcp://node1:29500" if init == "tcp" else (tmp_path / "rendezvous").as_uri()
    run = on_pair(lambda rank: commands.manual_commands(method, world_size=2)[rank], timeout=180)
    seen = multi_node.rank_reports(run)
    assert [(r["rank"], r["host"], r["all_reduce_sum"], r["init_method"]) for r in seen] == \
        [(0, "node1", 3, init), (1, "node2", 3, init)]


# ------------------------------------------------------------------------------------------------ the failures
def test_the_wrong_interface_fails_and_gloo_socket_ifname_fixes_it(pair, monkeypatch):
    """Seed 003 for real: each node's /etc/hosts maps its own name to 127.0.1.1 (Debian's installer does this).
    gloo resolves the host name to choose the address it advertises, so the other node is told 127.0.1.1 and
    connects to itself. Naming the interface the nodes share fixes it, without touching /etc/hosts."""
    monkeypatch.setattr(child_processes, "FAILED_NODE_GRACE_S", 3.0)  # the node still waiting would wait 60 s
    nodes.self_on_loopback(True)
    method = "tcp://node1:29501"
    broken = on_pair(lambda rank: commands.manual_commands(method)[rank], check=False, timeout=180)
    assert not broken.ok
    assert any("Connection refused" in text and "127.0.1.1" in text for text in broken.outputs), broken.outputs
    fixed = on_pair(lambda rank: commands.manual_commands("tcp://node1:29502")[rank], timeout=180,
                    env=dict(GLOO_SOCKET_IFNAME=nodes.IFNAME))
    assert [r["all_reduce_sum"] for r in multi_node.rank_reports(fixed)] == [3, 3]


@pytest.mark.parametrize("cause", ["wrong address", "blocked port"])
def test_an_unreachable_master_port_is_a_bounded_clear_error(pair, cause):
    """node2 cannot reach rank 0's rendezvous: told a wrong address, or a firewall on node1 drops the port. Both ranks
    give up after --timeout seconds with one line saying who is missing and what to check."""
    if cause == "blocked port":
        try:
            slurm.install(slurm.FIREWALL)
        except slurm.SetupError as exc:
            pytest.skip(f"no nftables: {exc}")
        for rule in ("add table inet rehearsal",
                     "add chain inet rehearsal input { type filter hook input priority 0; }",
                     f"add rule inet rehearsal input iifname {nodes.IFNAME} tcp dport 29503 drop"):
            nodes.run("node1", ["nft", rule])  # node1's own firewall; this machine's stays untouched
    addr = {"wrong address": "10.77.0.99", "blocked port": "node1"}[cause]
    train = [sys.executable, "-m", "tutorial.train_ddp", *FAST, "--timeout", "8"]
    start = time.monotonic()
    run = on_pair(lambda rank: ["env", f"RANK={rank}", "WORLD_SIZE=2", f"MASTER_ADDR={'node1' if rank == 0 else addr}",
                                "MASTER_PORT=29503", *train], check=False, timeout=120)
    last = [text.strip().splitlines()[-1] for text in run.outputs]
    assert run.returncodes == [1, 1] and time.monotonic() - start < 100
    assert last[0] == "error: rendezvous at node1:29503: 1 of 2 ranks arrived within 8 s; missing rank(s): 1"
    assert last[1] == (f"error: rank 1 could not reach rank 0's rendezvous at {addr}:29503 within 8 s: is rank 0 "
                       f"running, and is {addr} reachable from this node?")


# ----------------------------------------------------------------------------------------------------- Slurm
def test_sbatch_recipes_run_across_both_nodes(slurm_pair, tmp_path):
    """scripts/slurm/ddp_cpu.sbatch (torchrun per node, c10d) and horovod_cpu.sbatch (srun --mpi=pmix), submitted
    from node1 together: each job spans node1 and node2 and trains with world size 2 and identical replicas."""
    jobs = {}
    for recipe in ("ddp_cpu.sbatch", "horovod_cpu.sbatch"):
        if recipe.startswith("horovod") and not (Path(sys.executable).parent / "horovodrun").exists():
            continue  # Horovod is not built yet
        out = tmp_path / recipe.split("_")[0]
        env = dict(child_processes.launcher_env(), OUT=str(out))  # sbatch exports the environment to the job
        jobs[recipe] = out, slurm.submit(ROOT / "scripts" / "slurm" / recipe, *FAST[2:], env=env, output=f"{out}.log")
    for recipe, (out, job_id) in jobs.items():
        info = slurm.wait(job_id, timeout=300)
        log = Path(f"{out}.log").read_text(errors="replace") if Path(f"{out}.log").exists() else ""
        assert info.get("JobState") == "COMPLETED" and info.get("NodeList") == "node[1-2]", (recipe, info, log[-2000:])
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["world_size"] == 2 and metrics["replicas_identical"], recipe


ENGINES = """
import json
from tutorial import train_ddp
from tutorial.core.config import TrainConfig
from tutorial.launch import engines
with engines.start(n=2, engines="slurm", interface="eth0", timeout=120, show=False,  # device="auto": no GPUs there
                   launcher=dict(batch_template_file="scripts/slurm/engines_cpu.sh", queue="debug",
                                 namespace=dict(timelimit="00:10:00", ppn=1))) as cluster:
    metrics = cluster.run(train_ddp.main, TrainConfig.preset("smoke", epochs=1, max_steps=5))
    print(json.dumps(dict(hosts=[e.host for e in cluster.engines], world_size=metrics["world_size"],
                          replicas_identical=metrics["replicas_identical"], devices=[e.device for e in cluster.engines])))
"""


def test_engines_through_slurm_on_both_nodes(slurm_pair):
    """The notebook's engines, started from a Python process on node1 (the job's first node, where the notebook would
    run): the controller listens on node1's eth0, and Slurm starts one engine on each node. device="auto" finds no
    GPU on the nodes and uses the CPU there."""
    run = child_processes.launch([nodes.command("node1", [sys.executable, "-c", ENGINES])], timeout=300, check=False)
    lines = [line for line in run.outputs[0].splitlines() if line.startswith("{")]
    assert run.ok and lines, run.outputs[0][-3000:]
    assert json.loads(lines[-1]) == dict(hosts=["node1", "node2"], world_size=2, replicas_identical=True,
                                         devices=["cpu", "cpu"])
    # Cancelled with the cluster; Slurm may still list it as completing (CG) for a few seconds on a busy machine.
    deadline = time.monotonic() + 60
    while (queue := nodes.run("node1", ["squeue", "-h"]).stdout.strip()) and time.monotonic() < deadline:
        time.sleep(1)
    assert not queue, f"the engines' job outlived the cluster by a minute: {queue}"

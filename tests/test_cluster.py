"""tutorial.launch.engines with real engines: local and MPI engines, the DDP and Horovod trainers, failures, a notebook.

Every test stops what it starts; the process table is checked after each cluster and after the whole file.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import sys
import threading
import time

import psutil
import pytest

import tutorial.launch.engines as cluster_mod
import tutorial.train_ddp as train_ddp
from conftest import needs_horovod, needs_mpi

from tutorial.core.config import TrainConfig
from tutorial.launch import child_processes, engine_cluster, engine_runs
from tutorial.launch.engines import STOP_GRACE_S, ClusterError, EngineTimeout, RankError


def leftovers(tag: str = child_processes.TAG) -> set[str]:
    """Cluster processes still running that carry `tag` (default: started by these tests). Everything a cluster
    starts carries its tag, below this process's; so does what a notebook kernel started here starts."""
    return {f"{p['pid']} {p['cmdline'][:150]}" for p in child_processes.leftovers(tag, child_processes.PROCESS_NAMES)
            if not p["zombie"]}


def assert_nothing_left(tag: str = child_processes.TAG, wait: float = 10.0) -> None:
    """Processes may take a moment to exit; anything still there after `wait` seconds is an orphan."""
    deadline = time.monotonic() + wait
    while leftovers(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers(tag) == set()


@pytest.fixture(scope="module", autouse=True)
def nothing_left_after_the_file():
    """After the whole file: no engine, controller, mpiexec, orted or reaper started by these tests remains."""
    yield
    assert_nothing_left()


# The engines import a function from a module by the module's name. This test file's import name depends on pytest's
# import mode, so the helpers live in a module of their own, in a temporary folder on the engines' PYTHONPATH.
HELPERS = '''
import os
import time

import torch.distributed as dist


def fail_on_rank(bad_rank):
    """One rank raises before the rendezvous; the others wait for it in init_process_group."""
    if int(os.environ["RANK"]) == bad_rank:
        raise ValueError(f"rank {bad_rank} has a bad value")
    dist.init_process_group("gloo")
    dist.barrier()


def whoami():
    return {"rank": int(os.environ["RANK"]), "pid": os.getpid(), "port": os.environ["MASTER_PORT"]}


def sleep(seconds):
    time.sleep(seconds)
    return os.getpid()
'''


@pytest.fixture(scope="module")
def helpers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine_helpers")
    (folder / "cluster_test_helpers.py").write_text(HELPERS)
    old_path, old_sys_path = os.environ.get("PYTHONPATH"), list(sys.path)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), old_path) if p)  # engines inherit it
    sys.path.insert(0, str(folder))
    import cluster_test_helpers
    yield cluster_test_helpers
    sys.path[:] = old_sys_path
    if old_path is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old_path


@pytest.fixture(scope="module")
def local(helpers, cluster):
    """conftest's two local engines (the session's; stopped, and checked for leftovers, when it ends), with the
    helpers' folder on their sys.path (engines restarted here inherit the PYTHONPATH that `helpers` set)."""
    cluster.view.execute(f"import sys; sys.path.insert(0, {os.path.dirname(helpers.__file__)!r})")
    return cluster


# ------------------------------------------------------------------------------------------- bad input: fast
@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "at least 1, got 0"),
    (dict(n=-2), "at least 1"),
    (dict(n="2"), "whole number"),
    (dict(n=2, engines="ssh"), "engines 'ssh' is not one of: local, mpi, slurm, pbs"),
    (dict(n=2, device="tpu"), "device 'tpu' is not one of"),
    (dict(n=2, on_failure="ignore"), "on_failure 'ignore'"),
    (dict(n=2, engines="slurm"), "needs sbatch"),
    (dict(engines="pbs"), "needs n"),
    (dict(n=2, interface="no-such-nic0"), "interface 'no-such-nic0' does not exist"),
    (dict(n=2, ip="127.0.0.1", interface="lo"), "not both"),
    (dict(n=2, ports="lots"), "not a port list"),
    (dict(n=2, profle="x"), "'profle' is neither an option of start"),
])
def test_bad_input_is_one_clear_error_and_starts_nothing(kwargs, message):
    if "sbatch" in message and shutil.which("sbatch"):
        pytest.skip("this machine has Slurm")
    before = leftovers()
    with pytest.raises(ClusterError, match=message) as info:
        cluster_mod.start(**kwargs)
    assert "\n" not in str(info.value)
    assert leftovers() <= before


def test_gpus_required_but_missing_or_too_few(monkeypatch):
    import torch
    before = leftovers()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ClusterError, match="device='gpu' needs GPUs"):
        cluster_mod.start(n=1, device="cuda")
    # A node with one GPU and two engines asked for: they would share it.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for device in ("cuda", "auto"):
        with pytest.raises(ClusterError, match="n=2 engines on this node but only 1 GPU"):
            cluster_mod.start(n=2, device=device)
    assert leftovers() <= before


def test_busy_port_is_reported_before_anything_starts():
    before = leftovers()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ClusterError, match=f"port {port} on 127.0.0.1 is in use"):
            cluster_mod.start(n=2, ports=f"{port}-{port + 20}")
    assert leftovers() <= before


def test_engines_that_cannot_start_give_their_output_and_leave_nothing(monkeypatch):
    tag = child_processes.new_tag()
    monkeypatch.setattr(child_processes, "new_tag", lambda: tag)  # the tag the cluster will have
    start = time.monotonic()
    with pytest.raises(RankError, match="engines stopped while starting"):
        cluster_mod.start(n=2, show=False, launcher=dict(engine_cmd=[sys.executable, "-c", "raise SystemExit(3)"]))
    assert time.monotonic() - start < 30
    assert_nothing_left(tag)


# -------------------------------------------------------------------------------------------- local engines
def test_ranks_threads_and_table(local):
    assert [e.rank for e in local.engines] == [0, 1]
    assert [e.local_rank for e in local.engines] == [0, 1]
    assert {e.world_size for e in local.engines} == {2}
    assert len({e.pid for e in local.engines}) == 2
    assert all(e.device == "cpu" for e in local.engines)
    # 2 engines share the node's cores instead of each taking all of them.
    assert all(e.threads == max(1, (os.cpu_count() or 1) // 2) for e in local.engines)
    table = local.table().splitlines()
    assert table[0].split() == ["rank", "local", "host", "pid", "device", "threads"]
    assert [line.split()[0] for line in table[1:]] == ["0", "1"]


def test_ddp_smoke_reaches_95_percent_with_identical_replicas(local, capsys):
    metrics = local.run(train_ddp.main, TrainConfig.preset("smoke"))
    assert metrics["world_size"] == 2
    assert metrics["test_accuracy"] >= 0.95
    assert metrics["replicas_identical"] and len(set(metrics["replica_checksums"])) == 1
    assert [r["replica_checksums"] for r in local.results] == [metrics["replica_checksums"]] * 2
    out = capsys.readouterr().out
    assert out.count("epoch 3:") == 1  # rank 0's progress streamed here, once (the other rank prints nothing)


def test_second_run_on_the_same_engines_repeats_the_first_exactly(local, helpers):
    """A fresh process group on a fresh port each run: same engines, same seed, bitwise the same replicas."""
    cfg = TrainConfig.preset("smoke", epochs=1, max_steps=10)
    pids = [e.pid for e in local.engines]
    first = local.run(train_ddp.main, cfg)
    second = local.run(train_ddp.main, cfg)
    assert second["replica_checksums"] == first["replica_checksums"]
    ports = [r["port"] for r in [local.run(helpers.whoami)] + [local.run(helpers.whoami)]]
    assert ports[0] != ports[1]
    assert [e.pid for e in local.engines] == pids  # no restart was needed


def test_exception_on_one_rank_names_it_with_the_remote_traceback(local, helpers):
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        local.run(helpers.fail_on_rank, 1)
    message = str(info.value)
    assert info.value.rank == 1 and "rank 1" in message
    assert "ValueError: rank 1 has a bad value" in message and "fail_on_rank" in info.value.remote_traceback
    assert "\x1b[" not in message  # no terminal colour codes
    assert "restarted" in message  # rank 0 was stuck waiting for rank 1
    assert time.monotonic() - start < 60
    assert local.run(helpers.whoami)["rank"] == 0  # usable again


def test_a_hang_is_bounded_by_the_timeout(local, helpers):
    start = time.monotonic()
    old = [e.pid for e in local.engines]
    with pytest.raises(EngineTimeout, match="did not finish within 2 s"):
        local.run(helpers.sleep, 600, timeout=2)
    assert time.monotonic() - start < 45
    assert not any(psutil.pid_exists(pid) for pid in old)  # the stuck engines were replaced
    assert local.run(helpers.sleep, 0) == local.engines[0].pid


def test_engine_killed_mid_run_gives_a_clear_error(local):
    """...and the engines that replace it keep what setenv() set (10's flight-recorder variables did not)."""
    local.setenv({"TUTORIAL_KEPT": "across restarts"})
    victim = local.engines[1]
    cfg = TrainConfig.preset("smoke", epochs=200)  # minutes of training: the kill lands in the middle
    killer = threading.Timer(4.0, os.kill, (victim.pid, signal.SIGKILL))
    start = time.monotonic()
    killer.start()
    try:
        with pytest.raises(RankError, match=f"rank 1 .*pid {victim.pid}.* died") as info:
            local.run(train_ddp.main, cfg)
    finally:
        killer.cancel()
    assert time.monotonic() - start < 60
    assert info.value.rank == 1
    assert not psutil.pid_exists(victim.pid)
    assert local.run(train_ddp.main, TrainConfig.preset("smoke", epochs=1, max_steps=2))["world_size"] == 2
    assert local.view.apply_sync(os.getenv, "TUTORIAL_KEPT") == ["across restarts"] * 2


def test_interrupt_of_code_that_never_looks_at_the_stop_flag_ends_it_with_a_keyboard_interrupt(local, helpers,
                                                                                                 monkeypatch):
    """A function that is not a trainer (time.sleep here) never sees the stop request: after STOP_GRACE_S the engines
    get a second SIGINT, a KeyboardInterrupt there; the same engines serve the next run."""
    import _thread
    import signal
    monkeypatch.setattr(engine_runs, "STOP_GRACE_S", 2.0)  # where run() reads it
    pids = [e.pid for e in local.engines]
    # As in a kernel, SIGINT raises KeyboardInterrupt here: a torchrun started in this test process earlier (by
    # another test) leaves torch.distributed.elastic's handler, which would raise its SignalException instead.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupt = threading.Timer(3.0, _thread.interrupt_main)  # what the kernel gets from JupyterLab's Interrupt
        start = time.monotonic()
        interrupt.start()
        with pytest.raises(KeyboardInterrupt, match=r"interrupted: cluster_test_helpers.sleep did not stop at a "
                                                    r"step within 2 s: a KeyboardInterrupt ended it on the engines "
                                                    r"\(2 of 2 ranks raised\); the engines are ready"):
            local.run(helpers.sleep, 600)
        assert time.monotonic() - start < 3.0 + 2.0 + 5.0
    finally:
        signal.signal(signal.SIGINT, previous)
    assert local.run(helpers.sleep, 0) == pids[0] and [e.pid for e in local.engines] == pids


def unbounded_new_master_port(self):
    """Cluster.new_master_port before issue 48 (the negative control): apply_sync, which waits without a bound."""
    from tutorial.core.distributed import hold_port
    port = self.master_port = self.client[self.engines[0].engine_id].apply_sync(hold_port)
    self.view.apply_sync(engine_cluster._setenv, {"MASTER_PORT": str(port)})
    return port


def test_an_engine_busy_with_another_task_is_named_within_the_bound_and_an_interrupt_frees_it(local, monkeypatch):
    """A task left on an engine (a %%px --noblock cell, a view.apply_async) held run() until it ended, without a word
    (278 s in issue 48), and an Interrupt there was lost: ipyparallel's blocking apply returns when interrupted, and
    the run queued behind the task. Now run() fails within ENGINE_CALL_S naming the busy rank, its pid and what it
    runs; an Interrupt while it waits stops that task, and the next run starts on the same engines. Negative control:
    with the port asked for as before (apply_sync, no bound), the same run waits for the whole task without a word,
    the Interrupt meanwhile lost."""
    monkeypatch.setattr(engine_cluster, "ENGINE_CALL_S", 2.0)  # where Cluster._ask reads it
    busy, pids = local.engines[1], [e.pid for e in local.engines]
    who = f"rank 1 (engine {busy.engine_id}, pid {busy.pid} on {busy.host})"
    timers = []

    def interrupt_in(seconds: float) -> None:  # SIGINT to the main thread, as the kernel gets JupyterLab's Interrupt
        timers.append(threading.Timer(seconds, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)))
        timers[-1].start()

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a kernel (see the test above)
    left = local.client[busy.engine_id].apply_async(time.sleep, 30)  # what a new user leaves behind
    try:
        start = time.monotonic()
        with pytest.raises(EngineTimeout, match="did not answer within 2 s") as info:
            local.run(os.getpid)
        named = time.monotonic() - start
        assert f"{who} is busy with time.sleep, sent " in str(info.value) and "rank 0" not in str(info.value)
        assert "send_signal('SIGINT'" in str(info.value) and "cluster.restart()" in str(info.value)
        assert (info.value.rank, info.value.pid) == (1, busy.pid) and not left.ready()
        interrupt_in(1.0)
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt, match=rf"interrupted while waiting for the engines .*: {re.escape(who)} "
                                                    r"is busy with time\.sleep, sent \d+ s ago; SIGINT stopped it: "
                                                    r"the engines are ready for the next cell$"):
            local.run(os.getpid)
        freed = time.monotonic() - start
        with pytest.raises(Exception, match="KeyboardInterrupt"):  # the task the Interrupt stopped
            left.get(0)
        assert local.run(os.getpid) == pids[0] and [e.pid for e in local.engines] == pids  # no restart was needed
        print(f"busy engine named after {named:.1f} s; Interrupt -> freed after {freed - 1.0:.1f} s")
        assert named < 2.0 + 3.0 and freed < 1.0 + 3.0
        # The negative control, the port asked for as before: the run waits for the whole task, the Interrupt lost.
        monkeypatch.setattr(engine_cluster.Cluster, "new_master_port", unbounded_new_master_port)
        left, start = local.client[busy.engine_id].apply_async(time.sleep, 4), time.monotonic()
        interrupt_in(1.0)
        assert local.run(os.getpid) == pids[0] and time.monotonic() - start > 3.5 and left.get(0) is None
    finally:
        for timer in timers:
            timer.cancel()
        signal.signal(signal.SIGINT, previous)
        if not left.ready():
            local.client.send_signal("SIGINT", targets=[busy.engine_id], block=True)
            left.wait(10)


def test_a_run_ended_by_the_callers_own_time_limit_leaves_no_engine_busy(local):
    """The caller's own limit (pytest-timeout's alarm, here SIGALRM raising an exception) ends run()'s wait while the
    ranks still run: the engines are replaced on the way out, the exception says so, and the next run starts at once.
    Negative control: before, the ranks stayed busy with the old task and every later run failed (a CI run in which
    one test's timeout failed every engine test after it)."""
    class OwnLimit(Exception):
        pass

    def limit(signum, frame):
        raise OwnLimit("the caller's time limit")

    old_pids = [e.pid for e in local.engines]
    previous = signal.signal(signal.SIGALRM, limit)
    signal.alarm(2)
    try:
        with pytest.raises(OwnLimit) as caught:
            local.run(time.sleep, 120)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert caught.value.__notes__ == ["time.sleep was still running on the engines: The engines were restarted (new "
                                      "processes); run again."]
    assert local._healthy() and local.run(os.getpid) not in old_pids


def test_functions_defined_in_a_notebook_run_on_the_engines(local):
    """ipyparallel sends a function's code: one defined in a notebook (module __main__), a lambda too, runs on every
    engine with the engine's namespace as its globals, so it imports what it uses."""
    def rank_and_pid():
        import os
        return int(os.environ["RANK"]), os.getpid()
    square = lambda x: x * x  # noqa: E731
    rank_and_pid.__module__ = square.__module__ = "__main__"  # as in a notebook cell
    assert local.run(rank_and_pid) == (0, local.engines[0].pid)
    assert local.results == [(e.rank, e.pid) for e in local.engines]
    assert local.run(square, 7) == 49 and local.results == [49, 49]
    # A function of a module the engines cannot import fails there, with the engine's own error.
    rank_and_pid.__module__ = "no_such_module_here"
    with pytest.raises(RankError, match="ModuleNotFoundError: No module named 'no_such_module_here'"):
        local.run(rank_and_pid)


@needs_horovod
def test_horovod_on_local_engines_is_refused(local):
    import tutorial.train_horovod as train_horovod
    with pytest.raises(ClusterError, match="engines='mpi'"):
        local.run(train_horovod.main, TrainConfig.preset("smoke"))


# --------------------------------------------------------------------------------------------- MPI engines
@needs_mpi
@needs_horovod
def test_mpi_engines_run_horovod_and_ddp_with_mpi_ranks():
    import tutorial.train_horovod as train_horovod
    with cluster_mod.start(n=2, engines="mpi", show=False) as c:
        # ipengine --mpi asks for its MPI rank as engine id; the rank is the MPI rank in any case.
        assert [e.rank for e in c.engines] == [e.mpi_rank for e in c.engines] == [e.engine_id for e in c.engines]
        assert [e.rank for e in c.engines] == [0, 1]
        hvd = c.run(train_horovod.main, TrainConfig.preset("smoke", epochs=1))
        assert hvd["world_size"] == 2 and hvd["replicas_identical"]
        ddp = c.run(train_ddp.main, TrainConfig.preset("smoke", epochs=1))
        assert ddp["world_size"] == 2 and ddp["replicas_identical"]
        again = c.run(train_horovod.main, TrainConfig.preset("smoke", epochs=1))  # Horovod stays initialised
        assert again["replica_checksums"] == hvd["replica_checksums"]
    assert c.leftovers() == []
    assert_nothing_left(c.tag)


# ------------------------------------------------------------------------------- sequence, stop, reaper
def test_two_clusters_one_after_the_other_and_an_exception_in_the_with_block(helpers):
    with cluster_mod.start(n=1, show=False) as c:
        first = c.run(helpers.whoami)["pid"]
        assert c.leftovers()
        assert str(c._reaper.pid) in {line.split()[0] for line in leftovers(c.tag)}  # check_leftovers.sh's list has it
    assert c.leftovers() == []
    assert_nothing_left(c.tag)
    with pytest.raises(KeyError):  # leaving the block by an exception stops everything too
        with cluster_mod.start(n=1, show=False) as c:
            second = c.run(helpers.whoami)["pid"]
            assert second != first
            assert c.run(helpers.whoami, fresh=True)["pid"] not in (first, second)  # fresh: new engine processes
            raise KeyError("the notebook cell failed")
    assert c.leftovers() == []
    assert_nothing_left(c.tag)
    with pytest.raises(ClusterError, match="was stopped"):
        c.run(helpers.whoami)
    c.stop()  # twice is fine


NOTEBOOK_CELLS = [
    "import tutorial.launch.engines, tutorial.train_ddp\nfrom tutorial.core.config import TrainConfig\n"
    "cluster = tutorial.launch.engines.start(n=2, show=False)",
    "%%px\nimport os\nprint('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])",
    "m = cluster.run(tutorial.train_ddp.main, TrainConfig.preset('smoke', epochs=1))\nprint(m['replicas_identical'])",
]


def test_notebook_px_cell_quiet_output_and_killed_kernel_leaves_nothing(monkeypatch):
    """The notebook way: %%px runs on every engine, no ipyparallel noise in outputs; a kernel killed with the
    cluster still running (nbval's timeout, a crash) leaves no engine behind thanks to the reaper."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    kernel_tag = child_processes.new_tag()
    monkeypatch.setenv(child_processes.TAG_VARIABLE, kernel_tag)  # the kernel's cluster carries it on
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOK_CELLS])
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": "."}})
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        kernel_pid = client.km.provisioner.process.pid
        assert leftovers(kernel_tag)  # the cluster is running
        os.kill(kernel_pid, signal.SIGKILL)  # no stop(): the reaper must clean up
    texts = ["".join(o.get("text", "") for o in cell.outputs) for cell in nb.cells]
    assert nb.cells[0].outputs == []  # no log lines, no progress bar
    assert "rank 0 of 2" in texts[1] and "rank 1 of 2" in texts[1]
    assert "%px" not in texts[1] and "tasks" not in texts[1]  # no progress bar
    assert "epoch 0:" in texts[2] and texts[2].rstrip().endswith("True")
    assert_nothing_left(kernel_tag, wait=20)


@pytest.mark.parametrize("kind, launcher_class, expected", [
    ("slurm", "SlurmEngineSetLauncher", ["#SBATCH --nodes=2", "#SBATCH --ntasks=8", "srun --kill-on-bad-exit=1"]),
])
def test_batch_recipes_render_for_ipyparallel(kind, launcher_class, expected, tmp_path):
    """The Slurm recipe is an ipyparallel batch template: every placeholder must be filled (no queue here). The PBS
    templates (scripts/pbs/polaris/, scripts/pbs/openmpi/) are rendered and run in tests/test_pbs_recipes.py."""
    from pathlib import Path

    from ipyparallel.cluster import launcher
    template = Path(__file__).resolve().parents[1] / "scripts" / kind / "engines.sh"
    engines = getattr(launcher, launcher_class)(
        work_dir=str(tmp_path), profile_dir=str(tmp_path), cluster_id="c1", queue="gpu",
        batch_template_file=str(template),
        namespace=dict(account="acct", walltime="01:00:00", timelimit="01:00:00", ppn=4, cpus_per_gpu=8))
    engines.write_batch_script(8)
    script = Path(engines.batch_file).read_text()
    assert "{" not in script and "}" not in script
    assert "ipyparallel.engine" in script
    # The engines find their cluster through the submitting environment, which both recipes export to the job.
    assert engines.get_env()["IPP_CLUSTER_ID"] == "c1" and ("#PBS -V" in script or "--export=ALL" in script)
    for line in expected:
        assert line in script


# ------------------------------------------------------------- the lab as attendees use it: a real kernel
class Kernel:
    """A notebook kernel driven the way JupyterLab drives it (jupyter_client): cells one by one, Interrupt
    (km.interrupt_kernel, SIGINT to the kernel) and Restart (km.restart_kernel). Its clusters carry `tag`."""

    def __init__(self, tag: str, cwd):
        from jupyter_client import KernelManager
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=dict(os.environ, **{child_processes.TAG_VARIABLE: tag}), cwd=str(cwd))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=90)

    def send(self, code: str) -> str:
        return self.kc.execute(code)

    def outputs(self, msg_id: str, timeout: float = 180, until=None) -> tuple[str, dict]:
        """The cell's text (streams, results, errors) until it is done, or until `until(text)` holds: then (text,
        {}). Otherwise (text, its execute_reply content)."""
        text, deadline = "", time.monotonic() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                text += content["text"]
            elif kind in ("execute_result", "display_data"):
                text += content["data"].get("text/plain", "") + "\n"
            elif kind == "error":
                text += f"{content['ename']}: {content['evalue']}\n"
            elif kind == "status" and content["execution_state"] == "idle":
                break
            if until is not None and until(text):
                return text, {}
        while True:  # skipping replies to earlier requests (wait_for_ready may have asked for kernel_info twice)
            reply = self.kc.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                return text, reply["content"]

    def run(self, code: str, timeout: float = 180) -> str:
        text, reply = self.outputs(self.send(code), timeout)
        assert reply["status"] == "ok", f"{code}\n-> {text}"
        return text

    def close(self) -> None:
        self.kc.stop_channels()
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=True)


def test_the_reaper_sweeps_a_cluster_whose_kernel_died_in_the_middle_of_stopping_it():
    """A kernel killed while it stopped its cluster (a restart kills it 5 s after asking it to shut down, and
    ipyparallel's stop at exit had removed the cluster file): the reaper still stops every process with the cluster's
    tag. Before (fc20, under load), it swept only where the file was left, and an engine and its nanny outlived the
    kernel until their 175 s without a hub. Here the file is removed and the process exits without stopping anything."""
    import subprocess
    code = ("import os; from tutorial.launch import engines; c = engines.start(n=1, show=False); print('TAG=' + c.tag, "
            "flush=True); os.remove(c._ipp.cluster_file); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    tags = [line.removeprefix("TAG=") for line in out.stdout.splitlines() if line.startswith("TAG=")]
    assert out.returncode == 0 and len(tags) == 1, out
    tag = tags[0]
    deadline = time.monotonic() + 20
    while child_processes.leftovers(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = child_processes.leftovers(tag)
    child_processes.stop(left)
    assert not left, left


def cluster_pids(tag: str) -> set[int]:
    return {int(line.split()[0]) for line in leftovers(tag)}


def test_interrupt_stops_the_engines_run_at_a_step_and_the_next_cell_runs_at_once(tmp_path):
    """Interrupt during cluster.run (JupyterLab's Interrupt: SIGINT to the kernel) stops the training on the engines
    as a SIGTERM does, every rank at the same step, the checkpoint whole; one line says so, and the next cell starts
    at once on the same engines. Under %%px, ipyparallel's magic interrupts the engines itself. Before this, the
    engines went on training and the next cell waited for the abandoned run (69 s in issue 29)."""
    tag, out = child_processes.new_tag(), tmp_path / "run"
    kernel = Kernel(tag, tmp_path)
    try:
        kernel.run("import time\nimport tutorial.launch.engines as engines, tutorial.train_ddp as train_ddp\n"
                   "from tutorial.core.config import TrainConfig\ncluster = engines.start(n=2, show=False)\n"
                   "pids = [e.pid for e in cluster.engines]")
        running = kernel.send(f"cluster.run(train_ddp.main, TrainConfig.preset('smoke', epochs=400, out={str(out)!r}))")
        kernel.outputs(running, timeout=120, until=lambda text: "epoch 1:" in text)  # training for minutes
        interrupted = time.time()
        kernel.km.interrupt_kernel()
        text, reply = kernel.outputs(running, timeout=60)
        replied = time.time() - interrupted
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", text
        line = reply["evalue"]
        assert "\n" not in line and "train_ddp.main stopped on all 2 ranks at step " in line, line
        assert "the engines are ready for the next cell" in line and str(out) in line
        step = int(line.split(" at step ")[1].split(",")[0])
        # Nothing half-written: the checkpoint rank 0 saved at the agreed step, and no partial file beside it.
        assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint.pt"]
        import torch
        saved = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=True)
        assert saved["step"] == step
        # The next cell: the same engines go on from the checkpoint to the end of that epoch, replicas identical.
        text = kernel.run(f"started = time.time()\nm = cluster.run(train_ddp.main, TrainConfig.preset('smoke', "
                          f"epochs={saved['epoch'] + 1}, out={str(out)!r}, resume='auto', quiet=True))\n"
                          "print('NEXT', started, m['replicas_identical'], m['steps'], "
                          "[e.pid for e in cluster.engines] == pids)", timeout=120)
        started, identical, steps, same_engines = text.split("NEXT ")[1].split()
        next_cell_after = float(started) - interrupted
        print(f"interrupt -> reply {replied:.1f} s, -> next cell's start {next_cell_after:.1f} s")
        assert replied < STOP_GRACE_S and next_cell_after < STOP_GRACE_S + 2
        assert identical == "True" and int(steps) > step and same_engines == "True"
        # %%px: ipyparallel's magic sends SIGINT to the engines; the cell's code stops where it is.
        sleeping = kernel.send("%%px\nimport time\ntime.sleep(300)")
        time.sleep(3)
        interrupted = time.time()
        kernel.km.interrupt_kernel()
        text, _ = kernel.outputs(sleeping, timeout=60)
        assert "Sending signal SIGINT to engines" in text, text
        text = kernel.run("print('NEXT', time.time())\n%px import os; os.getpid()", timeout=60)
        assert float(text.split("NEXT ")[1].split()[0]) - interrupted < 10
        kernel.run("cluster.stop()")
        assert_nothing_left(tag)
    finally:
        kernel.close()
    assert_nothing_left(tag, wait=20)


def test_interrupt_frees_engines_stuck_in_a_rendezvous_and_names_the_stuck_rank(tmp_path):
    """The mistake every attendee makes once: a %%px cell in which rank 0 raises before the rendezvous while rank 1
    calls init_process_group and waits for it, in C++, where SIGINT does not reach (gloo's default wait: 30 min).
    Before (issue 38), Interrupt left rank 1's engine busy: the next cell queued behind it for over 120 s, and the
    reaper needed minutes after the kernel went. Now, within 30 s of Interrupt, one line names rank 1 and the
    address it waits on, the engines are restarted, and the next cell runs on them. Rank 0's own error is shown too."""
    tag = child_processes.new_tag()
    kernel = Kernel(tag, tmp_path)
    try:
        kernel.run("import time\nimport tutorial.launch.engines as engines\ncluster = engines.start(n=2, show=False)\n"
                   "port = cluster.new_master_port()\nbefore = [e.pid for e in cluster.engines]")
        stuck = kernel.send("%%px\nimport os\nimport torch.distributed as dist\n"
                            "if os.environ['RANK'] == '0':\n    raise ValueError('rank 0 has a bad value')\n"
                            "dist.init_process_group('gloo')")
        time.sleep(5)  # rank 0 has failed; rank 1 waits in the rendezvous
        interrupted = time.monotonic()
        kernel.km.interrupt_kernel()
        text, reply = kernel.outputs(stuck, timeout=60)
        freed = time.monotonic() - interrupted
        port = kernel.run("print(port)").strip()
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", text
        line = reply["evalue"]
        assert "\n" not in line and "rank 1 (engine" in line and "rank 0 (" not in line, line
        assert f"in the rendezvous at 127.0.0.1:{port}" in line and "engines were restarted" in line, line
        assert "rank 0 raised ValueError: rank 0 has a bad value" in line and "[rank 0] " in text, text  # its error too
        started = time.monotonic()
        after = kernel.run("%px import os; os.getpid()\nprint('NEXT', [e.pid for e in cluster.engines] != before)")
        print(f"interrupt -> freed after {freed:.1f} s; next cell {time.monotonic() - started:.1f} s")
        assert freed < 30 and "NEXT True" in after and time.monotonic() - started < 10, after
        kernel.run("cluster.stop()")
        assert_nothing_left(tag)
    finally:
        kernel.close()
    assert_nothing_left(tag, wait=20)


def test_starting_engines_twice_reuses_or_replaces_and_a_restart_leaves_nothing(tmp_path):
    """Re-running the engines cell: the same request reuses the running cluster, another stops it first (one line
    each; before, every run added a controller and engines: 10 processes, then 20). A cluster asked for by name runs
    beside it. Restarting the kernel (JupyterLab's Restart) leaves no process within a bounded time."""
    tag = child_processes.new_tag()
    kernel = Kernel(tag, tmp_path)
    try:
        kernel.run("import tutorial.launch.engines as engines\nc1 = engines.start(n=2, show=False)")
        first = cluster_pids(tag)
        assert len(first) >= 5  # controller, 2 engines (and their nannies), the reaper
        text = kernel.run("c2 = engines.start(n=2, show=False)\nprint(c2 is c1)")
        assert text.count("\n") == 2 and "reusing the 2 local engine(s)" in text and text.endswith("True\n"), text
        assert cluster_pids(tag) == first
        text = kernel.run("c3 = engines.start(n=2, show=False, on_failure='stop')\nprint(c1.leftovers())")
        assert "stopped the 2 local engine(s) this kernel started before" in text and text.endswith("[]\n"), text
        deadline = time.monotonic() + 10
        while cluster_pids(tag) & first and time.monotonic() < deadline:
            time.sleep(0.2)
        second = cluster_pids(tag)
        assert not second & first and len(second) == len(first)
        text = kernel.run("c4 = engines.start(n=1, show=False, name='beside')")
        assert text == "" and cluster_pids(tag) > second  # a named cluster runs beside the kernel's one
        start = time.monotonic()
        kernel.km.restart_kernel(now=False)
        assert_nothing_left(tag, wait=30)
        print(f"restart -> nothing left after {time.monotonic() - start:.1f} s")
        kernel.kc.wait_for_ready(timeout=90)
        assert kernel.run("print(1 + 1)") == "2\n"  # the restarted kernel works
    finally:
        kernel.close()
    assert_nothing_left(tag)

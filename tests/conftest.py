"""Shared helpers: launch trainers the way people do (python -m, torchrun, mpirun, horovodrun) and read results."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Every process of the tests waits for OpenMP work passively (set before torch starts OpenMP here; the ranks, engines
# and kernels inherit it). GNU OpenMP, torch's, spins a waiting thread by default, and on a machine with more busy
# threads than cores that burns the CPU another test needs: a smoke training beside the suite took 10-24 s of CPU
# spinning, 7.3-8.1 s passive (2026-11-29, 2-core EPYC). Only the wait changes, never a result.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Open MPI's ranks poll for messages without pause unless the node is oversubscribed; here they share 2 cores with
# the other lane, so a waiting rank yields instead: a 2-rank Horovod smoke run under mpirun took 23.7 s of CPU
# polling, 17.6 s yielding (2026-11-29). Only the wait changes, never a result.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
import torch  # noqa: E402

from tutorial.core.process import open_mpi_env

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BIN = Path(PYTHON).parent


def env(**extra) -> dict:
    """This process's environment for a launch: unbuffered, no inherited rendezvous, what Open MPI needs here, and
    `extra` (a rendezvous a test gives on purpose is kept: without it a 2-rank job falls back to port 29500, which
    a notebook running beside the tests may hold)."""
    e = open_mpi_env(dict(os.environ, PYTHONUNBUFFERED="1"))
    e.pop("MASTER_ADDR", None), e.pop("MASTER_PORT", None)
    return {**e, **extra}


@contextlib.contextmanager
def agent_store():
    """A rendezvous this test process hosts for the ranks it spawns, as torchrun's agent hosts one for its workers: a
    store on a port the system picks, held until the ranks are done, which every rank joins as a client
    (TORCHELASTIC_USE_AGENT_STORE; each group of a run under its own TORCHELASTIC_RESTART_COUNT, as torch keeps
    restarts apart). Yields the variables to give the ranks. No port is chosen free and bound later (issue 38)."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
                   TORCHELASTIC_RESTART_COUNT="0")
    finally:
        del store


def run(cmd, timeout=180, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=env(),
                          cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def train_cmd(stage: str, *args) -> list:
    return [PYTHON, "-m", f"tutorial.train_{stage}", *args]


def torchrun_cmd(nproc: int, stage: str, *args) -> list:
    return [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", f"tutorial.train_{stage}", *args]


def mpirun_cmd(nproc: int, stage: str, *args) -> list:
    return [shutil.which("mpirun"), "-np", str(nproc), PYTHON, "-m", f"tutorial.train_{stage}", *args]


def horovodrun_cmd(nproc: int, *args, controller: str = "--gloo") -> list:
    return [BIN / "horovodrun", "-np", str(nproc), "-H", f"localhost:{nproc}", controller,
            PYTHON, "-m", "tutorial.train_horovod", *args]


def metrics(out) -> dict:
    return json.loads((Path(out) / "metrics.json").read_text())


def params(out) -> torch.Tensor:
    """The saved model's parameters as one vector (checkpoints hold the unwrapped model)."""
    state = torch.load(Path(out) / "checkpoint.pt", map_location="cpu", weights_only=False)["model"]
    return torch.cat([v.float().reshape(-1) for v in state.values()])


def have_horovod() -> bool:
    try:
        import horovod.torch  # noqa: F401
        return True
    except ImportError:
        return False


needs_mpi = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
needs_horovod = pytest.mark.skipif(not have_horovod(), reason="Horovod not built (run make install)")


def exercise_cell(notebook: str, heading: str) -> str:
    """The source of the code cell an exercise starts from (the first code cell after its `### Exercise N` heading),
    exactly as the learner finds it in notebooks/<notebook>.ipynb."""
    path = ROOT / "notebooks" / f"{notebook}.ipynb"
    cells = json.loads(path.read_text())["cells"]
    start = next(i for i, c in enumerate(cells) if "".join(c["source"]).startswith(heading))
    return "".join(next(c for c in cells[start:] if c["cell_type"] == "code")["source"])


def skeleton(notebook: str, heading: str, name: str | None = None):
    """What the exercise's code cell defines, unedited: the function (or class) called `name`, or the first one."""
    namespace: dict = {}
    exec(compile(exercise_cell(notebook, heading), f"{notebook}.ipynb", "exec"), namespace)
    if name:
        return namespace[name]
    return next(v for k, v in namespace.items() if callable(v) and not k.startswith("__"))


@pytest.fixture(scope="session")
def ddp_standalone_run(tmp_path_factory):
    """examples/ddp_standalone.py launched once, as README and 03b's capstone launch it (torchrun, 2 ranks): its out
    folder (result.json, model.pt), which test_examples and test_exercises_03 read; they launch it again only where
    they change it or watch it."""
    out = tmp_path_factory.mktemp("ddp_standalone")
    run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         ROOT / "examples" / "ddp_standalone.py", "--out", out])
    return out


@pytest.fixture(scope="session")
def session_engines():
    """Two local notebook engines for the whole test session: a start costs seconds on 2 cores, and a dozen modules
    need just 2 local engines. Their tag is outside this process's (child_processes.TAG), so the modules that check that
    they left nothing running do not see them; this fixture checks them when the session ends."""
    from tutorial.launch import child_processes, engines
    tag = f"tests-engines-{os.getpid()}-{os.urandom(4).hex()}"
    own_tag, child_processes.new_tag = child_processes.new_tag, lambda: tag
    try:
        # a run that hangs ends in an EngineTimeout naming the stuck ranks and what they wait for, before
        # pytest-timeout's 300 s would end the test with only this process's stacks
        c = engines.start(n=2, show=False, name="tests", run_timeout=240)
    finally:
        child_processes.new_tag = own_tag
    yield c
    c.stop()
    assert c.leftovers() == [] and child_processes.leftovers(tag) == []


@pytest.fixture(scope="module")
def cluster(session_engines):
    """conftest's two local engines: exercise checkers that run code on ranks (each makes and leaves its own process
    group) and trainers run through `cluster.run`. Shared by the session; a module gets them as the previous one left
    them, restarted (fresh processes, same cluster) when that one broke them."""
    c = session_engines
    assert not c._stopped, "a test stopped the session's engines; tests that stop engines start their own"
    if not c._healthy():
        c.restart()
    yield c


@pytest.fixture(autouse=True)
def engines_answer_before_each_test(request):
    """Before every test that uses the session's engines (directly or through a module's fixture): a ping (a few ms),
    and fresh engines if one does not answer, so that one test that broke them fails alone, not every test after it.
    (pytest sets up module-scoped fixtures before this one: `cluster` checks them too, for those.)"""
    if "cluster" in request.fixturenames:
        c = request.getfixturevalue("cluster")
        if not c._healthy():
            c.restart()


@pytest.fixture
def nothing_left_behind():
    """After a test: no process it started survives (everything this process starts carries its launch tag). Any
    that did is stopped, and the test fails naming it. Test modules that launch use it for every test."""
    from tutorial.launch import child_processes
    yield
    left = child_processes.leftovers()
    child_processes.stop(left)
    assert not left, f"processes left behind: {left}"


# In a JupyterLab page driven by Playwright (tests/test_lab_ui.py, tests/test_hub.py).
def type_cell(page, code: str) -> None:
    """A new cell at the end (command mode B on the last cell), the code typed in, Shift+Enter."""
    page.locator(".jp-NotebookPanel .jp-Cell").last.locator(".jp-InputPrompt").click()
    page.keyboard.press("Escape")
    page.keyboard.press("b")
    page.keyboard.press("Enter")
    page.keyboard.type(code)
    page.keyboard.press("Shift+Enter")

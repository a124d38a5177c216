"""The launch helpers behind 06_multi_node's rehearsals: bounded launches, one error per failed node, the commands
they type, and nothing left behind. The hand-written tcp:// and file:// ranks, the missing interface, torchrun's
c10d rendezvous on one machine and the workers a killed torchrun leaves behind are 06's own cells, which strict nbval
runs and compares (tests/test_virtual_cluster.py runs them across virtual nodes)."""
from __future__ import annotations

import os
import sys
import time

import pytest

from tutorial.launch import child_processes, commands, worker
from tutorial.lessons import multi_node

pytestmark = pytest.mark.usefixtures("nothing_left_behind")  # conftest's: every test stops what it started


def test_a_failing_node_is_one_error_with_its_output():
    fail = [sys.executable, "-c", "print('disk quota exceeded'); raise SystemExit(3)"]
    ok = [sys.executable, "-c", "pass"]
    with pytest.raises(RuntimeError, match=r"node 1 exited with code 3:(.|\n)*disk quota exceeded"):
        child_processes.launch([ok, fail], timeout=30)
    assert not child_processes.launch([ok, fail], timeout=30, check=False).ok


def test_a_failed_node_ends_the_launch(monkeypatch):
    monkeypatch.setattr(child_processes, "FAILED_NODE_GRACE_S", 1.0)
    waiting = [sys.executable, "-c", "import time; time.sleep(120)"]
    fail = [sys.executable, "-c", "raise SystemExit(4)"]
    start = time.monotonic()
    run = child_processes.launch([waiting, fail], timeout=60, check=False)
    assert run.returncodes[1] == 4 and run.returncodes[0] != 0 and time.monotonic() - start < 20


def test_a_hanging_launch_is_stopped_at_its_timeout():
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 1 s"):
        child_processes.launch([sleeper, sleeper], timeout=1)
    assert time.monotonic() - start < 20
    assert not child_processes.leftovers()


def test_mpi_commands_name_the_hosts():
    assert commands.display(commands.mpirun_command("o")).startswith("mpirun -np 2 -H localhost:2 python -m")
    hvd = commands.horovodrun_command("o", np=8, hosts="node1:4,node2:4", controller="--gloo")
    assert commands.display(hvd).startswith("horovodrun -np 8 -H node1:4,node2:4 --gloo python -m "
                                             "tutorial.train_horovod")


def test_launcher_env(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    env = child_processes.launcher_env(GLOO_SOCKET_IFNAME="lo")
    assert "MASTER_ADDR" not in env and env["GLOO_SOCKET_IFNAME"] == "lo" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert ("OMPI_ALLOW_RUN_AS_ROOT" in env) == (os.geteuid() == 0)
    assert env[child_processes.TAG_VARIABLE].startswith(child_processes.TAG + "/")


def test_worker_cli_wants_rank_and_world_size_together(capsys):
    with pytest.raises(SystemExit) as exc:
        worker.main(["--rank", "0"])
    assert exc.value.code == 2 and "together" in capsys.readouterr().err


def test_scripts_are_printed_from_the_repository(capsys):
    multi_node.script("slurm/ddp.sbatch")
    assert "#SBATCH --nodes=2" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="scripts/nope.sh"):
        multi_node.script("nope.sh")

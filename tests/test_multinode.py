"""Multi-node rehearsals on localhost (06_multi_node): real processes joining gloo groups, and nothing left behind."""
from __future__ import annotations

import os
import sys
import time

import pytest

from tutorial.launch import child_processes, commands, worker
from tutorial.lessons import multi_node

pytestmark = pytest.mark.usefixtures("nothing_left_behind")  # conftest's: every test stops what it started


@pytest.mark.parametrize("init", ["tcp", "file"])
def test_manual_ranks_join_one_group(init, tmp_path):
    seen = multi_node.manual_ranks(init, world_size=2, shared_dir=str(tmp_path))
    assert [r.get("rank") for r in seen] == [0, 1], seen
    for report in seen:
        assert report["world_size"] == 2 and report["all_reduce_sum"] == 1 + 2
        assert report["weights_match_rank_0"] and report["init_method"] == init


def test_a_missing_interface_fails_at_once_with_its_name():
    start = time.monotonic()
    seen = multi_node.manual_ranks("tcp", GLOO_SOCKET_IFNAME="nosuch0")
    assert all("nosuch0" in r.get("error", "") for r in seen), seen
    assert time.monotonic() - start < 60


def test_torchrun_c10d_rendezvous_numbers_two_nodes():
    nodes = commands.torchrun_nodes("", rdzv="c10d", program=["-m", "tutorial.launch.worker"])
    assert all("--node_rank" not in cmd for cmd in nodes)
    seen = multi_node.rank_reports(child_processes.launch(nodes, timeout=120))
    assert [r["rank"] for r in seen] == [0, 1]
    assert all(r["world_size"] == 2 and r["all_reduce_sum"] == 3 and r["init_method"] == "env" for r in seen)


def test_workers_outlive_a_killed_launcher_until_stopped():
    survivors = multi_node.kill_the_launcher(nproc=2, hold=60)
    assert len(survivors) == 2 and not any(p["zombie"] for p in survivors)
    assert len(child_processes.stop(survivors)) == 2
    assert not child_processes.leftovers()


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


def test_static_torchrun_commands_differ_only_in_node_rank():
    node0, node1 = commands.torchrun_nodes("runs/x", port=29555)
    assert [(a, b) for a, b in zip(node0, node1) if a != b] == [("0", "1")]
    assert commands.display(node0).startswith("torchrun --nnodes 2 --nproc_per_node 1 --node_rank 0 "
                                               "--master_addr 127.0.0.1 --master_port 29555 -m tutorial.train_ddp")
    with pytest.raises(ValueError, match="static, c10d"):
        commands.torchrun_nodes("runs/x", rdzv="etcd")


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

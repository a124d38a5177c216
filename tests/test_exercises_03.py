"""03_distributed_data_parallel's exercises and capstone: each checker accepts the package's solution and rejects
the skeleton the notebook stores, naming the mistake."""
from __future__ import annotations

import json

from conftest import PYTHON, ROOT, run
from conftest import skeleton as notebook_skeleton

from tutorial.lessons import ddp


def skeleton(heading: str):
    return notebook_skeleton("03_distributed_data_parallel", heading)



def test_exercise_1_set_epoch():
    assert ddp.check_epoch_orders(ddp.solution_epoch_orders).startswith("correct: a new shuffle every epoch")
    verdict = ddp.check_epoch_orders(skeleton("### Exercise 1"))
    assert verdict.startswith("wrong: rank 0 reads") and "set_epoch(epoch)" in verdict


def test_exercise_2_one_checkpoint_writer(cluster):
    assert ddp.check_checkpoint(cluster, ddp.solution_save_checkpoint).startswith("correct: rank 0 alone")
    verdict = ddp.check_checkpoint(cluster, skeleton("### Exercise 2"))
    assert verdict.startswith("wrong: ranks 0, 1 all wrote") and "dist.get_rank() == 0" in verdict


BARRIER_INSIDE_THE_IF = """
def save_checkpoint(model, path):
    import torch
    import torch.distributed as dist
    if dist.get_rank() == 0:
        torch.save(model.module.state_dict(), path)
        dist.barrier()
"""


def test_exercise_2_names_a_barrier_inside_the_if(cluster):
    namespace: dict = {}  # defined as in a notebook, so that the engines get it by value, not by module name
    exec(BARRIER_INSIDE_THE_IF, namespace)
    verdict = ddp.check_checkpoint(cluster, namespace["save_checkpoint"])
    assert verdict.startswith("wrong: rank") and "inside `if rank == 0`" in verdict


def test_exercise_3_no_sync(cluster):
    assert ddp.check_accumulation(cluster, ddp.solution_accumulate).startswith("correct: one all-reduce for 4")
    verdict = ddp.check_accumulation(cluster, skeleton("### Exercise 3"))
    assert verdict.startswith("wrong: 4 all-reduces") and "no_sync" in verdict


def test_exercise_4_metrics_averaged(cluster):
    correct = "correct: every rank reports 2, the mean over all 6 samples"
    assert ddp.check_epoch_loss(cluster, ddp.solution_epoch_loss) == correct
    verdict = ddp.check_epoch_loss(cluster, skeleton("### Exercise 4"))
    assert verdict.startswith("wrong: every rank reports 2.25, the mean of the ranks' means") and "counts" in verdict


def test_capstone(tmp_path):
    solution = ROOT / "examples/ddp_standalone.py"  # the capstone's solution is the standalone DDP example
    run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", solution,
         "--out", tmp_path / "ddp"])
    assert ddp.check_capstone(tmp_path / "ddp").startswith("correct: 2 ranks, identical replicas")
    run([PYTHON, ROOT / "notebooks/capstone/train_plain.py", "--epochs", "1", "--out", tmp_path / "plain"])
    assert json.loads((tmp_path / "plain/result.json").read_text())["world_size"] == 1
    assert ddp.check_capstone(tmp_path / "plain").startswith("wrong: result.json says world size 1")

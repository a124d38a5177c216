"""03's exercises (03a_ddp_by_hand's 1 and 2; 03b_ddp_trainer's 1 and 2, numbered 3 and 4 here) and capstone: each
checker accepts the package's solution and another correct answer, and rejects the skeleton the notebook stores and
other plausible mistakes, naming each."""
from __future__ import annotations

import json
import re

import pytest
from answers import defined
from conftest import PYTHON, ROOT, run
from conftest import skeleton as notebook_skeleton

from tutorial.lessons import ddp


# This file's exercise number -> (notebook, heading there): 03 was split in two, each with its own numbering.
EXERCISES = {"### Exercise 1": ("03a_ddp_by_hand", "### Exercise 1"),
             "### Exercise 2": ("03a_ddp_by_hand", "### Exercise 2"),
             "### Exercise 3": ("03b_ddp_trainer", "### Exercise 1"),
             "### Exercise 4": ("03b_ddp_trainer", "### Exercise 2")}


def skeleton(heading: str):
    return notebook_skeleton(*EXERCISES[heading])


EPOCH_ORDERS = """
def epoch_orders(rank, world_size, epochs):
    from torch.utils.data.distributed import DistributedSampler
    orders = []
    {body}
    return orders
"""


def test_exercise_1_set_epoch():
    assert ddp.check_epoch_orders(ddp.solution_epoch_orders).startswith("correct: a new shuffle every epoch")
    verdict = ddp.check_epoch_orders(skeleton("### Exercise 1"))
    assert verdict.startswith("wrong: rank 0 reads") and "set_epoch(epoch)" in verdict


def test_exercise_1_accepts_a_sampler_per_epoch_and_rejects_set_epoch_after_reading():
    per_epoch = defined(EPOCH_ORDERS.format(body="""for epoch in range(epochs):  # seed + 0 == epoch
        orders.append(list(DistributedSampler(range(20), world_size, rank, shuffle=True, seed=epoch)))"""))
    assert ddp.check_epoch_orders(per_epoch).startswith("correct: a new shuffle every epoch")
    late = defined(EPOCH_ORDERS.format(body="""sampler = DistributedSampler(range(20), world_size, rank, seed=0)
    for epoch in range(epochs):
        orders.append(list(sampler))
        sampler.set_epoch(epoch)"""))
    verdict = ddp.check_epoch_orders(late)
    assert verdict.startswith("wrong: rank 0's epoch 1 reads") and "before the epoch" in verdict


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
    verdict = ddp.check_checkpoint(cluster, defined(BARRIER_INSIDE_THE_IF))
    assert verdict.startswith("wrong: rank") and "inside `if rank == 0`" in verdict


def test_exercise_2_accepts_an_atomic_write_of_a_dict_and_names_the_module_prefix(cluster):
    atomic = defined(
        "def save_checkpoint(model, path):\n"
        "    import os, torch, torch.distributed as dist\n"
        "    if dist.get_rank() == 0:\n"
        "        torch.save({'model': model.module.state_dict()}, str(path) + '.tmp')\n"
        "        os.replace(str(path) + '.tmp', path)\n"
        "    dist.barrier()\n")
    assert ddp.check_checkpoint(cluster, atomic).startswith("correct: rank 0 alone")
    wrapped = defined(
        "def save_checkpoint(model, path):\n"
        "    import torch, torch.distributed as dist\n"
        "    if dist.get_rank() == 0:\n"
        "        torch.save(model.state_dict(), path)\n"
        "    dist.barrier()\n")
    assert ddp.check_checkpoint(cluster, wrapped).startswith("wrong: the keys start with 'module.'")


def test_exercise_3_no_sync(cluster):
    assert ddp.check_accumulation(cluster, ddp.solution_accumulate).startswith("correct: one all-reduce for 4")
    verdict = ddp.check_accumulation(cluster, skeleton("### Exercise 3"))
    assert verdict.startswith("wrong: 4 all-reduces for one optimizer step") and "no_sync" in verdict


def test_exercise_3_names_the_forward_outside_no_sync_and_accepts_two_branches(cluster):
    outside = defined(
        "def accumulate(model, optimizer, micro_batches):\n"
        "    import torch.nn.functional as F\n"
        "    optimizer.zero_grad()\n"
        "    for i, (X, y) in enumerate(micro_batches):\n"
        "        loss = F.cross_entropy(model(X), y) / len(micro_batches)\n"
        "        if i < len(micro_batches) - 1:\n"
        "            with model.no_sync():\n"
        "                loss.backward()\n"
        "        else:\n"
        "            loss.backward()\n"
        "    optimizer.step()\n")
    verdict = ddp.check_accumulation(cluster, outside)
    assert verdict.startswith("wrong: 4 all-reduces although you entered no_sync(): every forward ran outside it")
    branches = defined(
        "def accumulate(model, optimizer, micro_batches):\n"
        "    import torch.nn.functional as F\n"
        "    optimizer.zero_grad()\n"
        "    *first, last = micro_batches\n"
        "    with model.no_sync():\n"
        "        for X, y in first:\n"
        "            (F.cross_entropy(model(X), y) / len(micro_batches)).backward()\n"
        "    X, y = last\n"
        "    (F.cross_entropy(model(X), y) / len(micro_batches)).backward()\n"
        "    optimizer.step()\n")
    assert ddp.check_accumulation(cluster, branches).startswith("correct: one all-reduce for 4")


def test_exercise_3_accepts_no_sync_entered_through_an_exit_stack(cluster):
    # no_sync() entered only when needed, through contextlib.ExitStack rather than a with-block or nullcontext,
    # and the loss divided with Tensor.div: the same single all-reduce and the same step.
    stack = defined(
        "def accumulate(model, optimizer, micro_batches):\n"
        "    import contextlib\n"
        "    import torch.nn.functional as F\n"
        "    optimizer.zero_grad()\n"
        "    for i, (X, y) in enumerate(micro_batches):\n"
        "        with contextlib.ExitStack() as stack:\n"
        "            if i < len(micro_batches) - 1:\n"
        "                stack.enter_context(model.no_sync())\n"
        "            F.cross_entropy(model(X), y).div(len(micro_batches)).backward()\n"
        "    optimizer.step()\n")
    assert ddp.check_accumulation(cluster, stack).startswith("correct: one all-reduce for 4")


def test_exercise_4_metrics_averaged(cluster):
    correct = "correct: every rank reports 2, the mean over all 6 samples"
    assert ddp.check_epoch_loss(cluster, ddp.solution_epoch_loss) == correct
    verdict = ddp.check_epoch_loss(cluster, skeleton("### Exercise 4"))
    assert verdict.startswith("wrong: every rank reports 2.25, the mean of the ranks' means") and "counts" in verdict


def test_exercise_4_accepts_two_all_reduces_and_names_the_local_count(cluster):
    two = defined(
        "def epoch_loss(loss_sum, count):\n"
        "    import torch, torch.distributed as dist\n"
        "    s, n = torch.tensor(float(loss_sum)), torch.tensor(float(count))\n"
        "    dist.all_reduce(s, op=dist.ReduceOp.SUM)\n"
        "    dist.all_reduce(n, op=dist.ReduceOp.SUM)\n"
        "    return (s / n).item()\n")
    assert ddp.check_epoch_loss(cluster, two) == "correct: every rank reports 2, the mean over all 6 samples"
    local_count = defined(
        "def epoch_loss(loss_sum, count):\n"
        "    import torch, torch.distributed as dist\n"
        "    s = torch.tensor([loss_sum])\n"
        "    dist.all_reduce(s)\n"
        "    return (s / count).item()\n")
    verdict = ddp.check_epoch_loss(cluster, local_count)
    assert verdict.startswith("wrong: the ranks report 3, 6: the loss sum is summed over the ranks"), verdict


# ------------------------------------------------------------------------------------------------------ capstone
SOLUTION = ROOT / "examples/ddp_standalone.py"  # the capstone's solution is the standalone DDP example


@pytest.fixture(scope="module")
def capstone_run(ddp_standalone_run):
    """The solution launched as the notebook launches the learner's copy (conftest's one launch of it): its
    result.json is valid for every variant below, which differ only in what result.json cannot show (the checker
    launches each again)."""
    return ddp_standalone_run


def variant(tmp_path, old: str, new: str):
    text = SOLUTION.read_text()
    assert re.search(old, text), old
    path = tmp_path / "train_ddp.py"
    path.write_text(re.sub(old, new, text, count=1))
    return path


def test_capstone_accepts_the_solution_and_rejects_the_plain_script(capstone_run, tmp_path):
    assert ddp.check_capstone(capstone_run, script=SOLUTION).startswith("correct: 2 ranks, identical replicas")
    run([PYTHON, ROOT / "notebooks/capstone/train_plain.py", "--epochs", "1", "--out", tmp_path / "plain"])
    assert json.loads((tmp_path / "plain/result.json").read_text())["world_size"] == 1
    assert ddp.check_capstone(tmp_path / "plain").startswith("wrong: result.json says world size 1")


def test_capstone_names_a_missing_set_epoch(capstone_run, tmp_path):
    script = variant(tmp_path, r"\n *sampler\.set_epoch\(epoch\).*", "")
    verdict = ddp.check_capstone(capstone_run, script=script)
    assert verdict.startswith("wrong: rank 0 read its samples in the same order in all 2 epochs"), verdict


def test_capstone_names_every_rank_writing(capstone_run, tmp_path):
    script = variant(tmp_path, r"if rank == 0:  # DDP: rank 0 alone writes.*", "if True:")
    verdict = ddp.check_capstone(capstone_run, script=script)
    assert verdict.startswith("wrong: ranks 0, 1 wrote model.pt or result.json"), verdict


def test_capstone_names_an_unscaled_learning_rate(capstone_run, tmp_path):
    script = variant(tmp_path, r"lr=args\.lr \* world_size", "lr=args.lr")
    verdict = ddp.check_capstone(capstone_run, script=script)
    assert verdict.startswith("wrong: the optimizer's learning rate is 0.05, the single process's"), verdict


def test_capstone_accepts_an_lr_scaled_after_construction_and_a_pathlib_write(capstone_run, tmp_path):
    text = SOLUTION.read_text()
    text = text.replace("lr=args.lr * world_size, momentum=0.9)", "lr=args.lr, momentum=0.9)\n"
                        "    for group in optimizer.param_groups:\n        group['lr'] *= dist.get_world_size()")
    text = text.replace('with open(os.path.join(args.out, "result.json"), "w") as f:\n'
                        '            json.dump(result, f, indent=1)',
                        'import pathlib\n        pathlib.Path(args.out, "result.json").write_text(json.dumps(result))')
    assert "group['lr']" in text and "write_text" in text
    script = tmp_path / "train_ddp.py"
    script.write_text(text)
    assert ddp.check_capstone(capstone_run, script=script).startswith("correct: 2 ranks, identical replicas")


def test_capstone_knows_the_plain_scripts_learning_rate():
    assert re.search(r'"--lr", type=float, default=([\d.]+)', (ROOT / "notebooks/capstone/train_plain.py")
                     .read_text()).group(1) == str(ddp.PLAIN_LR)

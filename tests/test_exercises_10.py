"""10_when_things_go_wrong's exercises: each checker accepts the package's solution and another correct answer, and
rejects the notebook's unedited skeleton and other plausible mistakes (a reduce to rank 0 only, all_gather_object,
an error other than a collective's, a model left without DDP, batches cut to the shortest rank's), with a verdict
rather than a traceback."""
from __future__ import annotations

import pytest
from answers import defined
from conftest import skeleton as notebook_skeleton

from tutorial.lessons import failures as lesson


def skeleton(heading: str):
    return notebook_skeleton("10_when_things_go_wrong", heading)


def test_exercise_1_the_collective_on_every_rank(cluster):
    assert lesson.check_mean_loss(cluster, lesson.solution_mean_loss) == "correct: every rank got the mean loss 1.5"
    verdict = lesson.check_mean_loss(cluster, skeleton("### Exercise 1"))
    assert verdict.startswith("wrong: rank 0 failed in a collective") and "call it on every rank" in verdict


def test_exercise_1_accepts_a_sum_divided_on_every_rank_and_names_a_reduce_to_rank_0(cluster):
    other = defined(
        "def mean_loss(loss):\n"
        "    import torch, torch.distributed as dist\n"
        "    t = torch.tensor(loss, dtype=torch.float64)\n"
        "    dist.all_reduce(t, op=dist.ReduceOp.SUM)\n"
        "    mean = float(t) / dist.get_world_size()\n"
        "    print(f'mean loss {mean:.3f}') if dist.get_rank() == 0 else None\n"
        "    return mean\n")
    assert lesson.check_mean_loss(cluster, other) == "correct: every rank got the mean loss 1.5"
    reduce_to_0 = defined(
        "def mean_loss(loss):\n"
        "    import torch, torch.distributed as dist\n"
        "    t = torch.tensor([loss])\n"
        "    dist.reduce(t, dst=0)\n"
        "    return t.item() / dist.get_world_size()\n")
    assert lesson.check_mean_loss(cluster, reduce_to_0).startswith("wrong: rank 1 returned 1.0; every rank should get")


def test_exercise_2_unequal_lengths(cluster):
    assert lesson.check_gather(cluster, lesson.solution_gather_all).startswith("correct: every rank has all 5")
    verdict = lesson.check_gather(cluster, skeleton("### Exercise 2"))
    assert verdict.startswith("wrong: rank 0: RuntimeError") and "gather the sizes first" in verdict, verdict


def test_exercise_2_names_all_gather_object(cluster):
    pickled = defined(
        "def gather_all(preds):\n"
        "    import torch, torch.distributed as dist\n"
        "    pieces = [None] * dist.get_world_size()\n"
        "    dist.all_gather_object(pieces, preds)\n"
        "    return torch.cat(pieces)\n")
    verdict = lesson.check_gather(cluster, pickled)
    assert verdict.startswith("wrong: rank 0 called dist.all_gather_object, which pickles the tensor"), verdict


def test_exercise_2_reports_any_error_of_the_learners_code(cluster):
    typo = defined(
        "def gather_all(preds):\n"
        "    import torch\n"
        "    return torch.cat(preds.tolist())\n")
    verdict = lesson.check_gather(cluster, typo)
    assert verdict.startswith("wrong: rank 0: TypeError") and "before any collective" in verdict, verdict


def test_exercise_2_accepts_a_sum_of_placed_pieces(cluster):
    placed = defined(
        "def gather_all(preds):\n"
        "    import torch, torch.distributed as dist\n"
        "    sizes = torch.zeros(dist.get_world_size(), dtype=torch.long)\n"
        "    sizes[dist.get_rank()] = len(preds)\n"
        "    dist.all_reduce(sizes)  # every rank's length, on every rank\n"
        "    start = int(sizes[:dist.get_rank()].sum())\n"
        "    out = preds.new_zeros(int(sizes.sum()))\n"
        "    out[start:start + len(preds)] = preds  # this rank's piece in its place, zeros elsewhere\n"
        "    dist.all_reduce(out)\n"
        "    return out\n")
    assert lesson.check_gather(cluster, placed).startswith("correct: every rank has all 5")


def test_exercise_3_unused_parameter(cluster):
    # the package's solution removes the unused layer, the fix the notebook calls best
    assert lesson.check_unused(cluster, lesson.solution_wrap) == \
        "correct: 3 steps on every rank, weights equal to one process on all batches (without spare)"
    verdict = lesson.check_unused(cluster, skeleton("### Exercise 3"))
    assert verdict.startswith("wrong: rank 0 stopped at the second step with \"Expected to have finished reduction"), \
        verdict
    assert "find_unused_parameters=True" in verdict and "remove the layer" in verdict


CORRECT_WRAPS = {
    "find_unused_parameters": (
        "def wrap(model):\n"
        "    from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "    return DDP(model, find_unused_parameters=True)\n"),
    "static_graph": (
        "def wrap(model):\n"
        "    import torch\n"
        "    return torch.nn.parallel.DistributedDataParallel(model, static_graph=True)\n"),
    "remove_it_with_delattr": (  # written differently from the solution's `del model.spare`
        "def wrap(model):\n"
        "    import torch.nn.parallel as parallel\n"
        "    delattr(model, 'spare')\n"
        "    return parallel.DistributedDataParallel(model)\n"),
    "freeze_it": (  # DDP leaves parameters that need no gradient out of its buckets
        "def wrap(model):\n"
        "    from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "    model.spare.requires_grad_(False)\n"
        "    return DDP(model)\n"),
    "use_it_with_no_effect": (  # spare takes part in the graph with a zero weight: its gradient is 0, not missing
        "def wrap(model):\n"
        "    import torch\n"
        "    from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "    def forward(x):\n"
        "        h = torch.relu(model.body(x))\n"
        "        return model.head(h) + 0 * model.spare(h)\n"
        "    model.forward = forward\n"
        "    return DDP(model)\n"),
}


@pytest.mark.parametrize("name", sorted(CORRECT_WRAPS))
def test_exercise_3_accepts_every_correct_fix(cluster, name):
    verdict = lesson.check_unused(cluster, defined(CORRECT_WRAPS[name]))
    assert verdict.startswith("correct: 3 steps on every rank, weights equal to one process on all batches"), verdict
    kept = "(without spare)" if name.startswith("remove") else "(spare unchanged)"
    assert verdict.endswith(kept), verdict


def test_exercise_3_names_a_model_left_unwrapped_a_changed_output_and_a_used_layer_removed(cluster):
    unwrapped = defined(  # no DDP error any more, because nothing is averaged: each rank trains its own model
        "def wrap(model):\n"
        "    return model\n")
    verdict = lesson.check_unused(cluster, unwrapped)
    assert verdict.startswith("wrong: rank 0's body.weight differs from one process") and "wrapped in DDP" in verdict
    adds_spare = defined(  # no error either: spare now gets a gradient, but the model computes something else
        "def wrap(model):\n"
        "    import torch\n"
        "    from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "    hidden = lambda x: torch.relu(model.body(x))\n"
        "    model.forward = lambda x: model.head(hidden(x)) + model.spare(hidden(x))\n"
        "    return DDP(model)\n")
    assert lesson.check_unused(cluster, adds_spare).startswith("wrong: rank 0: the model's output changed")
    head_removed = defined(  # the wrong layer: the forward fails before any collective
        "def wrap(model):\n"
        "    from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "    del model.head\n"
        "    return DDP(model, find_unused_parameters=True)\n")
    assert lesson.check_unused(cluster, head_removed).startswith("wrong: rank 0 raised AttributeError")


def test_exercise_4_uneven_inputs(cluster):
    assert lesson.check_uneven(cluster, lesson.solution_train) == \
        "correct: the ranks trained on [3, 5] batches, no hang, identical replicas"
    verdict = lesson.check_uneven(cluster, skeleton("### Exercise 4"))
    assert verdict.startswith("wrong: rank 1 failed in a collective: the ranks have [3, 5] batches"), verdict
    assert "Join([model])" in verdict


def test_exercise_4_accepts_ddp_join_and_names_batches_cut_to_the_shortest_rank(cluster):
    ddp_join = defined(  # DDP's own context manager, the older spelling of Join([model])
        "def train(model, batches):\n"
        "    import torch\n"
        "    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)\n"
        "    with model.join():\n"
        "        for x, y in batches:\n"
        "            loss = ((model(x) - y) ** 2).mean()\n"
        "            optimizer.zero_grad()\n"
        "            loss.backward()\n"
        "            optimizer.step()\n")
    assert lesson.check_uneven(cluster, ddp_join).startswith("correct: the ranks trained on [3, 5] batches")
    shortest = defined(  # no hang, but rank 1 throws 2 batches away
        "def train(model, batches):\n"
        "    import torch, torch.distributed as dist\n"
        "    n = torch.tensor(len(batches))\n"
        "    dist.all_reduce(n, op=dist.ReduceOp.MIN)\n"
        "    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    for x, y in batches[:int(n)]:\n"
        "        optimizer.zero_grad()\n"
        "        torch.nn.functional.mse_loss(model(x), y).backward()\n"
        "        optimizer.step()\n")
    verdict = lesson.check_uneven(cluster, shortest)
    assert verdict.startswith("wrong: rank 1 trained on 3 of its 5 batches"), verdict

"""10_when_things_go_wrong's exercises: each checker accepts the package's solution and another correct answer, and
rejects the notebook's unedited skeleton and other plausible mistakes (a reduce to rank 0 only, all_gather_object,
an error other than a collective's), with a verdict rather than a traceback."""
from __future__ import annotations

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

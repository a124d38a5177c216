"""00_setup's exercise: the checker accepts the package's solution and another correct one, and rejects the
notebook's unedited skeleton and the other plausible mistakes, each with a verdict that names it."""
from answers import defined
from conftest import skeleton

from tutorial.lessons import setup


def test_exercise_1_all_reduce_works_in_place(cluster):
    assert setup.check_mean_over_ranks(cluster, setup.solution_mean_over_ranks) == "correct: every rank got the mean 1.5"
    verdict = setup.check_mean_over_ranks(cluster, skeleton("00_setup", "### Exercise 1"))
    assert verdict.startswith("wrong: rank 0 raised AttributeError") and "returns None" in verdict


def test_exercise_1_accepts_a_copy_reduced_with_an_explicit_sum(cluster):
    other = defined(
        "def mean_over_ranks(value):\n"
        "    import torch, torch.distributed as dist\n"
        "    total = torch.tensor(value, dtype=torch.float64)\n"
        "    dist.all_reduce(total, op=dist.ReduceOp.SUM)\n"
        "    return float(total / dist.get_world_size())\n")
    assert setup.check_mean_over_ranks(cluster, other) == "correct: every rank got the mean 1.5"


def test_exercise_1_accepts_the_division_written_in_place_or_as_a_product(cluster):
    # The same mean, written as learners write it after the all-reduce: divided in place, or multiplied by 1/n
    # into a new tensor, and read with float() instead of .item().
    for divide in ("    t /= dist.get_world_size()\n", "    t = t * (1 / dist.get_world_size())\n"):
        other = defined(
            "def mean_over_ranks(value):\n"
            "    import torch, torch.distributed as dist\n"
            "    t = torch.tensor([float(value)])\n"
            "    dist.all_reduce(t)\n"
            + divide +
            "    return float(t)\n")
        assert setup.check_mean_over_ranks(cluster, other) == "correct: every rank got the mean 1.5", divide


def test_exercise_1_names_the_sum(cluster):
    the_sum = defined(
        "def mean_over_ranks(value):\n"
        "    import torch, torch.distributed as dist\n"
        "    t = torch.tensor([value])\n"
        "    dist.all_reduce(t)\n"
        "    return t.item()\n")
    assert setup.check_mean_over_ranks(cluster, the_sum) == \
        "wrong: rank 0 returned 3.0, the mean is 1.5 (that is the sum: divide by dist.get_world_size())"


def test_exercise_1_avg_is_right_where_gloo_has_it_and_explained_where_not(cluster):
    avg = defined(
        "def mean_over_ranks(value):\n"
        "    import torch, torch.distributed as dist\n"
        "    t = torch.tensor([value])\n"
        "    dist.all_reduce(t, op=dist.ReduceOp.AVG)\n"
        "    return t.item()\n")
    verdict = setup.check_mean_over_ranks(cluster, avg)  # gloo averages in recent torch, older ones refuse
    assert verdict == "correct: every rank got the mean 1.5" or "has no ReduceOp.AVG" in verdict, verdict


def test_ring_allreduce_ends_with_the_sum_on_every_rank():
    values = [[10 * r + c for c in range(5)] for r in range(5)]
    states = setup.ring_allreduce(values)
    assert len(states) == 1 + 2 * 4
    assert all(row == [sum(v[c] for v in values) for c in range(5)] for row in states[-1]["values"])
    assert all(s == [5] * 5 for s in states[-1]["summed"])

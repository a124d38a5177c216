"""00_setup's exercise: the checker accepts the package's solution and rejects the notebook's unedited skeleton."""
from conftest import skeleton



def test_exercise_1_all_reduce_works_in_place(cluster):
    from tutorial.lessons import setup
    assert setup.check_mean_over_ranks(cluster, setup.solution_mean_over_ranks) == "correct: every rank got the mean 1.5"
    verdict = setup.check_mean_over_ranks(cluster, skeleton("00_setup", "### Exercise 1"))
    assert verdict.startswith("wrong: rank 0 raised AttributeError") and "returns None" in verdict


def test_ring_allreduce_ends_with_the_sum_on_every_rank():
    from tutorial.lessons import setup
    values = [[10 * r + c for c in range(5)] for r in range(5)]
    states = setup.ring_allreduce(values)
    assert len(states) == 1 + 2 * 4
    assert all(row == [sum(v[c] for v in values) for c in range(5)] for row in states[-1]["values"])
    assert all(s == [5] * 5 for s in states[-1]["summed"])

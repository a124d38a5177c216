"""05_horovod's exercises: each checker accepts the package's solution and rejects the notebook's unedited skeleton
with the specific mistake, on two MPI engines (Horovod finds its ranks through MPI)."""
import pytest

from answers import defined
from conftest import skeleton as notebook_skeleton

pytest.importorskip("horovod.torch")


def skeleton(heading: str):
    return notebook_skeleton("05_horovod", heading)


@pytest.fixture(scope="module")
def cluster():
    from tutorial.launch import engines
    with engines.start(n=2, engines="mpi", device="cpu", show=False) as c:
        yield c


def test_exercise_1_checker_accepts_the_solution_and_names_the_missing_broadcast_and_lr(cluster):
    from tutorial.lessons import horovod as lesson
    verdict = lesson.check_prepare(cluster, lesson.solution_prepare)
    assert verdict.startswith("correct: lr 0.2 for 2 ranks"), verdict
    verdict = lesson.check_prepare(cluster, skeleton("### Exercise 1"))
    assert verdict.startswith("wrong: ") and "hvd.broadcast_parameters" in verdict and "replicas differ" in verdict
    assert "learning rate is 0.1, not 0.1 x hvd.size() = 0.2" in verdict


def test_exercise_1_checker_names_a_plain_optimizer(cluster):
    from tutorial.lessons import horovod as lesson
    verdict = lesson.check_prepare(cluster, defined("def prepare(model, optimizer):\n    return optimizer\n"))
    assert verdict.startswith("wrong: prepare returned a SGD, not hvd.DistributedOptimizer"), verdict


def test_exercise_2_checker_accepts_the_solution_and_names_the_unaveraged_metric(cluster):
    from tutorial.lessons import horovod as lesson
    assert lesson.check_test_accuracy(cluster, lesson.solution_test_accuracy) == \
        "correct: every rank got the test set's accuracy 0.6400"
    verdict = lesson.check_test_accuracy(cluster, skeleton("### Exercise 2"))
    assert verdict.startswith("wrong: every rank returned its own shard's accuracy (rank 0: 0.9000, rank 1: 0.4667)")
    assert "op=hvd.Sum" in verdict


def test_exercise_2_checker_names_the_mean_of_the_shards(cluster):
    from tutorial.lessons import horovod as lesson
    mean_of_accuracies = defined(
        "def test_accuracy(correct, total):\n"
        "    import horovod.torch as hvd\n"
        "    import torch\n"
        "    return hvd.allreduce(torch.tensor(correct / total), name='mean_accuracy').item()\n")
    verdict = lesson.check_test_accuracy(cluster, mean_of_accuracies)
    assert verdict.startswith("wrong: every rank returned 0.6833, the mean of the shards' accuracies"), verdict


def test_exercise_1_accepts_broadcast_first_and_names_the_unscaled_lr(cluster):
    from tutorial.lessons import horovod as lesson
    broadcast_first = defined(
        "def prepare(model, optimizer):\n"
        "    import horovod.torch as hvd\n"
        "    hvd.broadcast_parameters(model.state_dict(), root_rank=0)\n"
        "    optimizer.param_groups[0]['lr'] = optimizer.param_groups[0]['lr'] * hvd.size()\n"
        "    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())\n"
        "    hvd.broadcast_optimizer_state(optimizer, root_rank=0)\n"
        "    return optimizer\n")
    assert lesson.check_prepare(cluster, broadcast_first).startswith("correct: lr 0.2 for 2 ranks")
    unscaled = defined(
        "def prepare(model, optimizer):\n"
        "    import horovod.torch as hvd\n"
        "    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())\n"
        "    hvd.broadcast_parameters(model.state_dict(), root_rank=0)\n"
        "    return optimizer\n")
    assert lesson.check_prepare(cluster, unscaled) == \
        ("wrong: the learning rate is 0.1, not 0.1 x hvd.size() = 0.2: the global batch is 2 times larger, so is the "
         "step (step 3)")


def test_exercise_2_accepts_two_sums(cluster):
    from tutorial.lessons import horovod as lesson
    two_sums = defined(
        "def test_accuracy(correct, total):\n"
        "    import horovod.torch as hvd, torch\n"
        "    c = hvd.allreduce(torch.tensor(float(correct)), op=hvd.Sum, name='c')\n"
        "    t = hvd.allreduce(torch.tensor(float(total)), op=hvd.Sum, name='t')\n"
        "    return float(c / t)\n")
    assert lesson.check_test_accuracy(cluster, two_sums) == "correct: every rank got the test set's accuracy 0.6400"

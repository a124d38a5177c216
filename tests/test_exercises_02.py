"""02_data_parallel's exercises: each checker accepts the package's solution and rejects the unedited skeleton,
naming the mistake (replica gradients of per-slice mean losses summed; a DataParallel state_dict with 'module.')."""
from __future__ import annotations

import torch
from conftest import skeleton

from tutorial.lessons import data_parallel as lesson


def test_exercise_1_replica_gradients_are_weighted_by_slice():
    assert lesson.check_replica_gradient(lesson.solution_data_parallel_gradient).startswith("correct:")
    verdict = lesson.check_replica_gradient(skeleton("02_data_parallel", "### Exercise 1"))
    assert verdict.startswith("wrong: the gradient is 2.9") and "counts the batch 3 times" in verdict


def test_exercise_1_names_the_uneven_slices_when_the_sum_is_divided_by_the_replicas():
    wrong = skeleton("02_data_parallel", "### Exercise 1")
    verdict = lesson.check_replica_gradient(lambda model, X, y, replicas=3: wrong(model, X, y, replicas) / replicas)
    assert verdict.startswith("wrong: off by up to") and "10-sample slice" in verdict


def test_exercise_1_checks_against_a_batchnorm_free_model():
    model, X, y = lesson._exercise_problem()
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert [len(x) for x in X.chunk(3)] == [11, 11, 10]


def test_exercise_2_a_dataparallel_state_dict_needs_module():
    assert lesson.check_train_and_save(lesson.solution_train_and_save).startswith("correct: a plain model loads")
    verdict = lesson.check_train_and_save(skeleton("02_data_parallel", "### Exercise 2"))
    assert verdict.startswith("wrong: the saved keys are ['module.0.weight'") and "dp_model.module.state_dict()" in verdict


def test_the_picture_draws_one_box_per_replica_and_stage():
    import matplotlib
    matplotlib.use("Agg")
    fig = lesson.draw_dp_step([11, 11, 10])
    assert "batch of 32 over 3 GPUs" in fig.axes[0].get_title()


def test_exercise_1_accepts_summed_losses_divided_by_the_batch():
    from answers import defined
    other = defined(
        "def data_parallel_gradient(model, X, y, replicas=3):\n"
        "    import copy, torch, torch.nn.functional as F\n"
        "    grads = []\n"
        "    for xs, ys in zip(X.chunk(replicas), y.chunk(replicas)):\n"
        "        replica = copy.deepcopy(model)\n"
        "        (F.cross_entropy(replica(xs), ys, reduction='sum') / len(X)).backward()\n"
        "        grads.append(torch.cat([p.grad.flatten() for p in replica.parameters()]))\n"
        "    return torch.stack(grads).sum(0)\n")
    assert lesson.check_replica_gradient(other).startswith("correct:")


def test_exercise_2_accepts_stripped_keys_and_rejects_a_pickled_model_or_untrained_weights():
    from answers import defined
    save = ("def train_and_save(model, X, y, path):\n"
            "    import torch, torch.nn.functional as F\n"
            "    dp_model = torch.nn.DataParallel(model)\n"
            "    optimizer = torch.optim.SGD(dp_model.parameters(), lr=0.1)\n"
            "    {before}\n"
            "    F.cross_entropy(dp_model(X), y).backward()\n"
            "    optimizer.step()\n"
            "    {after}\n")
    stripped = "torch.save({k.removeprefix('module.'): v for k, v in dp_model.state_dict().items()}, path)"
    assert lesson.check_train_and_save(defined(save.format(before="", after=stripped))).startswith("correct:")
    pickled = defined(save.format(before="", after="torch.save(dp_model.module, path)"))
    assert lesson.check_train_and_save(pickled).startswith("wrong: the file is not a state_dict of tensors")
    early = defined(save.format(before="torch.save(model.state_dict(), path)", after=""))
    assert lesson.check_train_and_save(early) == "wrong: the file loads, but holds other weights than the trained model's"

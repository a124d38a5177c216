"""01_single_device's exercises: each checker accepts the package's solution and another correct answer, and
rejects the notebook's unedited skeleton and another plausible mistake, naming it."""
from answers import defined
from conftest import skeleton

from tutorial.lessons import single_device as lesson


def test_exercise_1_names_the_missing_zero_grad():
    assert lesson.check_train(lesson.solution_train) == "correct: the same weights as the reference after 5 steps"
    verdict = lesson.check_train(skeleton("01_single_device", "### Exercise 1"))
    assert verdict.startswith("wrong: every step used the sum of all gradients") and "zero_grad()" in verdict


def test_exercise_1_accepts_zero_grad_after_the_step_and_rejects_it_between_backward_and_step():
    after = defined(
        "def train(model, optimizer, batches):\n"
        "    import torch.nn.functional as F\n"
        "    losses = []\n"
        "    for X, y in batches:\n"
        "        loss = F.cross_entropy(model(X), y)\n"
        "        loss.backward()\n"
        "        optimizer.step()\n"
        "        model.zero_grad(set_to_none=True)\n"
        "        losses.append(float(loss))\n"
        "    return losses\n")
    assert lesson.check_train(after) == "correct: the same weights as the reference after 5 steps"
    too_late = defined(
        "def train(model, optimizer, batches):\n"
        "    import torch.nn.functional as F\n"
        "    losses = []\n"
        "    for X, y in batches:\n"
        "        loss = F.cross_entropy(model(X), y)\n"
        "        loss.backward()\n"
        "        optimizer.zero_grad()\n"
        "        optimizer.step()\n"
        "        losses.append(loss.item())\n"
        "    return losses\n")
    assert lesson.check_train(too_late).startswith("wrong: the weights differ from the reference")


def test_exercise_2_names_the_missing_prof_step():
    assert lesson.check_profile_phases(lesson.solution_profile_phases).startswith("correct: forward, backward")
    verdict = lesson.check_profile_phases(skeleton("01_single_device", "### Exercise 2"))
    assert verdict.startswith("wrong: the profiler recorded nothing") and "prof.step()" in verdict


PROFILE = """
def profile_phases(model, optimizer, batches):
    import torch.nn.functional as F
    from torch.profiler import profile, record_function, schedule
    with profile(schedule=schedule(wait=1, warmup=1, active=3)) as prof:
        for X, y in batches:
            {first}
            with record_function("forward"):
                loss = F.cross_entropy(model(X), y)
            with record_function("backward"):
                optimizer.zero_grad()
                loss.backward()
            with record_function("optimizer"):
                optimizer.step()
            {last}
    return prof
"""


def test_exercise_2_accepts_prof_step_first_and_rejects_two_per_step():
    first = defined(PROFILE.format(first="prof.step()", last=""))
    assert lesson.check_profile_phases(first).startswith("correct: forward, backward")
    twice = defined(PROFILE.format(first="prof.step()", last="prof.step()"))
    assert lesson.check_profile_phases(twice).startswith("wrong: recorded {")


def test_exercise_3_finds_the_loader_bottleneck():
    assert lesson.check_feed(lesson.solution_feed).startswith("correct: 'data' took only")
    verdict = lesson.check_feed(skeleton("01_single_device", "### Exercise 3"))
    assert verdict.startswith("wrong: 'data' took") and "num_workers=2" in verdict


FEED = """
def feed(dataset, step, steps=10):
    from torch.profiler import profile, record_function
    from torch.utils.data import DataLoader
    loader = DataLoader(dataset, {loader})
    batches = iter(loader)
    next(batches)
    with profile() as prof:
        for _ in range(steps):
            with record_function("data"):
                X, y = next(batches)
            with record_function("compute"):
                step(X, y)
    return prof
"""


def test_exercise_3_accepts_more_workers_and_rejects_a_smaller_batch():
    more = defined(FEED.format(loader="batch_size=32, shuffle=True, num_workers=2, prefetch_factor=4, "
                                      "persistent_workers=True"))
    assert lesson.check_feed(more).startswith("correct: 'data' took only")
    smaller = defined(FEED.format(loader="batch_size=8, shuffle=True"))
    verdict = lesson.check_feed(smaller)
    assert verdict.startswith("wrong: the model got batches of [8] samples, not 32") and "num_workers" in verdict


def test_slow_dataset_waits_and_returns_the_sample():
    import time
    data = lesson.SlowDataset([(1, 2), (3, 4)], cost_ms=20)
    start = time.perf_counter()
    assert data[1] == (3, 4) and len(data) == 2
    assert time.perf_counter() - start >= 0.02

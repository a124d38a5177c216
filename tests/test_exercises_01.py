"""01_single_device's exercises: each checker accepts the package's solution and rejects the notebook's unedited
skeleton with the specific mistake named."""
from conftest import skeleton

from tutorial.lessons import single_device as lesson


def test_exercise_1_names_the_missing_zero_grad():
    assert lesson.check_train(lesson.solution_train) == "correct: the same weights as the reference after 5 steps"
    verdict = lesson.check_train(skeleton("01_single_device", "### Exercise 1"))
    assert verdict.startswith("wrong: every step used the sum of all gradients") and "zero_grad()" in verdict


def test_exercise_2_names_the_missing_prof_step():
    assert lesson.check_profile_phases(lesson.solution_profile_phases).startswith("correct: forward, backward")
    verdict = lesson.check_profile_phases(skeleton("01_single_device", "### Exercise 2"))
    assert verdict.startswith("wrong: the profiler recorded nothing") and "prof.step()" in verdict


def test_exercise_3_finds_the_loader_bottleneck():
    assert lesson.check_feed(lesson.solution_feed).startswith("correct: 'data' took only")
    verdict = lesson.check_feed(skeleton("01_single_device", "### Exercise 3"))
    assert verdict.startswith("wrong: 'data' took") and "num_workers=2" in verdict


def test_slow_dataset_waits_and_returns_the_sample():
    import time
    data = lesson.SlowDataset([(1, 2), (3, 4)], cost_ms=20)
    start = time.perf_counter()
    assert data[1] == (3, 4) and len(data) == 2
    assert time.perf_counter() - start >= 0.02

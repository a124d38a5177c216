"""04_mixed_precision's exercises: each checker accepts the package's solution and rejects the unedited skeleton,
naming the mistake (clipping scaled gradients; fp16 gradients underflowing without a GradScaler)."""
from __future__ import annotations

from conftest import skeleton

from tutorial.lessons import mixed_precision as lesson


def test_exercise_1_clipping_needs_unscale_first():
    assert lesson.check_clipping(lesson.solution_clipped_step).startswith("correct: the true gradient norm 0.32")
    verdict = lesson.check_clipping(skeleton("04_mixed_precision", "### Exercise 1"))
    assert verdict.startswith("wrong: the optimizer got a gradient of norm") and "65,536x too small" in verdict
    assert "scaler.unscale_(optimizer) before clipping" in verdict


def test_exercise_2_fp16_without_loss_scaling_loses_the_gradients():
    assert lesson.check_fp16_step(lesson.solution_fp16_step).startswith("correct: the optimizer got the fp32 gradient")
    verdict = lesson.check_fp16_step(skeleton("04_mixed_precision", "### Exercise 2"))
    assert verdict.startswith("wrong: 100% of the gradients were zero") and "scaler.scale(loss).backward()" in verdict

"""04_mixed_precision's exercises: each checker accepts the package's solution and rejects the unedited skeleton,
naming the mistake (clipping scaled gradients; fp16 gradients underflowing without a GradScaler). Both are fp16 steps,
the precision that needs the scaler."""
from __future__ import annotations

import inspect

import pytest
import torch
from conftest import exercise_cell, skeleton

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


STEP = """
import torch
import torch.nn.functional as F
def {name}(model, optimizer, scaler, X, y, max_norm=1.0):
    with {autocast}:
        loss = F.cross_entropy(model(X), y)
{body}
"""


def answer(name: str, body: str, autocast: str = "torch.autocast(X.device.type, dtype=torch.float16)"):
    from answers import defined
    return defined(STEP.format(name=name, autocast=autocast, body=body), name)


def test_exercise_1_accepts_clipping_the_scaled_norm_and_names_an_unclipped_step():
    scaled_norm = answer("clipped_step", """
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()""")
    assert lesson.check_clipping(scaled_norm).startswith("correct: the true gradient norm 0.32")
    unclipped = answer("clipped_step", """
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()""")
    assert lesson.check_clipping(unclipped).startswith("wrong: the optimizer got a gradient of norm 0.32")


def test_exercise_1_is_the_fp16_step_and_names_bf16_with_a_scaler():
    """04's prose: bf16 needs no GradScaler. The exercise is the fp16 step (review 5, N6: it taught bf16 with an
    active scaler); the package's solution passes, and the same step in bf16 is named, not accepted."""
    solution = inspect.getsource(lesson.solution_clipped_step)
    assert "dtype=torch.float16" in solution and "bfloat16" not in solution
    assert "dtype=torch.float16" in exercise_cell("04_mixed_precision", "### Exercise 1")
    in_bf16 = answer("clipped_step", """
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()""", autocast="torch.autocast(X.device.type, dtype=torch.bfloat16)")
    verdict = lesson.check_clipping(in_bf16)
    assert verdict.startswith("wrong: the forward ran in bfloat16, not fp16") and "bf16 needs none" in verdict


def test_exercise_2_accepts_an_explicit_unscale_and_rejects_dropping_fp16():
    explicit = answer("fp16_step", """
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)""", autocast="torch.amp.autocast(device_type='cpu', dtype=torch.half)")
    assert lesson.check_fp16_step(explicit).startswith("correct: the optimizer got the fp32 gradient")
    plain = """
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()"""
    for autocast, dtype in (("torch.autocast(X.device.type, dtype=torch.bfloat16)", "bfloat16"),
                            ("torch.autocast(X.device.type, enabled=False)", "float32")):
        verdict = lesson.check_fp16_step(answer("fp16_step", plain, autocast=autocast))
        assert verdict.startswith(f"wrong: the forward ran in {dtype}, not fp16"), verdict


def test_exercise_2_names_scaled_gradients_reaching_the_optimizer():
    no_scaler_step = answer("fp16_step", """
    scaler.scale(loss).backward()
    optimizer.step()
    optimizer.zero_grad()""")
    assert lesson.check_fp16_step(no_scaler_step).startswith("wrong: the gradient is")
    update_without_step = answer("fp16_step", """
    scaler.scale(loss).backward()
    optimizer.step()
    scaler.update()""")
    verdict = lesson.check_fp16_step(update_without_step)
    assert verdict.startswith("wrong: it raised AssertionError") and "call it instead of optimizer.step()" in verdict


def test_round_mantissa_is_bf16_at_7_bits_and_fp16_at_10_within_fp16_range():
    """The TF32 emulation of 04: rounding to 7 bits must equal PyTorch's own bf16 rounding and to 10 bits fp16's (for
    values inside fp16's normal range, where only the mantissa differs); truncating instead of rounding fails this."""
    torch.manual_seed(0)
    x = torch.randn(10_000)
    assert torch.equal(lesson.round_mantissa(x, 7), x.bfloat16().float())
    assert torch.equal(lesson.round_mantissa(x[x.abs() > 1e-4], 10), x[x.abs() > 1e-4].half().float())
    assert torch.equal(lesson.round_mantissa(x, 23), x)
    truncated = (x.view(torch.int32) & ~((1 << 13) - 1)).view(torch.float32)  # the negative control
    assert not torch.equal(truncated, x.half().float())
    with pytest.raises(ValueError, match="bits must be 1 to 23"):
        lesson.round_mantissa(x, 0)

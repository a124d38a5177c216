"""measure.comparison knows its noise (issue 52 item 6, review 6 C6): it names a faster run only when every steady
repeat of one beat every steady repeat of the other and enough repeats make that unlikely by chance; otherwise the
two are "within noise". 04 prints it under its two training runs and its speed table; the last test recomputes 04's
printed line from the epochs the notebook stored."""
from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest

from tutorial.lessons.measure import NOISE_CHANCE, comparison

ROOT = Path(__file__).resolve().parents[1]
WITHIN, FASTER = "are within noise", "faster than"


def test_two_numbers_keep_their_ratio_line():
    """The callers with one number per run (05 [39], 09 [18]) print what they printed."""
    assert comparison("bf16", 6096, "fp32", 5537, "samples/s") == \
        "compared here: bf16 6096 samples/s against fp32 5537 samples/s: bf16 is 1.10x fp32"
    assert comparison("a", 1.0, "b", 0, "s").endswith("a is no ratio (the second value is 0) b")


@pytest.mark.parametrize("unit, faster", [("samples/s", "higher"), ("s", "lower")])
def test_the_boundary_is_the_ranges_touching(unit, faster):
    """B's steady repeats span 100-102. A difference just outside that spread (A's slowest repeat beyond B's
    fastest by 0.01) is a verdict; the same medians with A's slowest repeat just inside it (0.01 back) are noise."""
    b = [100.0, 101.0, 102.0]
    sign = 1 if faster == "higher" else -1
    base = 102.0 if faster == "higher" else 100.0  # B's fastest repeat
    outside = [base + sign * 0.01, base + sign * 2, base + sign * 3]
    inside = [base - sign * 0.01, base + sign * 2, base + sign * 3]
    touching = [base, base + sign * 2, base + sign * 3]
    out_line = comparison("A", outside, "B", b, unit)
    assert re.search(r"\): A is 1\.\d\dx faster than B, beyond the noise", out_line), out_line
    assert WITHIN in comparison("A", inside, "B", b, unit)
    assert WITHIN in comparison("A", touching, "B", b, unit)  # a tie is no win
    # the medians are the same on both sides of the boundary: the spread, not the difference, decides
    assert comparison("A", outside, "B", b, unit).split(": ")[1] == comparison("A", inside, "B", b, unit).split(": ")[1]


def test_the_winner_and_its_ratio_follow_the_unit():
    rates = comparison("bf16", [90.0, 100.0, 110.0], "fp32", [40.0, 50.0, 60.0], "samples/s")
    assert "bf16 is 2.00x faster than fp32, beyond the noise" in rates
    times = comparison("async", [0.05, 0.06, 0.07], "blocking", [0.2, 0.21, 0.22], "s")
    assert "async is 3.50x faster than blocking" in times  # lower seconds are faster: 0.21 / 0.06
    slower_first = comparison("fp32", [40.0, 50.0, 60.0], "bf16", [90.0, 100.0, 110.0], "samples/s")
    assert "bf16 is 2.00x faster than fp32" in slower_first
    sizes = comparison("A", [5.0, 6.0, 7.0], "B", [1.0, 2.0, 3.0], "MB")
    assert "A 3.00x B, beyond the noise" in sizes and FASTER not in sizes  # no direction is known for MB
    assert "A is 3.00x faster than B" in comparison("A", [5.0, 6.0, 7.0], "B", [1.0, 2.0, 3.0], "MB", faster="higher")


def test_warm_up_is_dropped_before_the_medians():
    """A first epoch that allocates and warms up is not a steady repeat: with it, fp32's range would reach bf16's."""
    bf16, fp32 = [500.0, 900.0, 950.0, 1000.0], [5000.0, 600.0, 620.0, 640.0]
    assert WITHIN in comparison("bf16", bf16, "fp32", fp32, "samples/s")
    line = comparison("bf16", bf16, "fp32", fp32, "samples/s", warmup=1, repeat="epoch")
    assert line.startswith("compared here: bf16 950 samples/s against fp32 620 samples/s (medians of 3 epochs each, "
                           "after 1 warm-up epoch): bf16 is 1.53x faster than fp32")


def test_too_few_repeats_never_name_a_winner():
    """Disjoint ranges happen by chance 2 / C(n + m, n) of the time when both runs draw from one distribution: 1 for
    one repeat each, 1/3 for 2 against 2, 1/10 (NOISE_CHANCE, the most a verdict allows) for 3 against 3."""
    assert 2 / math.comb(6, 3) <= NOISE_CHANCE < 2 / math.comb(5, 2)
    two = comparison("A", [10.0, 11.0], "B", [1.0, 2.0], "samples/s")
    assert WITHIN in two and "1 time in 3: too few to tell" in two, two
    assert WITHIN in comparison("A", [10.0], "B", [1.0], "samples/s")
    assert FASTER in comparison("A", [10.0, 11.0, 12.0], "B", [1.0, 2.0, 3.0], "samples/s")


def test_a_run_of_warm_up_only_has_nothing_to_compare():
    """workshop-cpu trains one epoch: 04's cell must still print its line, and name no winner."""
    assert comparison("bf16", [800.0], "fp32", [400.0], "samples/s", warmup=1, repeat="epoch") == (
        "compared here: bf16 against fp32: nothing to compare (the runs have 1 and 1 epochs, and the first 1 of each "
        "is warm-up)")


def test_a_bad_direction_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"faster='up'; allowed: 'higher'"):
        comparison("A", [1.0, 2.0, 3.0], "B", [1.0, 2.0, 3.0], faster="up")


def draws(rng: random.Random, n: int, centre: float = 1000.0, noise: float = 0.1) -> list[float]:
    return [centre * math.exp(rng.gauss(0, noise)) for _ in range(n)]


def test_control_one_number_each_calls_a_difference_where_there_is_none():
    """Negative control: two runs of one distribution (10% noise, 5 repeats each). The old line, one number per run,
    prints a ratio other than 1.00x for nearly every pair, which a reader takes for "A is faster"; the new one says
    "within noise" for nearly every pair (a false verdict 1 time in 126 by construction), and still finds a real 30%
    gain at 3% noise."""
    rng = random.Random(0)
    trials = 400
    old_claims = new_claims = found = 0
    for _ in range(trials):
        a, b = draws(rng, 5), draws(rng, 5)
        old = comparison("A", a[0], "B", b[0], "samples/s")
        old_claims += not old.endswith("A is 1.00x B")
        new_claims += WITHIN not in comparison("A", a, "B", b, "samples/s")
        found += "A is 1." in comparison("A", draws(rng, 5, 1300, 0.03), "B", draws(rng, 5, 1000, 0.03), "samples/s")
    assert old_claims >= 0.9 * trials, old_claims
    assert new_claims <= 0.03 * trials, new_claims
    assert found >= 0.95 * trials, found


def test_review_6s_run_of_04():
    """C6: the mean of the epochs' rates said bf16 1.30x fp32; by time fp32 was ahead; one bf16 epoch was disturbed.
    The line says its medians and that the runs cannot be told apart."""
    bf16, fp32 = [8180, 8492, 9040, 392], [515, 6460, 6507, 6634]
    mean = lambda r: sum(r) / len(r)
    assert comparison("bf16", mean(bf16), "fp32", mean(fp32), "samples/s").endswith("bf16 is 1.30x fp32")
    assert comparison("bf16", bf16, "fp32", fp32, "samples/s", warmup=1, repeat="epoch") == (
        "compared here: bf16 8492 samples/s against fp32 6507 samples/s (medians of 3 epochs each, after 1 warm-up "
        "epoch): bf16 and fp32 are within noise (bf16 1.31x fp32, but the runs' ranges overlap: bf16 392-9040, fp32 "
        "6460-6634 samples/s)")


EPOCH = re.compile(r"^epoch (\d+): .*?\s(\d+) samples/s", re.M)


def _same_line(printed: str, recomputed: str) -> bool:
    """Equal, but for the last digit of a ratio: the stored epochs are printed rounded to whole samples/s."""
    number = re.compile(r"\d+\.\d+")
    if number.sub("#", printed) != number.sub("#", recomputed):
        return False
    return all(abs(float(p) - float(r)) <= 0.011 for p, r in zip(number.findall(printed), number.findall(recomputed)))


def test_04s_printed_comparison_agrees_with_its_stored_epochs():
    """Acceptance of issue 52 item 6: the line 04 prints under its runs, recomputed from the epochs it stored."""
    cells = json.loads((ROOT / "notebooks" / "04_mixed_precision.ipynb").read_text())["cells"]
    text = lambda c: "".join("".join(o.get("text", "")) for o in c.get("outputs", []))
    runs = {}
    for cell in cells:
        header = re.search(r"^single: .*precision (\w+)", text(cell), re.M)
        if header:
            runs[header.group(1)] = [float(rate) for _, rate in EPOCH.findall(text(cell))]
    assert set(runs) == {"bf16", "fp32"} and all(len(r) >= 4 for r in runs.values()), runs
    printed = [line for cell in cells for line in text(cell).splitlines()
               if line.startswith("compared here: bf16") and "epochs each" in line]
    assert len(printed) == 1, printed
    recomputed = comparison("bf16", runs["bf16"], "fp32", runs["fp32"], "samples/s", warmup=1, repeat="epoch")
    assert _same_line(printed[0], recomputed), (printed[0], recomputed)
    control = comparison("bf16", runs["fp32"], "fp32", runs["bf16"], "samples/s", warmup=1, repeat="epoch")
    assert not _same_line(printed[0], control)  # the check can fail: the runs swapped

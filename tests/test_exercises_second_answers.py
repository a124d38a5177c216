"""Every exercise's checker is tested with a second correct answer, written differently from the package's solution.

A checker that compares the learner's code with one way of writing it rejects the others: review 4 found 10's
exercise 3 refusing the fix its own prose calls best. So each `### Exercise k` of a notebook needs, in its test file,
a test named `test_exercise_k_..._accepts_...` (not only `accepts_the_solution`) that asserts the checker accepts an
answer of its own (a "correct" verdict, or a checker's True). This test only reads files; the answers themselves run in tests/test_exercises_*.py.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Test files number 03b's exercises after 03a's (one file for the notebook 03 was before its split).
OFFSET = {"03b_ddp_trainer": 2}


# What a test asserts when a checker accepts: a "correct: ..." verdict, or a checker's True / {"ok": True} asserted.
ACCEPTED = re.compile(r'"correct|assert (?!not\b)[\w.]*check_\w*\(|assert (?!not\b)\w+\["ok"\]')


def exercises(notebook: Path) -> list[int]:
    nb = json.loads(notebook.read_text())
    return sorted({int(k) for cell in nb["cells"] if cell["cell_type"] == "markdown"
                   for k in re.findall(r"^### Exercise (\d+)", "".join(cell["source"]), re.M)})


def second_answer_tests(source: str, number: int) -> list[str]:
    """Tests of exercise `number` that accept an answer other than the solution and assert a 'correct' verdict."""
    found = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        if not re.match(rf"test_exercise_{number}_\w*accepts_(?!the_solution(_and|$))", node.name):
            continue
        if ACCEPTED.search(ast.get_source_segment(source, node) or ""):
            found.append(node.name)
    return found


def missing(notebooks) -> list[str]:
    problems = []
    for notebook in notebooks:
        tests = ROOT / "tests" / f"test_exercises_{notebook.stem[:2]}.py"
        source = tests.read_text() if tests.is_file() else ""
        for k in exercises(notebook):
            if not second_answer_tests(source, k + OFFSET.get(notebook.stem, 0)):
                problems.append(f"{notebook.stem} exercise {k}: no test in {tests.name} accepts a second, "
                                f"differently written answer (test_exercise_{k + OFFSET.get(notebook.stem, 0)}_"
                                "accepts_...)")
    return problems


def test_every_exercise_has_a_second_correct_answer():
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert sum(len(exercises(nb)) for nb in notebooks) >= 25  # the headings were found at all
    problems = missing(notebooks)
    assert not problems, "\n".join(problems)


def test_only_a_second_answer_counts():
    """Negative control: a test that accepts only the solution, or accepts without a 'correct' verdict, is not one."""
    only_solution = ('def test_exercise_1_accepts_the_solution_and_names_x(cluster):\n'
                     '    assert check(solution).startswith("correct: yes")\n')
    no_verdict = 'def test_exercise_1_accepts_another(cluster):\n    check(other)\n'
    rejected = 'def test_exercise_1_accepts_nothing(cluster):\n    assert not lesson.check_x(other)\n'
    other = 'def test_exercise_1_accepts_an_in_place_division(cluster):\n    assert check(other) == "correct: 1.5"\n'
    assert second_answer_tests(only_solution, 1) == second_answer_tests(no_verdict, 1) == []
    assert second_answer_tests(rejected, 1) == []
    assert second_answer_tests('def test_exercise_1_accepts_y():\n    assert lesson.check_y(y)\n', 1) != []
    assert second_answer_tests(other, 1) == ["test_exercise_1_accepts_an_in_place_division"]
    assert second_answer_tests(other, 2) == []

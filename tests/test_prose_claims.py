"""Three kinds of claims in words that drifted from the files they describe (review 4, section 3):

- **Notebooks named that do not exist.** When 03 was split into 03a and 03b, prose kept saying "notebook 03" and
  "Notebooks 00, 03 and 05" (item 13). Every notebook number after "notebook(s)" in the notebooks' prose, the
  speaker notes, the course plan and the READMEs must be a notebook of `notebooks/`, and every notebook file name
  written out (`03a_ddp_by_hand`) must exist.
- **How long the notebook runs, said in words.** "On a GPU node too: every cell there takes seconds" (item 1, where
  the plan gives 3-5 min), "the cells run in a few minutes on a CPU" (item 4, plan: 29 s), "the trainer's runs take a
  minute or two each" (item 14, plan: 8-12 min). The course plan's "CPU run" and "GPU run" columns are the one place
  these times are kept (measured on a CPU, estimated on a GPU until `make gpu-check` measures them). A run-time claim
  is a verb of running ("takes", "run in", ...) followed by a duration, in a sentence that names a CPU or a GPU (the
  one nearest the duration is the claim's device). A claim about the whole run (in the first cell's **Time:**
  sentence, or a sentence about "the cells" or "the notebook") must give numbers (`3-5 min`, `about 30 s`, `two
  minutes`) within a factor 2 of the plan's figure for that device: words without a number ("takes seconds", "a
  few minutes") fail, since nothing can check them, and that is how items 1 and 4 went stale. A claim about a part (a
  launch, an epoch, a compile) may stay in words; given in numbers, it may not exceed twice the whole run. A
  sentence naming no device is not a run-time claim here (the teaching minutes are checked by
  `test_course_plan.py`, cells' run times by `test_quoted_numbers.py`).

- **How many mistakes an exercise has.** Notes 08 said exercise 2 has "Two mistakes ... The checker lists both"
  after the exercise had grown a third (item 19). Where an exercise's cells and its notes section both say how many
  mistakes, bugs or errors it holds ("three mistakes", "two bugs"), the numbers agree.

All read files only. `test_the_checks_find_what_review_4_found` runs them on 984c965 (the commit review 4 read).
"""
from __future__ import annotations

import json
import re
import sys
import subprocess
from pathlib import Path

import pytest
from plan_table import plan_table

ROOT = Path(__file__).resolve().parents[1]
REVIEWED = "984c965"
DOCS = ["README.md", "slides/README.md", "slides/course_plan.md"]


class Files:
    """The working tree, or a commit (for the negative control)."""

    def __init__(self, commit: str | None = None):
        self.commit = commit

    def read(self, path: str) -> str | None:
        if self.commit is None:
            p = ROOT / path
            return p.read_text(encoding="utf-8") if p.exists() else None
        done = subprocess.run(["git", "show", f"{self.commit}:{path}"], cwd=ROOT, capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else None

    def listing(self, folder: str, suffix: str) -> list[str]:
        if self.commit is None:
            return sorted(p.stem for p in (ROOT / folder).glob(f"*{suffix}"))
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{self.commit}", f"{folder}/"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split()
        return sorted(Path(n).stem for n in names if n.endswith(suffix))


def short(stem: str) -> str:
    return stem.split("_")[0]


def texts(files: Files) -> list[tuple[str, str, str]]:
    """(notebook stem or "", where, Markdown text) of every notebook's markdown cells, the notes and the docs."""
    found = []
    for stem in files.listing("notebooks", ".ipynb"):
        for index, cell in enumerate(json.loads(files.read(f"notebooks/{stem}.ipynb"))["cells"]):
            if cell["cell_type"] == "markdown":
                found.append((stem, f"{stem} md[{index}]", "".join(cell["source"])))
    for stem in files.listing("slides/notes", ".md"):
        found.append((stem, f"slides/notes/{stem}.md", files.read(f"slides/notes/{stem}.md")))
    for path in DOCS:
        text = files.read(path)
        if text is not None:
            found.append(("", path, text))
    return found


def where_in(where: str, text: str, at: int) -> str:
    return f"{where} line {text.count(chr(10), 0, at) + 1}" if "\n" in text else where


# ---- notebooks named ----

ID = r"\d\d[ab]?"
NAMED = re.compile(rf"(?i)\bnotebooks?\s+((?:{ID}(?:\s*,\s*|\s+and\s+|\s+or\s+|\s*[-\u2013]\s*))*{ID})(?![\w.])")
STEM = re.compile(r"(?<![\w/.-])(\d\d[ab]?_[a-z][a-z0-9_]*)(?![\w-])")  # not a literal: 10_000
FENCE = re.compile(r"```.*?```", re.DOTALL)


def reference_problems(files: Files) -> list[str]:
    stems = files.listing("notebooks", ".ipynb")
    ids = {short(s) for s in stems}
    problems = []
    for _, where, text in texts(files):
        text = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
        for m in NAMED.finditer(text):
            for name in re.findall(ID, m.group(1)):
                if name not in ids:
                    close = sorted(i for i in ids if i.startswith(name))
                    problems.append(f"{where_in(where, text, m.start())}: {m.group(0)!r} names notebook {name}, "
                                    f"which does not exist" + (f" (say {' or '.join(close)})" if close else ""))
        for m in STEM.finditer(text):
            stem = m.group(1)
            if stem not in stems and not any(s.startswith(stem) for s in stems) and short(stem) in ids | {
                    n[:2] for n in ids}:
                problems.append(f"{where_in(where, text, m.start())}: {stem!r} is not a notebook (there are "
                                f"{', '.join(s for s in stems if s[:2] == stem[:2])})")
    return problems


# ---- run times ----

WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
         "ten": 10, "fifteen": 15, "twenty": 20, "thirty": 30, "a": 1, "an": 1, "a couple of": 2}
NUM = r"(?:\d+(?:\.\d+)?|one|two|three|four|five|six|seven|eight|nine|ten|fifteen|twenty|thirty|a couple of|an|a)"
VAGUE = r"(?:a few|few|several|some|many|a handful of|a bit)"
UNIT = r"(?:s|sec|secs|seconds?|min|mins|minutes?|hours?|h)\b"
SCALE = {"s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1, "min": 60, "mins": 60, "minute": 60,
         "minutes": 60, "hour": 3600, "hours": 3600, "h": 3600}
DURATION = re.compile(
    rf"(?P<vague>(?:{VAGUE}\s+)?(?:seconds|minutes|hours)\b)"
    rf"|(?P<a>{NUM})\s*(?:(?:-|\u2013|to|or)\s*(?P<b>{NUM})\s*)?(?P<unit>{UNIT})(?:\s+or\s+(?P<c>{NUM})\b)?",
    re.IGNORECASE)
VERB = re.compile(r"(?i)\b(?:takes?|took|taking|runs?|ran|running|lasts?|finish(?:es)?|needs?)\b"
                  r"(?:\s+(?:in|about|around|roughly|only|under|just|less\s+than|over|up\s+to|at\s+most|each|"
                  r"there|then|for|~))*\s+")
DEVICE = re.compile(r"(?i)\b(?:(?P<gpu>GPUs?|A100|H100|V100)|(?P<cpu>CPUs?|laptop))\b")
WHOLE = re.compile(r"(?i)\*\*(?:estimated\s+)?time:?\*\*|\bcells\b|\bevery cell\b|\bthe notebook\b")
SLACK = 2.0  # the plan's CPU times are recorded on a shared machine (2-4x a quiet one's), its GPU times estimated
SENTENCE = re.compile(r"(?<=[.;!?])\s+(?=[A-Z*(`])|\n\s*\n|\n\s*[-*]\s")


def number(word: str) -> float:
    word = word.lower()
    return float(WORDS[word]) if word in WORDS else float(word)


def plan_times(files: Files) -> dict[str, dict[str, tuple[float, float]]]:
    """{notebook id: {"cpu": (low, high) s, "gpu": ...}} from the plan's table; a split notebook's first timed row."""
    found = {}
    for _, row in plan_table(files.read("slides/course_plan.md") or ""):
        ident = re.match(r"(\d\d[ab]?|appendix)\b", row.get("notebook", ""))
        if not ident:
            continue
        times = found.setdefault(ident.group(1), {})
        for column, value in row.items():
            device = "cpu" if column.startswith("cpu") else "gpu" if column.startswith("gpu") else None
            if device is None or device in times:
                continue
            if value == "same" and "cpu" in times:
                times[device] = times["cpu"]
                continue
            span = plan_span(value)
            if span:
                times[device] = span
    return found


def plan_span(value: str) -> tuple[float, float] | None:
    """'3-5 min' -> (180, 300); '35 s' -> (35, 35); '< 1 min' -> (0, 60); '~3 min'; '(in 06's run)' -> None."""
    m = re.match(r"(<)?\s*~?\s*(\d+(?:\.\d+)?)(?:\s*-\s*(\d+(?:\.\d+)?))?\s*(s|min|h)\b", value.strip())
    if not m:
        return None
    scale = SCALE[m.group(4)]
    low, high = float(m.group(2)) * scale, float(m.group(3) or m.group(2)) * scale
    return (0.0, high) if m.group(1) else (low, high)


def runtime_claims(text: str) -> list[tuple[int, str, str, tuple[float, float] | None, bool]]:
    """(offset, sentence, device, (low, high) s or None if said without a number, about the whole run) of each
    run-time claim."""
    found = []
    clean = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    clean = re.sub(r"`[^`\n]+`|<!--.*?-->", lambda m: " " * len(m.group(0)), clean, flags=re.S)
    starts = [0] + [m.end() for m in SENTENCE.finditer(clean)] + [len(clean)]
    for begin, end in zip(starts, starts[1:]):
        sentence = clean[begin:end]
        for verb in VERB.finditer(sentence):
            d = DURATION.match(sentence, verb.end())
            if not d:
                continue
            devices = [(abs(m.start() - d.start()), "gpu" if m["gpu"] else "cpu") for m in DEVICE.finditer(sentence)]
            if not devices:
                continue
            device = min(devices)[1]
            if d["vague"]:
                span = None
            else:
                unit = SCALE[d["unit"].lower()]
                values = [number(d[k]) * unit for k in ("a", "b", "c") if d[k]]
                span = (min(values), max(values))
            found.append((begin + d.start(), " ".join(sentence.split()), device, span,
                          bool(WHOLE.search(text[begin:end]))))
    return found


def runtime_problems(files: Files) -> list[str]:
    plan = plan_times(files)
    problems = []
    for stem, where, text in texts(files):
        if not stem:
            continue
        for at, sentence, device, span, whole in runtime_claims(text):
            said = where_in(where, text, at)
            planned = plan.get(short(stem), {}).get(device)
            if span is None:
                if whole:
                    problems.append(f"{said}: says how long the notebook runs on a {device.upper()} without a "
                                    f"number; give the plan's {fmt(planned)} (or drop it): {sentence[:160]}")
            elif planned and span[0] > planned[1] * SLACK:
                problems.append(f"{said}: {fmt(span)} on a {device.upper()}, longer than the plan's whole "
                                f"{device.upper()} run, {fmt(planned)}: {sentence[:160]}")
            elif planned and whole and span[1] * SLACK < planned[0]:
                problems.append(f"{said}: {fmt(span)} on a {device.upper()}, the plan's {device.upper()} run is "
                                f"{fmt(planned)}: {sentence[:160]}")
    return problems


def fmt(span: tuple[float, float] | None) -> str:
    if span is None:
        return "(no figure)"
    low, high = span
    if high >= 120:
        return f"{low / 60:.3g}-{high / 60:.3g} min" if low != high else f"{high / 60:.3g} min"
    return f"{low:g}-{high:g} s" if low != high else f"{high:g} s"


# ---- an exercise's mistakes counted twice ----

COUNTED = re.compile(r"(?i)\b(one|two|three|four|five|six|\d)\s+(?:[\w-]+\s+)?(?:mistakes|bugs|errors|faults)\b")


def counts(text: str) -> set[int]:
    return {int(number(m.group(1))) for m in COUNTED.finditer(text)}


def exercise_texts(cells: list[dict]) -> dict[int, str]:
    """{k: the markdown of exercise k}: from its '### Exercise k' heading to the next heading that is not inside it."""
    found, current = {}, None
    for cell in cells:
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"])
        heading = re.match(r"#+\s+Exercise\s+(\d+)", text)
        if heading:
            current = int(heading.group(1))
        elif re.match(r"#{1,3}\s", text):
            current = None
        if current is not None:
            found[current] = found.get(current, "") + text + "\n"
    return found


def exercise_problems(files: Files) -> list[str]:
    problems = []
    for stem in files.listing("notebooks", ".ipynb"):
        notes = files.read(f"slides/notes/{stem}.md") or ""
        in_notes = {int(m.group(1)): m.group(2) for m in
                    re.finditer(r"^## Exercise (\d+)\b(.*?)(?=^## |\Z)", notes, re.M | re.S)}
        cells = exercise_texts(json.loads(files.read(f"notebooks/{stem}.ipynb"))["cells"])
        for k in sorted(set(cells) & set(in_notes)):
            said, noted = counts(cells[k]), counts(in_notes[k])
            if said and noted and said != noted:
                problems.append(f"{stem}: exercise {k} has {' or '.join(map(str, sorted(said)))} mistakes by its "
                                f"cells, {' or '.join(map(str, sorted(noted)))} by its notes")
    return problems


CHECKS = [reference_problems, runtime_problems, exercise_problems]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_prose_agrees_with_the_files(check):
    problems = check(Files())
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems)


@pytest.mark.parametrize("text, device, span", [
    ("on a GPU node too: every cell there takes seconds", "gpu", None),                      # item 1
    ("the cells run in a few minutes on a CPU, less on a GPU node", "cpu", None),            # item 4
    ("on a GPU node, where the trainer's runs take a minute or two each", "gpu", (60, 120)),  # item 14
    ("On a GPU node the run takes 3-5 min.", "gpu", (180, 300)),
    ("the cells run in about two minutes on a CPU", "cpu", (120, 120)),
    ("each launch takes about 25 s on this laptop's CPU", "cpu", (25, 25)),
])
def test_runtime_claims_are_read(text, device, span):
    [(_, _, got_device, got_span, _)] = runtime_claims(text)
    assert (got_device, got_span) == (device, span)


@pytest.mark.parametrize("text", [
    "**Time:** about 40 minutes (15 of them exercises).",   # teaching time: no device, no claim
    "The GPU path needs NCCL; a rank takes the lock.",      # no duration after the verb
    "It takes `30 s` on a GPU",                              # code is not prose
])
def test_not_runtime_claims(text):
    assert runtime_claims(text) == []


def test_references_are_read(tmp_path, monkeypatch):
    """Against a made-up tree: what names a notebook that exists, and what does not."""
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "slides" / "notes").mkdir(parents=True)
    for stem in ("03a_ddp_by_hand", "03b_ddp_trainer", "05_horovod"):
        (tmp_path / "notebooks" / f"{stem}.ipynb").write_text(json.dumps({"cells": []}))
    (tmp_path / "README.md").write_text(
        "Notebooks 03a, 03b and 05 run DDP; notebook 03 did (stale). The capstone of `03b_ddp_trainer` and "
        "`03_ddp` (stale); 07 minutes, `10_000` steps; see notebooks 03a-05.\n```\nnotebook 04 in a code block\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    problems = reference_problems(Files())
    assert len(problems) == 2, problems
    assert "'notebook 03' names notebook 03" in problems[0] and "'03_ddp' is not a notebook" in problems[1]


def test_exercise_counts_are_read():
    cells = [{"cell_type": "markdown", "source": ["### Exercise 2: a stopper\nIt has three mistakes: two in the settings"]},
             {"cell_type": "code", "source": ["x = 1"]},
             {"cell_type": "markdown", "source": ["<details>solution: the two bugs ...</details>"]},
             {"cell_type": "markdown", "source": ["## Summary\nfour errors elsewhere"]}]
    texts_ = exercise_texts(cells)
    assert list(texts_) == [2] and counts(texts_[2]) == {3, 2}   # "two in the settings" is no count of mistakes
    assert counts("Two mistakes; the checker lists both") == {2} and counts("a mistake, 10 epochs") == set()


def test_plan_spans():
    assert plan_span("3-5 min") == (180, 300) and plan_span("35 s") == (35, 35)
    assert plan_span("< 1 min") == (0, 60) and plan_span("~3 min") == (180, 180)
    assert plan_span("139 s (all of 06)") == (139, 139) and plan_span("(in 06's run)") is None


def test_the_checks_find_what_review_4_found():
    """Negative control: on 984c965 these checks find review 4's items 1, 4, 13 and 14 (and no more than a few
    others, so that the rules are not a net that catches everything)."""
    files = Files(REVIEWED)
    if files.read("slides/course_plan.md") is None:
        pytest.skip(f"{REVIEWED} is not in this clone (a shallow checkout)")
    references = "\n".join(reference_problems(files))
    assert "appendix_job_scripts md[10] line 3: 'Notebooks 00, 03 and 05' names notebook 03" in references  # item 13
    runtimes = "\n".join(runtime_problems(files))
    assert "01_single_device md[0] line 15: says how long the notebook runs on a GPU without" in runtimes  # item 1
    assert "04_mixed_precision md[0] line 15: says how long the notebook runs on a CPU without" in runtimes  # item 4
    assert "03b_ddp_trainer md[0] line 17: 1-2 min on a GPU, the plan's GPU run is 8-12 min" in runtimes  # item 14
    # what else they find there: the other "notebook 03"s (11 of them), 02's and 05's "a few minutes on a CPU", 07's
    # "about two minutes" against the plan's 51 s; nothing that is not a stale or unchecked claim
    assert len(reference_problems(files)) == 12 and len(runtime_problems(files)) == 6


def test_review_4_items_caught_on_984c965():
    """Issue 30 asks that the drift checks together fail on at least 10 of review 4's 27 contradictions as they were
    on 984c965. Each item below is found by a check of this file, of test_quoted_numbers.py or of
    test_course_plan.py, run on that commit's files; the message each finds is the item's."""
    import importlib.util

    if Files(REVIEWED).read("slides/course_plan.md") is None:
        pytest.skip(f"{REVIEWED} is not in this clone (a shallow checkout)")

    def module(name: str):
        spec = importlib.util.spec_from_file_location(f"_h_{name}", Path(__file__).with_name(f"{name}.py"))
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = loaded  # its dataclasses look their module up there
        spec.loader.exec_module(loaded)
        return loaded

    quoted, plan = module("test_quoted_numbers"), module("test_course_plan")
    old = Files(REVIEWED)

    def numbers(stem: str) -> str:
        return "\n".join(quoted.unmatched(ROOT / "notebooks" / f"{stem}.ipynb",
                                          json.loads(old.read(f"notebooks/{stem}.ipynb")),
                                          old.read(f"slides/notes/{stem}.md")))

    minutes = "\n".join(plan.minutes_problems(plan.Files(REVIEWED)))
    needs = "\n".join(plan.needs_problems(plan.Files(REVIEWED, worktree=("slides/course_plan.md",))))
    references, runtimes = "\n".join(reference_problems(old)), "\n".join(runtime_problems(old))
    exercises = exercise_problems(old)
    found = {
        1: "01_single_device md[0] line 15: says how long the notebook runs on a GPU without" in runtimes,
        4: "04_mixed_precision md[0] line 15: says how long the notebook runs on a CPU without" in runtimes,
        7: "md[4] line 13: '0.58 s'" in numbers("07_scaling_study"),
        13: "appendix_job_scripts md[10] line 3: 'Notebooks 00, 03 and 05' names notebook 03" in references,
        14: "03b_ddp_trainer md[0] line 17: 1-2 min on a GPU, the plan's GPU run is 8-12 min" in runtimes,
        15: "06_multi_node: the plan gives 40 min, the notes 45" in minutes,
        16: "06_multi_node (core day): needs ['05'], which the plan puts after it" in needs,
        17: "08_lightning: the first cell says 40 min, the notes 30" in minutes,
        18: "'0.1577'" in numbers("08_lightning"),
        19: exercises == ["08_lightning: exercise 2 has 3 mistakes by its cells, 2 by its notes"],
        21: "'0.1951'" in numbers("10_when_things_go_wrong"),
        23: "10_when_things_go_wrong: notes sections without" in minutes,
        24: "07_scaling_study: the notes' sections add up to" in minutes,
    }
    assert all(found.values()), [item for item, ok in found.items() if not ok]
    assert len(found) >= 10

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

- **A measured comparison said in words.** "Its epochs below run several times slower than the fp32 run after them"
  stood above cells where bf16 ran faster, "the measured idle time did not fall with m" above a table where it fell,
  "staging costs about what the blocking save costs" above 0.09 s against 0.46 s (review 5, N1-N5): a re-run
  reverses a direction, and nothing compared words with outputs. A sentence that compares measured quantities
  (faster, slower, falls, grows, about the same, N times, ...: words of time, speed or idleness) about this
  notebook's runs (here, below, measured, the table, a 2-core machine, ...) must point at the line the measuring cell
  prints with `tutorial.lessons.measure.comparison` or `trend` ("compared here: bf16 6096 samples/s against fp32
  5537 samples/s: bf16 is 1.10x fp32"), in its notebook (for the notes: in the cells their section covers). Not
  such claims: questions, sentences that give their numbers (`test_quoted_numbers.py` checks those), sentences
  about other hardware (a GPU, Lustre) or about the seeds' cited tables, and sentences that say a result changes from
  run to run.
- **Run times in the speaker notes.** "The slow cell (about a minute on a CPU)" stood beside a cell that ran 1.5 s,
  "each launch takes about 20-25 s" beside launches of 8-10 s (review 5, N13). A duration after a verb of running
  ("takes about a minute", "tens of seconds", "20-25 s") in a notes section, unless it is about a GPU, must be within
  a factor 2 of the recorded run time of one of the cells the section covers (`scripts/slides_export.py` knows which
  cells those are; `scripts/cell_times.py` reads their times), or of all of them together; "the slow cell" needs a
  cell of at least `SLOW_S` seconds there, and "the slowest cell of the notebook" the notebook's slowest cell.
- **How many mistakes an exercise has.** Notes 08 said exercise 2 has "Two mistakes ... The checker lists both"
  after the exercise had grown a third (item 19). Where an exercise's cells and its notes section both say how many
  mistakes, bugs or errors it holds ("three mistakes", "two bugs"), the numbers agree.

All read files only. `test_the_checks_find_what_review_4_found` runs them on 984c965 (the commit review 4 read),
`test_the_checks_find_what_review_5_found` on 4e6582a (the commit review 5 read): on what tests/fixtures/ keeps of
those commits' files, so that the controls need no git history.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import nbformat
import pytest
from plan_table import plan_table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from cell_times import cell_seconds  # noqa: E402
from slides_export import SLOW_S, notes_sections  # noqa: E402
REVIEWED = "984c965"
REVIEWED_5 = "4e6582a"
FIXTURES = ROOT / "tests" / "fixtures"  # old commits' files, for the negative controls (see its README.md)
DOCS = ["README.md", "slides/README.md", "slides/course_plan.md"]


class Files:
    """The working tree, or (for the negative controls) an old commit's files as tests/fixtures/<commit>/ keeps
    them, a notebook as `<name>.ipynb.json`; a file it does not keep reads as absent (None)."""

    def __init__(self, commit: str | None = None):
        self.commit = commit

    def path(self, path: str) -> Path:
        if self.commit is None:
            return ROOT / path
        return FIXTURES / self.commit / (f"{path}.json" if path.endswith(".ipynb") else path)

    def read(self, path: str) -> str | None:
        p = self.path(path)
        return p.read_text(encoding="utf-8") if p.exists() else None

    def listing(self, folder: str, suffix: str) -> list[str]:
        kept = suffix + (".json" if suffix == ".ipynb" and self.commit else "")
        return sorted(p.name.removesuffix(kept) for p in self.path(folder).glob(f"*{kept}"))


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


# ---- measured comparisons said in words ----

COMPARATIVE = re.compile(
    r"(?i)\b(?:faster|slower|quicker|sooner|(?:longer|shorter|later|more|less|fewer|larger|smaller|higher|lower) than|"
    r"(?:did|does|do)(?:n't| not) (?:fall|grow|shrink|rise|drop|change)|falls?|fell|falling|grows?|grew|growing|"
    r"shrinks?|shrank|rises?|rose|(?:drops?|dropped)(?= (?:with|to|from|as|by|below))|about the same|the same as|"
    r"about (?:the time|what)|"
    r"as (?:fast|slow|long|quick) as|(?:several|many|\w+|\d+(?:\.\d+)?) times (?:faster|slower|more|less|longer|"
    r"shorter|larger|smaller|as)|comes? out ahead|ahead of|beats?|outperforms?|reverses|wins?)\b")
SPEED = re.compile(r"(?i)faster|slower|quicker|sooner|ahead|beat|outperform|win")
TIMING = re.compile(r"(?i)samples/s|images/s|throughput|speed|\btimes?\b(?! (?:faster|slower|more|less|larger|smaller|"
                    r"as))|timings?|seconds|\bidle\b|bandwidth|latency|\bper (?:batch|step|epoch)\b|"
                    r"\d\s?(?:s|ms|µs)\b|\bcosts?\b|\btakes?\b|\btook\b|\breturn(?:s|ed)?\b|\bwaits?\b")
HERE = re.compile(r"(?i)\b(?:here|below|above|measured|stored outputs?|these (?:runs|times|numbers|timings)|"
                  r"the (?:times|timings|table)|this (?:machine|VM|laptop|CPU|run)|2-core|compare|shared CPU)\b")
ELSEWHERE = re.compile(r"(?i)\b(?:GPUs?|A100|H100|V100|Lustre|GPFS|parallel file system|asserted)\b")
WITH_NUMBERS = re.compile(r"\d(?:[\d,.]*\d)?\s?(?:x\b|×|%|s\b|ms\b|µs\b|samples/s|MB|GB)"
                          r"|\b(?:two|three|four|ten)-fold\b")
VARIES = re.compile(r"(?i)from run to run|either direction|both faster and slower")
CITED = re.compile(r"(?i)\bseeds? \d{3}\b|<!--\s*cited")
POINTS = re.compile(r"(?i)compared here")
PRINTS = re.compile(r"\b(?:comparison|trend)\(")  # tutorial.lessons.measure's two
CLAUSE = re.compile(r"(?<=[.;!?])\s+")


def blank_code(text: str) -> str:
    text = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return re.sub(r"`[^`\n]+`|<!--.*?-->", lambda m: " " * len(m.group(0)), text, flags=re.S)


def worded_comparisons(text: str) -> list[tuple[int, str]]:
    """(offset, sentence) of each comparison of measured quantities in words about this notebook's runs that does
    not point at a printed comparison. A paragraph (or list item) is the unit a pointer or a citation covers; the
    sentence, or the one before it, must say that it is about the runs here."""
    found = []
    clean = blank_code(text)
    starts = [0] + [m.end() for m in re.finditer(r"\n\s*\n|\n(?=\s*(?:[-*]|\d+\.) )", clean)] + [len(clean)]
    for begin, end in zip(starts, starts[1:]):
        raw, paragraph = text[begin:end], clean[begin:end]
        if POINTS.search(raw) or CITED.search(raw):
            continue
        cuts = [0] + [m.end() for m in CLAUSE.finditer(paragraph)] + [len(paragraph)]
        sentences = [(a, paragraph[a:b]) for a, b in zip(cuts, cuts[1:])]
        for k, (at, sentence) in enumerate(sentences):
            said = COMPARATIVE.search(sentence)
            if not said or not (SPEED.search(said.group(0)) or TIMING.search(sentence)):
                continue
            if not (HERE.search(sentence) or (k and HERE.search(sentences[k - 1][1]))):
                continue
            if sentence.rstrip().endswith("?") or ELSEWHERE.search(sentence) or WITH_NUMBERS.search(sentence) \
                    or VARIES.search(sentence):
                continue
            found.append((begin + at + said.start(), " ".join(sentence.split())))
    return found


def prints_comparison(cells: list[dict], covered: range) -> bool:
    return any(cells[i]["cell_type"] == "code" and PRINTS.search(cells[i]["source"]) for i in covered)


def notebook_cells(files: Files, stem: str) -> list:
    """The notebook's cells as nbformat nodes (dicts that the slide export also reads by attribute)."""
    return nbformat.reads(files.read(f"notebooks/{stem}.ipynb"), as_version=4).cells


def comparison_problems(files: Files) -> list[str]:
    problems = []
    for stem in files.listing("notebooks", ".ipynb"):
        cells = notebook_cells(files, stem)
        # a cell's pointer may name a line anywhere in its notebook ("under the bubble table", from the summary);
        # a notes section's, a line among the cells its slides show
        places = [(f"{stem} md[{i}]", c["source"], range(len(cells)))
                  for i, c in enumerate(cells) if c["cell_type"] == "markdown"]
        notes = files.read(f"slides/notes/{stem}.md")
        if notes:
            sections, _ = notes_sections(cells, notes)
            places += [(f"slides/notes/{stem}.md \u00a7 {heading}", body, covered)
                       for heading, body, covered in sections]
        for where, text, covered in places:
            for at, sentence in worded_comparisons(text):
                problems.append(f"{where_in(where, text, at)}: a measured comparison in words; print it where it is "
                                f"measured (measure.comparison / trend) and point at the 'compared here:' line: "
                                f"{sentence[:160]}")
            if POINTS.search(text) and not prints_comparison(cells, covered):
                problems.append(f"{where}: points at a 'compared here:' line, but no cell of its section prints one")
    return problems


# ---- run times in the speaker notes ----

SPANS = {"seconds": (1, 59), "a few seconds": (2, 10), "few seconds": (2, 10), "several seconds": (3, 15),
         "tens of seconds": (10, 90), "minutes": (60, 3599), "a few minutes": (120, 600),
         "several minutes": (180, 900), "hours": (3600, 86400)}
SPOKEN = r"(?:one|two|three|four|five|six|seven|eight|nine|ten|fifteen|twenty|thirty|a couple of|an|a)(?=\s)"
NOTES_DURATION = re.compile(
    rf"(?P<vague>(?:a few|few|several|tens of)\s+(?:seconds|minutes)|seconds|minutes|hours)\b"
    rf"|(?P<a>\d+(?:\.\d+)?|{SPOKEN})\s*(?:(?:-|\u2013|to|or)\s*(?P<b>\d+(?:\.\d+)?|{SPOKEN})\s*)?(?P<unit>{UNIT})"
    rf"(?:\s+or\s+(?P<more>more|longer))?",
    re.IGNORECASE)
AT_MOST = re.compile(r"(?i)\b(?:under|up\s+to|at\s+most|less\s+than)\s+$")
HEDGED = re.compile(r"(?i)\b(?:can|could|may|might)\s+$")
SLOW_CELL = re.compile(r"(?i)\b(?P<which>slowest|slow)\s+cells?\b(?P<notebook>\s+(?:of|in)\s+the\s+notebook)?")


def notes_durations(text: str) -> list[tuple[int, str, tuple[float, float]]]:
    """(offset, sentence, (low, high) s) of each duration after a verb of running ("takes about 20-25 s", "takes
    under a minute", "runs in seconds"), unless the sentence is about a GPU or a parallel file system, or hedged
    ("can take minutes")."""
    found = []
    clean = blank_code(text)
    starts = [0] + [m.end() for m in SENTENCE.finditer(clean)] + [len(clean)]
    for begin, end in zip(starts, starts[1:]):
        sentence = clean[begin:end]
        if any(m["gpu"] for m in DEVICE.finditer(sentence)) or ELSEWHERE.search(sentence):
            continue   # not what the stored cells ran
        for verb in VERB.finditer(sentence):
            d = NOTES_DURATION.match(sentence, verb.end())
            if not d or HEDGED.search(sentence[:verb.start()]):
                continue
            if d["vague"]:
                span = SPANS[" ".join(d["vague"].lower().split())]
            else:
                unit = SCALE[d["unit"].lower()]
                values = [number(d[k]) * unit for k in ("a", "b") if d[k]]
                span = (min(values), float("inf") if d["more"] else max(values))
            if AT_MOST.search(sentence[:d.start()]):
                span = (0.0, span[1])
            found.append((begin + d.start(), " ".join(sentence.split()), span))
    return found


def notes_runtime_problems(files: Files) -> list[str]:
    problems = []
    for stem in files.listing("notebooks", ".ipynb"):
        notes = files.read(f"slides/notes/{stem}.md")
        if not notes:
            continue
        cells = notebook_cells(files, stem)
        times = {i: t for i, c in enumerate(cells) if c["cell_type"] == "code" and (t := cell_seconds(c)) is not None}
        if not times:
            continue
        slowest = max(times, key=times.get)
        sections, _ = notes_sections(cells, notes)
        for heading, body, covered in sections:
            mine = [times[i] for i in covered if i in times]
            if not mine:
                continue
            recorded = mine + [sum(mine)]
            where = f"slides/notes/{stem}.md \u00a7 {heading}"
            shown = ", ".join(f"{t:.1f}" for t in sorted(mine, reverse=True)[:3])
            for at, sentence, (low, high) in notes_durations(body):
                if not any(low / SLACK <= t <= high * SLACK for t in recorded):
                    said = fmt((low, high)) if high < float("inf") else fmt((low, low)) + " or more"
                    problems.append(f"{where_in(where, body, at)}: {said}, but the cells of this section ran {shown} s"
                                    f" (in all {sum(mine):.1f} s): {sentence[:160]}")
            for m in SLOW_CELL.finditer(blank_code(body)):
                if m["which"].lower() == "slowest" and m["notebook"]:
                    if slowest not in covered:
                        problems.append(f"{where_in(where, body, m.start())}: '{m.group(0)}', but the notebook's "
                                        f"slowest cell is [{slowest}] ({times[slowest]:.1f} s), not in this section")
                elif max(mine) < SLOW_S:
                    problems.append(f"{where_in(where, body, m.start())}: '{m.group(0)}', but no cell of this section "
                                    f"ran {SLOW_S:g} s or more (the slowest {max(mine):.1f} s)")
    return problems


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


CHECKS = [reference_problems, runtime_problems, exercise_problems, comparison_problems, notes_runtime_problems]


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
    cells = [{"cell_type": "markdown",
              "source": ["### Exercise 2: a stopper\nIt has three mistakes: two in the settings"]},
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


@pytest.mark.parametrize("text, flagged", [
    ("The stored outputs come from a 2-core VM: its epochs below run several times slower than the fp32 run after "
     "them (compare their samples/s).", True),                                                    # N1
    ("- Pipeline parallel: with free messages more micro-batches shrink it; on a shared CPU the measured idle time "
     "did not fall with m.", True),                                                               # N2
    ("Compare the times above. On a laptop the files land in the page cache, so staging costs about what the "
     "blocking save costs.", True),                                                               # N3
    ("Compare the times above: the `compared here:` lines give both. Staging costs about what the save costs.",
     False),                                                                                      # points at it
    ("Which one is faster here?", False),                                                          # a question
    ("Here DDP took 1.9 s and Horovod 1.6 s, so Horovod was faster.", False),                      # its numbers
    ("On an A100 bf16 is faster than fp32 here.", False),                                          # other hardware
    ("The wrapper has come out both faster and slower than the plain model here.", False),         # no direction
    ("We drop the first three steps and take the median of the times measured.", False),          # no comparison
])
def test_worded_comparisons_are_read(text, flagged):
    assert bool(worded_comparisons(text)) is flagged


@pytest.mark.parametrize("text, span", [
    ("Each launch takes about 20-25 s on a laptop.", (20, 25)),
    ("The launch takes a minute or more on a laptop.", (60, float("inf"))),
    ("Together they take under a minute.", (0, 60)),
    ("It runs in seconds on a CPU.", (1, 59)),
    ("The launch takes tens of seconds, so talk over it.", (10, 90)),
    ("Each skeleton runs as stored and is wrong.", None),               # "as" is no "a s"
    ("Then a real Slurm (can take minutes).", None),                    # hedged
    ("On a GPU node each launch takes about 3 min.", None),             # not what was recorded
    ("On Lustre the write is what takes minutes.", None),
])
def test_notes_durations_are_read(text, span):
    found = notes_durations(text)
    assert (found[0][2] if found else None) == span


def test_comparison_lines():
    from tutorial.lessons.measure import comparison, trend
    assert comparison("bf16", 6096, "fp32", 5537, "samples/s") == \
        "compared here: bf16 6096 samples/s against fp32 5537 samples/s: bf16 is 1.10x fp32"
    assert trend("idle", "m", [2, 4, 8], [0.40, 0.35, 0.29]).endswith(
        "it fell at every step, to 0.72x its value at m = 2")
    assert "did not move one way at every step" in trend("idle", "m", [2, 4, 8], [0.39, 0.33, 0.38])  # review 4's run
    assert "rose at every step" in trend("idle", "m", [2, 4, 8], [0.1, 0.2, 0.3])


def test_the_checks_find_what_review_5_found():
    """Negative control: on 4e6582a (the commit review 5 read) the comparison check finds N1-N5 (04 md[22], 11
    md[48], 09 md[19], notes 09 and 05), and the notes' run-time check N13's "slow cell"s and "a minute or more";
    test_quoted_numbers's range rule no longer lets notes 08's "20-25 s" match "23 batches"."""
    files = Files(REVIEWED_5)
    compared = "\n".join(comparison_problems(files))
    for place in ("04_mixed_precision md[22] line 6", "11_model_parallelism md[48] line 28",
                  "09_sharded_training md[19] line 2", "slides/notes/09_sharded_training.md \u00a7 Saving while",
                  "slides/notes/05_horovod.md \u00a7 DDP and Horovod side by side"):
        assert place in compared, place
    runtimes = "\n".join(notes_runtime_problems(files))
    for place in ("02_data_parallel.md \u00a7 Train with the DataParallel trainer: 'slow cell'",
                  "04_mixed_precision.md \u00a7 Training in bf16: 'slow cells'",
                  "08_lightning.md \u00a7 One process first line 1: 'slowest cell of the notebook'",
                  "08_lightning.md \u00a7 The simple profiler line 1: 'slow cell'",
                  "10_when_things_go_wrong.md \u00a7 8. torchrun restarts its workers line 1: 60 s or more"):
        assert place in runtimes, place

    import importlib.util
    spec = importlib.util.spec_from_file_location("_q5", Path(__file__).with_name("test_quoted_numbers.py"))
    quoted = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = quoted
    spec.loader.exec_module(quoted)
    stem = "08_lightning"
    found = "\n".join(quoted.unmatched(ROOT / "notebooks" / f"{stem}.ipynb",
                                       json.loads(files.read(f"notebooks/{stem}.ipynb")),
                                       files.read(f"slides/notes/{stem}.md")))
    assert "'25 s' is not in 08_lightning's outputs" in found and "about 20-25 s on a laptop" in found

"""Numbers quoted in a notebook's prose or its speaker notes are the numbers its stored outputs show.

Review 4 found 27 places where the prose, the notes or the course plan said one value and the outputs another (a run
was re-executed, the prose was not re-read). This test reads JSON and Markdown only, so it is cheap enough for every
`make test`; for authors: `python tests/test_quoted_numbers.py notebooks/X.ipynb` prints what does not match.

What counts as a measured-looking number (the rest is left alone, so authors need not mark counts and settings):
- a decimal, `0.618`, `2.2 s`, `78.8%` (not a version after a package name, `torch 2.14`, nor `1e-5`, a date, a
  clock time, a section number `7.1` opening a heading);
- an integer with a unit of time, speed, ratio or percent: `476 µs`, `4,800 samples/s`, `40x`, `12%`.
  Minutes and hours are the course plan's (another test compares them), sizes such as `16 MiB` or `25 MB` are
  settings unless written with a decimal, and bare integers (`2 ranks`, `8 GPUs`, `seed 004`, `45 batches`) are
  counts.
Skipped text: code spans and blocks, links' targets, LaTeX, HTML comments, cell references (`[24]`, `md[41]`).
Claims in words (a notebook that does not exist, how long a notebook runs on a CPU or a GPU) are checked by
`test_prose_claims.py`; minutes of teaching and prerequisites by `test_course_plan.py`.

A quoted number matches a number the notebook shows: in its code cells' stored outputs (stream and text, ignored
outputs included), in its code (a setting the prose restates, `bucket_cap_mb=0.1`), or a code cell's recorded run
time in whole seconds ("each launch takes about 25 s"). They match when they agree to the precision the prose
prints: `0.62` matches 0.615 to 0.625, `2.2` matches 2.15 to 2.25; an integer's trailing zeros are not significant
(`4,800` matches 4,750 to 4,850), but the tolerance never exceeds 5% of the value (`100%` matches 95 to 105). A
percent also matches the fraction (`78.8%` ~ 0.7883), a time in s/ms/µs the same time printed in the neighbouring
unit (s, ms, µs), and a range (`20-25 s`) a number within it; a range of times only a time (printed with its unit,
or a cell's recorded run time), so that "each launch takes about 20-25 s" no longer matches "23 batches". Other units
are not compared: the check catches a stale value, it does not prove which output a sentence means. A number read
from an output that changes from run to run (a time, a samples/s) must be brought up to date when the notebook is
re-executed. Prose that should survive a re-run gives no such number and no direction in words ("several times
slower" went stale when a re-run reversed it): the cell that measures prints the comparison with
`tutorial.lessons.measure.comparison` or `trend`, and the prose points at its "compared here:" line
(`test_prose_claims.py` flags a measured comparison in words that does not).

A number that is not in this notebook is marked after it with an HTML comment (invisible in the notebook, in the
slides and in the speaker view). A marker covers the numbers before it in its paragraph, table or list item (a
notes line is one item), back to the previous marker:
- `<!-- cited: SOURCE -->`: a fact from elsewhere, e.g. `<!-- cited: seed 004's log -->`, `<!-- cited: Horovod
  docs -->`. When SOURCE starts with another notebook's number (`<!-- cited: 07 -->`, `<!-- cited: 02 [19] -->`),
  the numbers are matched against that notebook instead, so such a citation cannot go stale either.
- `<!-- derived: 18.9 ms / 476 µs -->`: a value computed from the notebook's numbers; every number inside the
  comment must match the notebook.
"""
from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # also run as a script: python tests/test_quoted_numbers.py X.ipynb
from cell_times import cell_seconds  # noqa: E402
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NOTES = ROOT / "slides" / "notes"

# Units after a number, longest first so that "ms" is not read as "m" + "s". A unit must end at a word boundary.
TIME_UNITS = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "seconds": 1.0,
              "second": 1.0}
RATE_UNITS = ["samples/s", "images/s", "steps/s", "it/s", "GB/s", "MB/s", "GiB/s", "TFLOPS", "TFLOP/s", "GFLOPS"]
RATIO_UNITS = ["x", "×", "%"]
SIZE_UNITS = ["GiB", "MiB", "KiB", "GB", "MB", "KB", "kB", "TB", "B"]
CLOCK_UNITS = ["minutes", "minute", "min", "hours", "hour", "h"]
UNITS = sorted([*TIME_UNITS, *RATE_UNITS, *RATIO_UNITS, *SIZE_UNITS, *CLOCK_UNITS], key=len, reverse=True)
UNIT = "|".join(re.escape(u) for u in UNITS)
# A number: thousands with commas, or digits, with an optional decimal part; then an optional unit. Not part of a
# word or an identifier (`fp16`, `O2`, `x86_64`, `cuda:0`), nor followed by more of a dotted version (`2.14.1`).
NUMBER = re.compile(
    rf"(?<![\w.#/:@$\\^])(?P<num>\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?|\d+(?:\.\d+)?)(?![\w]|\.\d|,\d{{3}})"
    rf"(?:(?P<unit>[x×](?![\w/]))|\s?(?P<spaced>{UNIT})(?![\w/]))?")
# Numbers everywhere in outputs: any decimal or integer, commas allowed.
OUTPUT_NUMBER = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?|(?<![\w.])\d*\.?\d+(?:[eE][-+]?\d+)?")
# A number right after one of these words is a version, not a measurement ("torch 2.14", "Lightning 2.x").
VERSIONED = re.compile(
    r"(?:torch|pytorch|python|cuda|nccl|cudnn|lightning|horovod|deepspeed|numpy|mpi|slurm|pbs|ipyparallel|jupyter|"
    r"jupyterlab|version|versions|v|release|releases|gcc|ubuntu|debian|rocm|apex|transformers|accelerate|triton|"
    r"compute capability|sm|ampere|hopper|python3|openmpi|torchrun|playwright|chromium|nbval|sm_)\s*$",
    re.IGNORECASE)
# The low end of a range whose high end carries the unit: "about 20-25 s", "15 to 25 s".
RANGE_LOW = re.compile(r"(?<![\w.])(?P<low>\d[\d,]*(?:\.\d+)?)\s?(?:-|\u2013|to)\s?$")
ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s")
COMMENT = re.compile(r"<!--(?!\s*(?:cited|derived)\s*:).*?-->", re.DOTALL)
MARKER = re.compile(r"<!--\s*(?P<kind>cited|derived)\s*:\s*(?P<text>[^\s-].*?)\s*-->", re.DOTALL)
# Text that never holds a quoted measurement: fenced blocks, code spans, LaTeX, comments, link targets, URLs, dates,
# clock times, scientific notation, cell references, "§3", "issue 29", "#94636".
SKIPPED = [
    re.compile(r"```.*?```", re.DOTALL),
    re.compile(r"``.+?``|`[^`\n]+`"),
    re.compile(r"\$\$.+?\$\$|\$[^$\n]+\$", re.DOTALL),
    re.compile(r"<!--.*?-->", re.DOTALL),
    re.compile(r"\]\([^)]*\)"),
    re.compile(r"https?://\S+"),
    re.compile(r"<[^>\n]+>"),
    re.compile(r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2})?)?"),
    re.compile(r"\b\d{1,2}:\d{2}(?::\d{2})?\b"),
    re.compile(r"\b\d+(?:\.\d+)?[eE][-+]?\d+\b"),
    re.compile(r"\b(?:md|cell|cells|Cell|Cells)?\s?\[\d+(?:\s*[-,–]\s*\d+)*\]"),
    re.compile(r"§\s?\d+(?:\.\d+)*"),
    re.compile(r"(?i)\b(?:issue|issues|review|round|seed|seeds|notebook|notebooks|section|sections|exercise|step|"
               r"stage|epoch|part|item|items|PR|pull)\s+#?\d+(?:\.\d+)*"),
    re.compile(r"#\d+"),
    re.compile(r"^\s*#{1,6}\s+\d+(?:\.\d+)*", re.MULTILINE),
]


@dataclass
class Quote:
    where: str        # "md[41] line 3" or "notes § Title"
    line: str         # the source line, for the message
    text: str         # the number as written, with its unit
    value: float
    unit: str
    source: str       # "" (this notebook's outputs) or a cited notebook's number
    low: float | None = None   # a range "20-25 s": any value in it matches


def blank(match: re.Match) -> str:
    """Keep offsets and line breaks, drop the text."""
    return re.sub(r"[^\n]", " ", match.group(0))


def measured_looking(text: str, prefix: str, unit: str) -> bool:
    if unit in CLOCK_UNITS:
        return False   # minutes and hours: the course plan's, compared by another test
    if not unit and VERSIONED.search(prefix):
        return False   # "torch 2.14"; with a unit it is a value again: "Horovod 2.2 s"
    decimal = "." in text
    if unit in SIZE_UNITS:
        return decimal
    return decimal or bool(unit)


def parse(number: str) -> float:
    return float(number.replace(",", ""))


def blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each paragraph, table or list item: a marker's reach."""
    found, current, first = [], [], 1
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or ITEM.match(line):
            if current:
                found.append((first, "\n".join(current)))
            current, first = ([line], lineno) if line.strip() else ([], lineno + 1)
        else:
            current.append(line)
    if current:
        found.append((first, "\n".join(current)))
    return found


def quotes_in(text: str, where: str, source: str = "", every_number: bool = False) -> list[Quote]:
    """Measured-looking numbers of one Markdown text. A marker covers the numbers before it in its paragraph, table
    row group or list item (back to the previous marker)."""
    found = []
    # Fenced code and comments (not markers) first: one with a blank line in it would otherwise be cut into
    # paragraphs with its ends apart.
    text = COMMENT.sub(blank, SKIPPED[0].sub(blank, text))
    for first, block in blocks(text):
        pieces, start = [], 0
        for marker in MARKER.finditer(block):
            pieces.append((start, block[start:marker.start()], marker))
            start = marker.end()
        pieces.append((start, block[start:], None))
        for offset, piece, marker in pieces:
            if marker is not None:
                kind, cited = marker["kind"], marker["text"]
                if kind == "derived":
                    found += quotes_in(cited, where, source, every_number=True)
                    continue   # the derived value itself is not matched; its operands are
                other = re.match(r"(?:notebook\s+)?(\d\d[ab]?|appendix)\b", cited)
                if not other:
                    continue   # a fact from outside the workbook, its source named
                piece_source = other.group(1)
            else:
                piece_source = source
            clean = piece
            for rule in SKIPPED:
                clean = rule.sub(blank, clean)
            for m in NUMBER.finditer(clean):
                num, unit = m["num"], m["unit"] or m["spaced"] or ""
                if unit in ("x", "\u00d7") and m["spaced"]:
                    unit = ""   # "196 x 1.04 s" multiplies; a ratio is written "1.8x"
                if not every_number and not measured_looking(num, clean[:m.start()], unit):
                    continue
                before = RANGE_LOW.search(clean[:m.start()])
                low = parse(before["low"]) if before and unit else None
                at = offset + m.start()
                lineno = first + block[:at].count("\n")
                column = at - (block.rfind("\n", 0, at) + 1)
                whole = block.splitlines()[lineno - first]
                # the words around the number, so a long notes line still shows where it is
                line = ("..." if column > 70 else "") + whole[max(0, column - 70):column + 60]
                found.append(Quote(f"{where} line {lineno}" if "\n" in text else where, line.strip(),
                                   m.group(0).strip(), parse(num), unit, piece_source, low))
    return found


def tolerance(number: str, value: float) -> float:
    """Half a unit of the last printed digit; an integer's trailing zeros are not significant (capped at 5%)."""
    digits = number.replace(",", "")
    if "." in digits:
        return 0.5 * 10 ** -len(digits.split(".")[1])
    zeros = len(digits) - len(digits.rstrip("0")) if value else 0
    return max(0.5, min(0.5 * 10 ** zeros, 0.05 * value))


def candidates(quote: Quote) -> list[float]:
    """The quoted value, and the same value in the units an output may print instead."""
    values = [quote.value]
    if quote.unit == "%":
        values.append(quote.value / 100)
    if quote.unit in TIME_UNITS:
        # the same time printed in s, ms or µs ("476 µs" as 0.476 ms; a profiler's "18.489ms" for "18.5 ms")
        seconds = quote.value * TIME_UNITS[quote.unit]
        values += [v for v in (seconds, seconds * 1e3, seconds * 1e6) if not math.isclose(v, quote.value)]
    return values


def matches(quote: Quote, outputs: list[float]) -> bool:
    number = re.match(r"[\d,.]+", quote.text).group(0).rstrip(".,")
    tol = tolerance(number, quote.value)
    for want in candidates(quote):
        scale = want / quote.value if quote.value else 1.0
        low = want if quote.low is None else quote.low * scale
        if any(low - tol * scale - 1e-12 <= got <= want + tol * scale + 1e-12 for got in outputs):
            return True
    return False


def output_text(notebook: dict) -> list[tuple[int, str]]:
    texts = []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code":
            continue
        for output in cell.get("outputs", []):
            parts = [output.get("text", "")] + [v for k, v in output.get("data", {}).items()
                                                if k.startswith("text/")]
            for part in parts:
                texts.append((index, "".join(part) if isinstance(part, list) else part))
    return texts


def output_numbers(notebook: dict) -> list[float]:
    """Every number the notebook shows: in its code cells' outputs, in their code (a setting the prose restates,
    `bucket_cap_mb=0.1`), and the cells' recorded run times ("the launch takes about 25 s")."""
    texts = [text for _, text in output_text(notebook)]
    texts += ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]
    # Run times in whole seconds only: finer, they would match any two-decimal number by chance.
    values = [float(round(t)) for c in notebook["cells"]
              if c["cell_type"] == "code" and (t := cell_seconds(c)) is not None]
    for text in texts:
        for m in OUTPUT_NUMBER.finditer(text):
            try:
                values.append(parse(m.group(0)))
            except ValueError:
                pass
    return values


TIME_UNIT = "|".join(map(re.escape, sorted(TIME_UNITS, key=len, reverse=True)))
TIMED_OUTPUT = re.compile(rf"(?<![\w.])(\d*\.?\d+)\s?(?:{TIME_UNIT})(?![\w/])")


def timed_numbers(notebook: dict) -> list[float]:
    """The times the notebook shows with their unit ("took 23 s", "0.476 ms") and its cells' recorded run times in
    whole seconds: what a time quoted as a range may match ("each launch takes about 20-25 s" must not match
    "23 batches")."""
    values = [float(round(t)) for c in notebook["cells"]
              if c["cell_type"] == "code" and (t := cell_seconds(c)) is not None]
    for _, text in output_text(notebook):
        values += [float(m.group(1)) for m in TIMED_OUTPUT.finditer(text)]
    return values


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def notebook_path(key: str) -> Path | None:
    """A notebook by its number or stem: "07", "03b", "appendix", "07_scaling_study"."""
    hits = [p for p in NOTEBOOKS if p.stem == key or p.stem.split("_")[0] == key]
    return hits[0] if len(hits) == 1 else None


def quotes_of(notebook: dict, notes: str | None) -> list[Quote]:
    found = []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] == "markdown":
            found += quotes_in("".join(cell["source"]), f"md[{index}]")
    if notes is not None:
        # section by section, as the slides show them ("## Title", then one bullet per line); the body is padded
        # with empty lines so that the line numbers in messages are the file's
        lines, title, start = notes.splitlines(), "(before the first section)", 0
        for lineno, line in enumerate([*lines, "## (end)"]):
            if line.startswith("## "):
                body = "\n" * start + "\n".join(lines[start:lineno])
                found += quotes_in(body + "\n", f"notes \u00a7 {title}")
                title, start = line[3:].strip(), lineno + 1
    return found


def timed_only(quote: Quote) -> bool:
    """A range of times: any number within it once matched ("20-25 s" matched "23 batches"), so only times match it.
    (A single time may restate a setting of the code, `timeout=10`, and matches any number.)"""
    return quote.low is not None and quote.unit in TIME_UNITS


def unmatched(path: Path, notebook: dict | None = None, notes: str | None = None) -> list[str]:
    """One message per quoted number of a notebook (and its notes) that its outputs do not show.

    `notebook` and `notes` default to the files on disk; pass them to check another version (e.g. an old commit)."""
    if notebook is None:
        notebook = load(path)
    if notes is None:
        notes_path = NOTES / f"{path.stem}.md"
        notes = notes_path.read_text(encoding="utf-8") if notes_path.exists() else None
    own, own_timed = output_numbers(notebook), timed_numbers(notebook)
    cache: dict[str, tuple[list[float], list[float]]] = {}
    problems = []
    for quote in quotes_of(notebook, notes):
        if quote.source:
            other = notebook_path(quote.source)
            if other is None:
                problems.append(f"{path.stem} {quote.where}: cited notebook {quote.source!r} does not exist "
                                f"({quote.text})")
                continue
            if other.stem not in cache:
                cache[other.stem] = output_numbers(load(other)), timed_numbers(load(other))
            (pool, timed), whose = cache[other.stem], other.stem
        else:
            pool, timed, whose = own, own_timed, path.stem
        if timed_only(quote):
            pool = timed
        if not matches(quote, pool):
            near = sorted(set(pool), key=lambda v: abs(v - quote.value))[:3]
            shown = ", ".join(f"{v:g}" for v in near) or "none"
            problems.append(f"{path.stem} {quote.where}: {quote.text!r} is not in {whose}'s outputs or code "
                            f"(nearest: {shown}) in: {quote.line}")
    return problems


if "pytest" in sys.modules:
    import pytest

    @pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
    def test_quoted_numbers_are_in_the_outputs(path):
        problems = unmatched(path)
        assert not problems, (
            f"{len(problems)} number(s) quoted in prose or notes are not in the stored outputs; fix the text, or mark"
            f" a fact from elsewhere with <!-- cited: SOURCE --> after it (see this file's docstring):\n"
            + "\n".join(problems))

    def fake(prose: str, output: str, code: str = "") -> dict:
        return {"cells": [{"cell_type": "markdown", "source": [prose]},
                          {"cell_type": "code", "source": [code], "outputs": [{"output_type": "stream",
                                                                                "text": [output]}]}]}

    @pytest.mark.parametrize("prose, output, found", [
        ("DDP takes 0.62 s a batch", "batch time 0.618 s", True),        # within the printed precision
        ("DDP takes 0.58 s a batch", "batch time 0.618 s", False),       # review 4's item 7
        ("about 4,800 samples/s", "4796 samples/s", True),               # trailing zeros are not significant
        ("about 4,800 samples/s", "6263 samples/s", False),
        ("the loss went 0.0645 to 0.1577", "test loss 0.0633, 0.1678", False),   # item 18
        ("accuracy 78.8%", "test accuracy 0.7883", True),                # a percent is also a fraction
        ("476 µs for 4 KiB", "0.476 ms", True),                          # the neighbouring unit
        ("a timeout of 300 s", "0.3", False),                            # ... not kiloseconds
        ("it took 1.8x less", "1.79", True),
        ("each launch takes about 20-25 s", "took 23 s", True),          # a range
        ("each launch takes about 20-25 s", "took 31 s", False),
        ("each launch takes about 20-25 s", "23 batches, took 9 s", False),   # a range of times: times only
        ("0.58 s <!-- cited: seed 004's README -->", "nothing", True),   # a fact from elsewhere, its source named
        ("0.58 s <!-- cited: -->", "nothing", False),                    # a marker needs a source
        ("0.6833 <!-- derived: mean of 0.9000 and 0.4667 -->", "0.9000 0.4667", True),
        ("0.6833 <!-- derived: mean of 0.9000 and 0.4667 -->", "0.9000 0.5000", False),   # its operands checked
        ("0.58 s. <!-- cited: seed 004 -->\n\nthen 0.58 s", "nothing", False),     # a marker covers its paragraph
        ("8 GPUs, 2 ranks, 45 batches, seed 004, torch 2.14, 40 minutes, 16 MiB", "", True),   # not measurements
        ("`lr=0.05` in [24] on 2026-11-26, 1e-5, section 7.1", "", True),
        ("bucket_cap_mb of 0.1 MB", "", True),                            # a setting the code shows ...
        ("196 x 1.04 s <!-- cited: seed 004 -->", "", True),              # a product, not a ratio
        ("Horovod 2.2 s, DDP 2.6 s", "Horovod 4.7 s, DDP 1.7 s", False),  # a unit: not a version number
        ("```\nx = 0.58\n\ny = 1.5\n```", "", True),                   # code, blank line and all
        ("0.5 s <!-- cited: 99 [3] -->", "0.5", False),                  # a cited notebook must exist
    ], ids=lambda v: v if isinstance(v, bool) else re.sub(r"\W+", "_", v)[:40])
    def test_matching_rule(prose, output, found):
        code = "DDP(model, bucket_cap_mb=0.1)" if "bucket" in prose else ""
        problems = unmatched(Path("fake.ipynb"), fake(prose, output, code), notes="")
        assert (not problems) is found, problems

    def test_command_line(tmp_path):
        import subprocess
        script = [sys.executable, __file__]
        bad = subprocess.run([*script, str(tmp_path / "missing.ipynb")], capture_output=True, text=True)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "is not a notebook file" in bad.stderr
        stale = tmp_path / "stale.ipynb"
        stale.write_text(json.dumps(fake("takes 0.58 s a batch", "batch time 0.618 s")))
        done = subprocess.run([*script, str(stale)], capture_output=True, text=True)
        assert done.returncode == 1 and "'0.58 s' is not in stale's outputs or code (nearest: 0.618" in done.stdout

    def test_the_checker_finds_what_984c965_got_wrong():
        """Review 4's contradictions that are numbers, on the commit it read: stale losses in 08's and 10's notes,
        seed 004's 0.58 s in 07 where 02 quotes the log's 0.618 s. The commit's files are what
        tests/fixtures/984c965/ keeps of them (prose, code and text outputs), so no git history is needed."""
        def show(path: str) -> str:
            kept = ROOT / "tests" / "fixtures" / "984c965" / (f"{path}.json" if path.endswith(".ipynb") else path)
            return kept.read_text(encoding="utf-8")

        found = {}
        for stem in ("07_scaling_study", "08_lightning", "10_when_things_go_wrong"):
            notebook = json.loads(show(f"notebooks/{stem}.ipynb"))
            found[stem] = "\n".join(unmatched(ROOT / "notebooks" / f"{stem}.ipynb", notebook,
                                              show(f"slides/notes/{stem}.md")))
        assert "md[4] line 13: '0.58 s'" in found["07_scaling_study"]
        assert "'0.0645'" in found["08_lightning"] and "'0.1577'" in found["08_lightning"]
        assert "'0.1951'" in found["10_when_things_go_wrong"]


def main(argv: list[str]) -> int:
    if not argv or any(a in ("-h", "--help") for a in argv):
        print("usage: python tests/test_quoted_numbers.py notebooks/X.ipynb [...]: quoted numbers its outputs "
              "do not show")
        return 0 if argv else 2
    status = 0
    for arg in argv:
        path = Path(arg)
        if path.suffix != ".ipynb" or not path.is_file():
            print(f"error: {arg} is not a notebook file (give e.g. notebooks/02_data_parallel.ipynb)",
                  file=sys.stderr)
            return 2
        problems = unmatched(path.resolve())
        print(f"{path}: {len(problems)} unmatched" + "".join(f"\n  {p}" for p in problems))
        status = status or (1 if problems else 0)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The course plan, the notebooks' first cells and the speaker notes state the same minutes and prerequisites.

Four places give a notebook's teaching time: its first markdown cell ("**Time:** about N minutes"), the first section
of its speaker notes ("- N minutes."), the sum of the notes' sections (each "## Section" starts with "- N minutes.",
and every "## " section of the notebook has one), and the rows of `slides/course_plan.md`. Review 4 found them 5-35
minutes apart, and a core day that the plan said fits in 4 h 55 while the notes' own minutes came to about 5 h 30.
Each check below returns the problems it finds, so that `test_the_checks_find_what_review_4_found` can run the same
checks on 984c965's files (the negative control), which tests/fixtures/984c965/ keeps (what the checks read of
them), so that the controls need no git history.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from plan_table import plan_table

ROOT = Path(__file__).resolve().parents[1]
STEMS = sorted(p.stem for p in ROOT.glob("notebooks/*.ipynb"))
CORE_LIMIT = 300  # minutes of teaching a core day may hold: 5 h, setup and breaks not counted
REVIEWED = "984c965"  # main as review 4 read it
FIXTURES = ROOT / "tests" / "fixtures"  # old commits' files, for the negative controls (see its README.md)


def short(stem: str) -> str:
    """'03a_ddp_by_hand' -> '03a', 'appendix_job_scripts' -> 'appendix': how the plan and the prose name notebooks."""
    return stem.split("_")[0]


class Files:
    """The files the checks read: the working tree, or (for the negative controls) an old commit's, as
    tests/fixtures/<commit>/ keeps them (a notebook as `<name>.ipynb.json`); `worktree` names files read from the
    working tree all the same."""

    def __init__(self, commit: str | None = None, worktree: tuple[str, ...] = ()):
        self.commit, self.worktree = commit, worktree

    def read(self, path: str) -> str:
        if self.commit is None or path in self.worktree:
            return (ROOT / path).read_text()
        return (FIXTURES / self.commit / (f"{path}.json" if path.endswith(".ipynb") else path)).read_text("utf-8")

    def stems(self) -> list[str]:
        if self.commit is None:
            return STEMS
        return sorted(p.name.removesuffix(".ipynb.json") for p in (FIXTURES / self.commit / "notebooks").glob(
            "*.ipynb.json"))


# ---- what each place says ----

def notes_sections(files: Files, stem: str) -> list[tuple[str, int | None, str]]:
    """(heading, minutes or None, body) of each '## ' section of the notes; minutes from its first bullet."""
    sections, current = [], None
    for line in files.read(f"slides/notes/{stem}.md").splitlines():
        if line.startswith("## "):
            current = [line[3:].strip(), []]
            sections.append(current)
        elif current is not None:
            current[1].append(line)
    out = []
    for heading, body in sections:
        first = next((l for l in body if l.startswith("- ")), "")
        m = re.match(r"- (?:About |about )?(\d+) minutes?\b", first)
        out.append((heading, int(m.group(1)) if m else None, "\n".join(body)))
    return out


def normalize(text: str) -> str:
    """A heading as scripts/slides_export.py matches notes to it: no markup, lower case, single spaces."""
    text = re.sub(r"[`*_]", "", text.lstrip("#")).replace("\u00b7", " ")
    return " ".join(text.lower().split())


def notebook_sections(files: Files, stem: str) -> list[str]:
    """The notebook's '## ' headings (outside code blocks): the sections a learner sees, each to be timed."""
    found = []
    for cell in json.loads(files.read(f"notebooks/{stem}.ipynb"))["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        fenced = False
        for line in "".join(cell["source"]).splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif not fenced and line.startswith("## "):
                found.append(line[3:].strip())
    return found


def first_cell(files: Files, stem: str) -> str:
    nb = json.loads(files.read(f"notebooks/{stem}.ipynb"))
    return "".join(next(c for c in nb["cells"] if c["cell_type"] == "markdown")["source"])


def stated_minutes(cell: str) -> int | None:
    m = re.search(r"\*\*(?:Estimated time|Time):?\*\*:?\s*(?:about\s+)?(\d+)\s+minutes", cell)
    return int(m.group(1)) if m else None


def needs_of(text: str) -> set[str]:
    """Notebooks named in a 'Needs' sentence ('03' alone means 03a and 03b)."""
    found = set()
    for name in re.findall(r"(?<![\w.])(\d\d[ab]?|appendix)(?=[_`\s,).;]|$)", text):
        found |= {"03a", "03b"} if name == "03" else {name}
    return found


def stated_needs(cell: str) -> set[str] | None:
    """The notebooks in the first cell's Needs sentence (up to its first full stop), None if it has none."""
    m = re.search(r"\*\*(?:Needs|Before this notebook|Before this appendix):?\*\*:?(.*?)(?:\.\s|\.$|$)", cell, re.S)
    return needs_of(m.group(1)) if m else None


def skip_list(files: Files, stem: str) -> tuple[int, list[tuple[str, int]], str] | None:
    """The notes' '- Skip when late (N minutes saved ...): A (n); B (m).' bullet: N, the (section, minutes) items and
    their text."""
    m = re.search(r"^- Skip when late \((\d+) minutes? saved[^)]*\): (.*)\.$",
                  files.read(f"slides/notes/{stem}.md"), re.M)
    if not m:
        return None
    items = [re.match(r"(.*?) \((\d+)", item).groups() for item in m.group(2).split("; ")]
    return int(m.group(1)), [(name, int(minutes)) for name, minutes in items], m.group(2)


def plan_rows(files: Files) -> list[dict]:
    """The plan table's rows: slot (core/track/setup), notebook id, the notebook column, minutes, needs."""
    rows, slot = [], ""
    for first, row in plan_table(files.read("slides/course_plan.md")):
        slot = first or slot
        minutes = re.search(r"(\d+) min", row.get("teaching", ""))
        ident = re.match(r"(\d\d[ab]?|appendix)\b", row.get("notebook", ""))
        rows.append({"slot": slot.strip("* ").lower(), "id": ident.group(1) if ident else None,
                     "text": row.get("notebook", ""), "minutes": int(minutes.group(1)) if minutes else None,
                     "needs": None if "needs" not in row else needs_of(row["needs"])})
    return rows


def named_parts(text: str, sections) -> list[tuple[str, int | None, str]] | None:
    """The notes sections a plan row names ('section 11, exercises 3-4', 'rehearsal 5'), None where it names none."""
    if "all but" in text:
        return None
    wanted = []
    for kind, a, b in re.findall(r"(sections?|exercises?|rehearsals?) (\d+)(?:-(\d+))?", text.lower()):
        for k in range(int(a), int(b or a) + 1):
            wanted.append({"e": f"Exercise {k}", "r": f"Rehearsal {k}", "s": f"{k}. "}[kind[0]])
    if not wanted:
        return None
    return [s for s in sections if any(s[0].startswith(w) for w in wanted)]


# ---- the checks ----

def minutes_problems(files: Files) -> list[str]:
    """Every notes section is timed and they add up to the notes' total, which the first cell and the plan state."""
    problems = []
    rows = plan_rows(files)
    for stem in files.stems():
        sections = notes_sections(files, stem)
        total = sections[0][1]
        untimed = [h for h, m, _ in sections if m is None]
        if untimed:
            problems.append(f"{stem}: notes sections without '- N minutes.': {untimed}")
        keys = [normalize(h) for h, _, _ in sections]
        unnoted = [h for h in notebook_sections(files, stem) if not any(normalize(h).startswith(k) for k in keys)]
        if unnoted:
            problems.append(f"{stem}: notebook sections with no notes section, so no minutes: {unnoted}")
        parts = sum(m or 0 for _, m, _ in sections[1:])
        if parts != total:
            problems.append(f"{stem}: the notes' sections add up to {parts} min, their first section says {total}")
        cell = stated_minutes(first_cell(files, stem))
        if cell != total:
            problems.append(f"{stem}: the first cell says {cell} min, the notes {total}")
        mine = [r for r in rows if r["id"] == short(stem)]
        planned = sum(r["minutes"] or 0 for r in mine)
        if planned != total:
            problems.append(f"{stem}: the plan gives {planned} min, the notes {total}")
        if len(mine) > 1 and all(named_parts(r["text"], sections) is None for r in mine):
            problems.append(f"{stem}: split over {len(mine)} rows of the plan, none naming its sections")
        for r in mine:
            named = named_parts(r["text"], sections) if len(mine) > 1 else None
            if named is not None and sum(m or 0 for _, m, _ in named) != r["minutes"]:
                problems.append(f"{stem}: the plan's row '{r['text']}' has {r['minutes']} min, its sections "
                                f"{sum(m or 0 for _, m, _ in named)}")
    return problems


def core_day_problems(files: Files) -> list[str]:
    """The core day, counted from the notes, is at most 5 h; setup is budgeted; the stated totals add up."""
    problems = []
    rows = plan_rows(files)
    plan = files.read("slides/course_plan.md")
    core = [r for r in rows if r["slot"].startswith("core")]
    by_notes = 0
    for r in core:
        stem = next(s for s in files.stems() if short(s) == r["id"])
        sections = notes_sections(files, stem)
        others = sum(x["minutes"] or 0 for x in rows if x["id"] == r["id"] and x is not r)
        by_notes += sum(m or 0 for _, m, _ in sections[1:]) - others  # a split notebook: the rest is elsewhere
    if by_notes > CORE_LIMIT:
        problems.append(f"the core day is {by_notes} min of teaching by the notes' sections, more than {CORE_LIMIT}")
    stated = re.search(r"Core day: (\d+) min of teaching", plan)
    if not stated or int(stated.group(1)) != sum(r["minutes"] or 0 for r in core):
        problems.append(f"the plan's 'Core day: N min of teaching' ({stated and stated.group(1)}) is not the sum of "
                        f"its core rows ({sum(r['minutes'] or 0 for r in core)})")
    setup = [r for r in rows if "setup" in r["slot"]]
    if not setup or not setup[0]["minutes"]:
        problems.append("the plan budgets no setup block (JupyterLab on a compute node, engines, data)")
    whole = re.search(r"setup (\d+) min and breaks (\d+) min.*?: (\d+) min in all", plan, re.S)
    if not whole or stated is None or int(whole.group(3)) != int(stated.group(1)) + int(whole.group(1)) + int(
            whole.group(2)):
        problems.append("the plan's 'setup N min and breaks M min ...: T min in all' is missing or does not add up")
    elif setup and setup[0]["minutes"] != int(whole.group(1)):
        problems.append(f"the setup row says {setup[0]['minutes']} min, the text {whole.group(1)}")
    # with its setup block, said as it is: within 5 h, or by how much over (review 5: 311 min, said nowhere)
    if stated and setup and setup[0]["minutes"]:
        total = int(stated.group(1)) + setup[0]["minutes"]
        honest = "within 5 h" if total <= CORE_LIMIT else f"{total - CORE_LIMIT} min over 5 h"
        for name, text in (("the plan", plan), ("README", files.read("README.md"))):
            text = " ".join(text.split())
            said = re.search(r"(\d+) min with its setup block|setup block the core day is (\d+) min", text)
            if not said or int(said.group(1) or said.group(2)) != total or honest not in text:
                problems.append(f"{name} does not say that the core day with its setup block is {total} min, "
                                f"{honest}")
    readme = re.search(r"core day is (\d+) min of teaching", files.read("README.md"))
    if not readme or stated is None or readme.group(1) != stated.group(1):
        problems.append(f"README's 'core day is N min of teaching' ({readme and readme.group(1)}) is not the plan's")
    return problems


def skip_problems(files: Files) -> list[str]:
    """Each notes file lists what to skip when late: real sections, their minutes, the sum; the plan lists the same."""
    problems = []
    plan = files.read("slides/course_plan.md")
    for stem in files.stems():
        found = skip_list(files, stem)
        if found is None:
            problems.append(f"{stem}: the notes have no '- Skip when late (N minutes saved ...): ...' line")
            continue
        saved, items, raw = found
        sections = notes_sections(files, stem)
        for name, minutes in items:
            match = [m for h, m, _ in sections[1:] if h.startswith(name)]
            if match != [minutes]:
                problems.append(f"{stem}: skip '{name}' ({minutes} min) is not one notes section of that length")
        if saved != sum(m for _, m in items):
            problems.append(f"{stem}: the skip list saves {sum(m for _, m in items)} min, it says {saved}")
        line = re.search(rf"^- {re.escape(short(stem))} \((\d+) min\): (.*)\.$", plan, re.M)
        if not line or (int(line.group(1)), line.group(2)) != (saved, raw):
            problems.append(f"{stem}: the plan's skip-when-late line is not the notes' ({saved} min: {raw})")
    return problems


def needs_problems(files: Files) -> list[str]:
    """The plan's needs column and the first cells name the same notebooks; nothing needs a notebook taught later."""
    problems = []
    rows = plan_rows(files)
    if not rows or rows[0]["needs"] is None:
        return ["the plan's table has no 'needs' column"]
    ids = {short(s) for s in files.stems()}
    seen = set()
    for r in rows:
        if r["id"] is None:
            continue
        stem = next((s for s in files.stems() if short(s) == r["id"]), None)
        if stem is None:  # a row newer than the files read (the negative control reads an old commit's notebooks)
            problems.append(f"the plan names notebook {r['id']}, which does not exist")
            continue
        cell = stated_needs(first_cell(files, stem))
        if cell is None:
            problems.append(f"{stem}: the first cell states no **Needs:**")
        elif cell != r["needs"]:
            problems.append(f"{stem}: the first cell needs {sorted(cell)}, the plan {sorted(r['needs'])}")
        if r["needs"] - ids:
            problems.append(f"{stem}: needs notebooks that do not exist: {sorted(r['needs'] - ids)}")
        later = (r["needs"] | (cell or set())) - seen
        if later:  # the core day comes first in the table, each track in its order
            problems.append(f"{stem} ({r['slot']}): needs {sorted(later)}, which the plan puts after it (or in a "
                            f"track, for a core notebook)")
        seen.add(r["id"])
    return problems


CHECKS = [minutes_problems, core_day_problems, skip_problems, needs_problems]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_plan_notebooks_and_notes_agree(check):
    problems = check(Files())
    assert not problems, "\n".join(problems)


def test_the_plan_names_every_notebook_and_a_core_day():
    rows = plan_rows(Files())
    assert {r["id"] for r in rows if r["id"]} == {short(s) for s in STEMS}
    assert any(r["slot"].startswith("core") for r in rows) and any(r["slot"].startswith("track") for r in rows)


def test_the_parsers_read_what_they_should():
    """The regular expressions above, on literal text (so a check cannot pass by reading nothing)."""
    assert stated_minutes("**Time:** about 44 minutes: 25 for the lesson") == 44
    assert stated_minutes("**Estimated time:** 10 minutes of reading") == 10
    assert stated_minutes("**Time**: about 60 minutes. **Needs**: notebooks 03 and 09.") == 60
    assert stated_needs("**Time**: about 60 minutes. **Needs**: notebooks 03 and 09.") == {"03a", "03b", "09"}
    assert stated_needs("**Needs:** `01_single_device` (the\ntrainer it extends) and `03a_ddp_by_hand`. No GPU, "
                        "unlike 05_horovod.") == {"01", "03a"}
    assert stated_needs("**Needs:** `make install` done once; it registers the kernel.") == set()
    assert stated_needs("no such line") is None
    sections = [("10 · When", 60, ""), ("11. Two DDP errors", 4, ""), ("Exercise 3", 4, ""), ("Exercise 4", 5, ""),
                ("Exercise 1", 4, "")]
    assert [s[0] for s in named_parts("10 section 11, exercises 3-4", sections)] == [
        "11. Two DDP errors", "Exercise 3", "Exercise 4"]
    assert named_parts("10 when things go wrong (all but section 11)", sections) is None
    rehearsals = [("Rehearsal 5", 6, ""), ("Rehearsal 1", 5, "")]
    assert [s[0] for s in named_parts("06 rehearsal 5: a real Slurm", rehearsals)] == ["Rehearsal 5"]


def test_the_checks_find_what_review_4_found():
    """Negative control: the same checks on the files review 4 read (main at 984c965) find its problems."""
    files = Files(REVIEWED)
    minutes = "\n".join(minutes_problems(files))
    assert "08_lightning: the first cell says 40 min, the notes 30" in minutes  # review 4, item 17
    assert "06_multi_node: the plan gives 40 min, the notes 45" in minutes  # item 15
    assert "10_when_things_go_wrong: notes sections without" in minutes  # item 23: section 11 untimed
    assert "07_scaling_study: the notes' sections add up to" in minutes  # item 24
    assert "06_multi_node: notebook sections with no notes section" in minutes  # 'Without a scheduler', untimed
    core = "\n".join(core_day_problems(files))
    assert "more than 300" in core and "no setup block" in core
    assert len(skip_problems(files)) == len(files.stems())  # no notes file had a skip list
    assert needs_problems(files) == ["the plan's table has no 'needs' column"]
    # Its first cells against today's plan: core 06 needed track 05 (items 16), 03a and 03b needed less than they use.
    mixed = "\n".join(needs_problems(Files(REVIEWED, worktree=("slides/course_plan.md",))))
    assert "06_multi_node (core day): needs ['05'], which the plan puts after it" in mixed
    assert "06_multi_node: the first cell needs ['03a', '03b', '05'], the plan ['03a', '03b']" in mixed


def test_the_plan_is_what_its_script_writes_from_the_notes_and_the_stored_runs(tmp_path):
    """slides/course_plan.md and README's core-day sentence are generated (scripts/course_plan.py, run by `make
    notebooks`): a hand edit or a notes change without regenerating fails here, and so does a stale copy."""
    script = ROOT / "scripts" / "course_plan.py"
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # negative control: the same script over a copy whose plan lost a row's minutes must report it
    copy = tmp_path / "repo"
    (copy / "scripts").mkdir(parents=True)
    for name in ("course_plan.py", "cell_times.py"):
        (copy / "scripts" / name).write_text((ROOT / "scripts" / name).read_text())
    for folder in ("slides/notes", "notebooks"):
        (copy / folder).mkdir(parents=True)
        for f in (ROOT / folder).glob("*.md" if "notes" in folder else "*.ipynb"):
            (copy / folder / f.name).write_text(f.read_text())
    (copy / "README.md").write_text((ROOT / "README.md").read_text())
    plan = (ROOT / "slides" / "course_plan.md").read_text()
    (copy / "slides" / "course_plan.md").write_text(plan.replace("| 36 min |", "| 35 min |", 1))
    proc = subprocess.run([sys.executable, str(copy / "scripts" / "course_plan.py"), "--check"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "slides/course_plan.md differ" in proc.stderr


def test_the_plan_and_readme_say_where_a_one_gpu_attendees_ranks_go_as_the_allocation_decides():
    """One GPU per attendee: the trainers that cannot share a GPU run on the CPU with the smoke preset's sizes
    (launch.allocation.sized_for_cpu); 4e6582a's plan said workshop-cpu sizes and left out tensor/pipeline parallel."""
    from tutorial.launch import allocation as policy
    assert policy.CPU_PRESET == "smoke" and set(policy.GPU_SHARING_TRAINERS) == {"ddp", policy.BY_HAND}
    plan = (ROOT / "slides" / "course_plan.md").read_text().split("Where ranks go", 1)[1].split("\n\n")[0]
    readme = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| 1 (one GPU"))
    for text in (" ".join(plan.split()), readme):
        assert "smoke" in text and "workshop-cpu" not in text, text
        for library in ("Horovod", "FSDP", "DeepSpeed", "Lightning", "tensor/pipeline parallel", "SyncBatchNorm"):
            assert library in text, (library, text)


def one_gpu_cpu_notebooks(notebooks: dict[str, str]) -> list[str]:
    """The notebooks (their two-character numbers) whose cells allocate ranks for a trainer that cannot share a GPU,
    read from the cells' own `notebook.allocation(..., trainer="x")` calls: with one GPU per attendee they train on
    the CPU (launch.allocation)."""
    from tutorial.launch import allocation as policy
    found = set()
    for stem, text in notebooks.items():
        for code in (c for c in json.loads(text)["cells"] if c["cell_type"] == "code"):
            for trainer in re.findall(r"allocation\([^)]*trainer=\"(\w+)\"", "".join(code["source"])):
                if trainer not in policy.GPU_SHARING_TRAINERS:
                    found.add(stem[:2])
    return sorted(found)


def plan_gpu_cpu_notebooks(plan: str) -> list[str]:
    """The notebooks the plan's GPU column says train on the CPU with one GPU per attendee."""
    said = re.search(r"With one GPU per attendee.*?: ([\d, and]+) then train on the CPU", " ".join(plan.split()))
    return sorted(re.findall(r"\d\d", said.group(1))) if said else []


def test_the_plan_gpu_column_names_the_notebooks_that_train_on_the_cpu_with_one_gpu():
    """The GPU column's estimates are a full node's (2 ranks on 2 GPUs); with one GPU per attendee the notebooks that
    allocate for Horovod, Lightning, FSDP, tensor/pipeline parallel train on the CPU, and the plan names them."""
    notebooks = {p.stem: p.read_text() for p in ROOT.glob("notebooks/[0-9]*.ipynb")}
    expected = one_gpu_cpu_notebooks(notebooks)
    assert expected == ["05", "08", "09", "11", "12"]
    assert plan_gpu_cpu_notebooks((ROOT / "slides" / "course_plan.md").read_text()) == expected
    # negative control: a notebook that allocates for DDP only does not count; one more for FSDP does
    for_fsdp = 'allocation(2, cfg, trainer=\\"fsdp\\")'
    notebooks["03b_ddp_trainer"] = notebooks["03b_ddp_trainer"].replace("allocation(2, cfg)", for_fsdp)
    assert one_gpu_cpu_notebooks(notebooks) == ["03", "05", "08", "09", "11", "12"]


def test_the_day_with_its_setup_block_is_said_as_it_is():
    """Negative control: 4e6582a's plan and README gave 291 min of teaching "plus setup 20 min" and never said that
    the two together, 311 min, are 11 min over 5 h (review 5, section 5)."""
    files = Files("4e6582a")
    found = [p for p in core_day_problems(files) if "with its setup block" in p]
    assert len(found) == 2 and all("311 min, 11 min over 5 h" in p for p in found), found

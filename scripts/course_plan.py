"""Write slides/course_plan.md (and the core day's minutes in README.md) from the speaker notes' minutes and the
notebooks' stored cell times. `make notebooks` runs it after re-executing; `--check` (tests/test_course_plan.py)
exits 1 if either file differs from what it would write.

    python scripts/course_plan.py [--check]
"""
import re
import sys
import textwrap
from pathlib import Path

from cell_times import cell_seconds  # scripts/, this script's folder
ROOT = Path(__file__).resolve().parents[1]

def notes(stem):
    text = (ROOT / "slides/notes" / f"{stem}.md").read_text()
    secs, cur = [], None
    for line in text.splitlines():
        if line.startswith("## "):
            cur = [line[3:].strip(), None]; secs.append(cur)
        elif cur is not None and cur[1] is None and line.startswith("- "):
            m = re.match(r"- (?:About |about )?(\d+) minutes?\b", line)
            cur[1] = int(m.group(1)) if m else None
    skip = re.search(r"^- Skip when late \((\d+) minutes? saved[^)]*\): (.*)\.$", text, re.M)
    return secs, (int(skip.group(1)), skip.group(2))

def recorded(stem):
    """The notebook's recorded run time: its code cells' execution times stored with the outputs, and the run's day."""
    import json
    cells = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text())["cells"]
    total, day = 0.0, None
    for c in cells:
        seconds = cell_seconds(c) if c["cell_type"] == "code" else None
        if seconds is not None:
            total += seconds
            day = day or c["metadata"]["execution"]["iopub.execute_input"][5:10]
    return f"{total:.0f} s ({day})"


STEMS = ["00_setup", "01_single_device", "02_data_parallel", "03a_ddp_by_hand", "03b_ddp_trainer", "04_mixed_precision",
         "05_horovod", "06_multi_node", "07_scaling_study", "08_lightning", "09_sharded_training",
         "10_when_things_go_wrong", "11_model_parallelism", "12_performance_clinic", "appendix_job_scripts"]
T = {s: notes(s)[0][0][1] for s in STEMS}
secs10 = notes("10_when_things_go_wrong")[0]
errors = next(h for h, _ in secs10 if "Two DDP errors" in h).split(".")[0]  # its section number
track10 = sum(m for h, m in secs10 if h.startswith((f"{errors}. ", "Exercise 3", "Exercise 4")))
lab10 = next(h for h, _ in secs10 if "hang lab" in h).split(".")[0]  # its section number
hanglab10 = sum(m for h, m in secs10 if h.startswith(f"{lab10}. "))
core10 = T["10_when_things_go_wrong"] - track10 - hanglab10
track06 = sum(m for h, m in notes("06_multi_node")[0] if h.startswith("Rehearsal 5"))
core06 = T["06_multi_node"] - track06

# slot, notebook column, minutes, needs, CPU run, GPU run (estimated)
ROWS = [
 ("**core day**", "00 setup", T["00_setup"], "-", recorded("00_setup"), "< 1 min"),
 ("", "01 single device", T["01_single_device"], "00", recorded("01_single_device"), "3-5 min"),
 ("", "03a DDP by hand", T["03a_ddp_by_hand"], "00, 01", recorded("03a_ddp_by_hand"), "1-2 min"),
 ("", "03b the DDP trainer (+ capstone)", T["03b_ddp_trainer"], "01, 03a", recorded("03b_ddp_trainer"), "8-12 min"),
 ("", "06 multi-node (all but rehearsal 5)", core06, "03a, 03b", recorded("06_multi_node") + ", all of 06", "~3 min"),
 ("", "07 scaling study", T["07_scaling_study"], "03a, 03b", recorded("07_scaling_study"), "2-5 min"),
 ("", f"10 when things go wrong (all but sections {errors}-{lab10}, exercises 3-4)", core10, "03a, 03b",
  recorded("10_when_things_go_wrong") + ", all of 10", "5-10 min"),
 ("**track: mixed precision**", "04 mixed precision", T["04_mixed_precision"], "01, 03a, 03b",
  recorded("04_mixed_precision"), "5-10 min"),
 ("**track: frameworks**", "05 Horovod", T["05_horovod"], "00, 03a, 03b", recorded("05_horovod"), "8-12 min"),
 ("", "08 Lightning", T["08_lightning"], "03b", recorded("08_lightning"), "6-10 min"),
 ("**track: memory**", "09 sharded (ZeRO, FSDP)", T["09_sharded_training"], "03a, 03b", recorded("09_sharded_training"),
  "10-15 min"),
 ("**track: beyond data parallel**", "11 tensor, pipeline, 2D", T["11_model_parallelism"], "03a, 03b, 09",
  recorded("11_model_parallelism"), "2-4 min"),
 ("**track: performance clinic**", "12 memory, collectives, traces, bugs, layouts",
  T["12_performance_clinic"], "07, 09, 11", recorded("12_performance_clinic"), "3-5 min"),
 ("**track: two DDP errors**", f"10 section {errors}, exercises 3-4", track10, "03a, 03b", "(in 10's run)", "(in 10's run)"),
 ("**track: a hang lab**", f"10 section {lab10}: dumps at a timeout, torchfrtrace", hanglab10, "03a, 03b",
  "(in 10's run)", "(in 10's run)"),
 ("**track: history**", "02 DataParallel", T["02_data_parallel"], "01", recorded("02_data_parallel"), "3-5 min"),
 ("**track: clusters**", "06 rehearsal 5: virtual nodes, a real Slurm (root)", track06, "03a, 03b", "(in 06's run)",
  "(in 06's run)"),
 ("", "appendix: job scripts (PBS, Slurm)", T["appendix_job_scripts"], "06", recorded("appendix_job_scripts"), "same"),
]
SETUP, BREAKS = 20, 90
CORE_STEMS = ["00_setup", "01_single_device", "03a_ddp_by_hand", "03b_ddp_trainer", "06_multi_node", "07_scaling_study",
              "10_when_things_go_wrong"]
core_skip = sum(notes(s)[1][0] for s in CORE_STEMS)
core = sum(r[2] for r in ROWS[:7])
allmin = sum(T.values())

def hm(m):
    return f"{m // 60} h {m % 60:02d} min"

# Whether teaching and setup together fit 5 hours, said as it is (review 5: 291 + 20 = 311 min did not, and only the
# arithmetic showed it): over, the setup goes ahead of the day or one skip-when-late item goes.
fits = ("within 5 h" if core + SETUP <= 300 else
        f"{core + SETUP - 300} min over 5 h: a 5-hour day needs the setup done before it starts (JupyterLab running on "
        f"the compute node) or {core + SETUP - 300} min of the skip-when-late lists below")

out = [
"# Course plan (for the instructor's first and last slide)", "",
"One page for the whole course; the decks are per notebook (`make slides`). Teaching: the minutes of the notebook's",
"speaker notes (`slides/notes/`), exercises included, which its first cell states too. Needs: the notebooks whose",
"code or ideas it uses. CPU: the run time of the notebook's code cells recorded with its stored outputs (`smoke`",
"preset, the 2-core machine of `make notebooks`, the run's day in brackets), the figure the slides show per section.",
"GPU: **estimated** for the `workshop` preset on",
"A100/H100 with 2 ranks on 2 GPUs (README's full-node row), not yet measured (`make gpu-check` records real ones): on a",
"GPU node start a cell's trainings and talk over them. With one GPU per attendee the ranks go as the paragraph on",
"ranks below says: 05, 08, 09, 11 and 12 then train on the CPU with `smoke`'s sizes, in about their CPU run.",
"`tests/test_course_plan.py` checks that this table, the notebooks and the notes state the same minutes.", "",
"| | notebook | teaching | needs | CPU run | GPU run (est.) |",
"|---|---|---|---|---|---|",
f"| **setup** (before 00) | JupyterLab on a compute node, engines, data | {SETUP} min | | | |",
]
for slot, name, m, needs, cpu, gpu in ROWS:
    out.append(f"| {slot} | {name} | {m} min | {needs} | {cpu} | {gpu} |")
out += ["",
*textwrap.fill(" ".join([f"**Core day: {core} min of teaching ({hm(core)})**, at most 5 h, plus setup {SETUP} min and breaks {BREAKS} min (15 in the",
f"morning, 60 for lunch, 15 in the afternoon): {core + SETUP + BREAKS} min in all, {hm(core + SETUP + BREAKS)}, 9:00 to about "
f"{9 + (core + SETUP + BREAKS) // 60}:{(core + SETUP + BREAKS) % 60:02d}.",
f"**With its setup block the core day is {core + SETUP} min ({hm(core + SETUP)}), {fits}.**",
"A live room types slower and pairs take longer than these minutes (review 4 guessed 15-25 % for the exercises): the",
f"{300 - core} min left to 5 h and the core notebooks' skip-when-late lists below ({core_skip} min) are that margin,",
f"{round(100 * (300 - core + core_skip) / core)} % of the core day. 03b's capstone is the day's **bring",
"your own script**: every attendee runs `tutorial check-ddp` (03b's last section) on a DDP script of their own, or on",
"the capstone; when the morning runs late it becomes homework, or the day's last 10 minutes."]), 118).split("\n"),
f"All notebooks together: {allmin} min ({hm(allmin)}).", "",
"**What fits, and what moved.** The notes' own minutes came to about 5 h 30 for the old core day (00, 01, 03a, 03b, 04,",
"06, 07, 10), before 04, 07 and 10 grew (TF32 and compile, MFU, the debug server). Three things left it:",
"- **04 mixed precision is a track.** Precision is a one-device speed-up that the rest of the day does not use, and",
"  a laptop's CPU shows its numerics but not its speed. Multi-node (06) stays: launching across nodes is what the",
"  attendees do next week.",
f"- **10 stops after exercise 2.** Its section {errors} and exercises 3-4 (an unused parameter, uneven inputs) are the track",
f"  *two DDP errors*, and its section {lab10} (three hangs read by torch's flight-recorder analyzer) the track *a hang lab*: in",
"  the room, go from exercise 2 to the clean-up cell.",
"- **06 leaves out rehearsal 5.** Its virtual nodes and Slurm daemons need root, which attendees on a cluster lack",
"  (there the cell falls back to one machine and repeats rehearsal 1); they launch on real nodes instead. Its cells",
"  start and stop their own nodes, so skipping them breaks nothing after. The *clusters* track keeps it.", "",
f"**Setup ({SETUP} min, in the room, before 00).** Everybody logs in, gets an allocation, starts JupyterLab on the compute",
"node (through the workshop's hub, `tools/hub`, where the site runs it; else `make lab` there and from the laptop",
"`ssh -L 8888:localhost:8888 <node>`: README's course setup), opens",
"`00_setup` and runs its first cells, which start the engines (about 15 s). Laptops: `make lab`. What the instructor",
"does **ahead**, the day before, so that the room waits for none of it:",
"- `make install` in a checkout on the shared file system, from a login node with internet: it builds Horovod (5-8",
"  min, more with `HOROVOD_GPU_OPERATIONS=NCCL`) and registers the kernel; attendees then use that environment.",
"- CIFAR-10 (170 MB) into one shared folder, on a login node: `python -c \"import torchvision;",
"  torchvision.datasets.CIFAR10('data', download=True)\"` from the checkout, and `TUTORIAL_DATA_DIR` pointing at it",
"  for everybody: compute nodes are often offline, and otherwise every attendee's first GPU cell starts with a 170 MB",
"  download.",
"  The laptops' `smoke` preset trains on digits shipped with scikit-learn: nothing to download.",
"- Run 00 and 03b once on a compute node: the first import of torch and the first read of the data are the slow ones.", "",
"**Order and prerequisites.** The core day in the table's order. Every track needs 03a and 03b except 02 (01 only;",
"04 needs them for its compile section); 11 also needs 09 (`fully_shard`), so *memory* comes before *beyond data",
"parallel*; 12 needs 07, 09 and 11 and comes last of them; the appendix follows 06. 06 uses Horovod's trainer in",
"rehearsal 3 as one more launcher: Horovod",
"installed, not notebook 05.", "",
"**Skip when late** (the speaker notes' first slide lists the same; the cells still run, say one sentence each):",
]
for s in STEMS:
    saved, items = notes(s)[1]
    out.append(f"- {s.split('_')[0]} ({saved} min): {items}.")
out += ["",
"Where ranks go (`notebook.allocation`, one line in each notebook): a GPU per rank over NCCL where there are enough;",
"one GPU per attendee: DDP's ranks and hand-made groups share it over gloo; Horovod, FSDP, DeepSpeed, Lightning and",
"tensor/pipeline parallel run on the CPU with `smoke`'s sizes on the real digits (SyncBatchNorm off); no GPU: the CPU",
"with `smoke`. Shared node: start each attendee's JupyterLab with their own `CUDA_VISIBLE_DEVICES`.", ""]
readme = (ROOT / "README.md").read_text()
said = re.compile(r"The core day is \d+ min of teaching \([^)]*\)(?:,\s+\d+ min with its setup block \([^)]*\))?")
assert len(said.findall(readme)) == 1, "README.md must say 'The core day is N min of teaching (...)' once"
wanted = {ROOT / "slides/course_plan.md": "\n".join(out),
          ROOT / "README.md": said.sub(f"The core day is {core} min of teaching (00, 01, 03a, 03b, 06 without its "
                                       f"rehearsal 5, 07, and 10 without its sections {errors}-{lab10}),\n{core + SETUP} min "
                                       f"with its setup block ({fits.split(':')[0]}: the plan says what gives)",
                                       readme)}
if "--check" in sys.argv[1:]:
    stale = [str(path.relative_to(ROOT)) for path, text in wanted.items() if path.read_text() != text]
    if stale:
        sys.exit(f"course plan: {', '.join(stale)} differ from the notes and stored run times: "
                 f"run python scripts/course_plan.py")
else:
    for path, text in wanted.items():
        path.write_text(text)
    print(f"slides/course_plan.md: core day {core} min, all notebooks {allmin} min")

"""The simulated-GPU lane of `make test`: a pytest plugin for `pytest --nbval-lax -p lane` with this folder on
PYTHONPATH and TUTORIAL_SIMGPU set (simgpu.py simulates the GPUs in every process the notebooks start).

It marks each cell's start in the record of process groups, then after a notebook's last cell checks what its
launches did against README's allocation table (`table_problems`; tests/test_simulated_gpus.py holds it to the
table's rows) and the notebook's own promises (PROMISES). A broken check is an error of the notebook's last cell.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

RECORD = Path(os.environ.get("TUTORIAL_SIMGPU_RECORD") or Path("runs/simgpu/record.jsonl").resolve())

# What a notebook promises beyond the table: {notebook: [(from cell, what, applies(record), check(record) -> problem
# or None, text of the cell that makes the promise)]}; tests/test_design.py checks that the cell has that text.


def _carries(*names):
    def check(entry):
        missing = [n for n in names if n not in entry["env"]]
        return f"rank {entry['rank']}'s NCCL group lacks {', '.join(missing)}" if missing else None
    return check


PROMISES = {
    # 10 [45]: the flight recorder's variables reach every NCCL group made afterwards, restarted engines included
    "10_when_things_go_wrong": [(45, "NCCL flight recorder set on the engines", lambda e: e["backend"] == "nccl",
                                 _carries("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"),
                                 '"TORCH_FR_BUFFER_SIZE": "2000"')],
}


# The full-node run (TUTORIAL_SIMGPU=2, TUTORIAL_SIMGPU_CELLS=full-node) executes only the cells whose groups or
# promises change when every rank has a GPU of its own, and the cells they need (the one-GPU run: ONE_GPU_HIDDEN).
# Measured 2026-11-29 (the record of a whole 2-GPU run): 08 made NCCL groups in [13]-[24] and [33] only, 10 in
# [49]-[51] only; every other group was gloo, typed by a cell or given the CPU, the same under any GPU count.
FULL_NODE_CELLS = {
    # One process on one of the 8 GPUs: the trainer [7] and the profiler's CUDA activity [9] with every GPU visible
    # (a trainer that spread itself over the node, as nn.DataParallel does by default, would show here); [32] checks
    # its loader's workers are gone. Left out: the profiler's tables and exercises, the same as on one GPU.
    "01_single_device": [2, 7, 9, 32],
    # [4] starts 2 engines, a GPU each; [28]-[32] SyncBatchNorm and the lesson's own global-batch BatchNorm over NCCL
    # (SyncBatchNorm's CUDA-only kernels are simgpu.SYNC_BN_KERNELS); [49] stops. Left out: the trainer's runs,
    # which the one-GPU lane and 08 and 10 here run on NCCL, and the exercises and capstone on CPU tensors.
    "03b_ddp_trainer": [2, 4, 5, 28, 30, 32, 49],
    # up to [34]: the engines' Lightning and DDP runs and the plain script under torchrun, all on NCCL; [54] stops.
    # Left out: the profiler in this kernel on one device [26]-[27], the in-kernel trainer and CPU launches
    # [36]-[40], the recipes' text [42]-[44], the exercises on CPU tensors [48]-[52].
    "08_lightning": [*range(0, 26), *range(28, 35), 54],
    # [10] the one-process base launch, which sets the ladder 1, 2, 4, 8; [19]-[23] 8 engines, a GPU each, and the
    # all-reduce sweep over NCCL among the first 2, 4 and 8 ranks (subgroups: new_group on a full node); [26]-[34] DDP's
    # step, its no_sync and a bare all-reduce of the gradient on 8 NCCL ranks; [63] stops them. Left out: the weak and
    # strong launches [12]-[16] (29 more ranks of train_ddp on NCCL, which 03b, 08 and 10 run here), and the cells
    # that read results/ or check exercises [36]-[59]. Under the smoke preset (FULL_NODE_PRESET).
    "07_scaling_study": [2, 10, *range(19, 24), *range(26, 30), 31, 32, 34, 63],
    # [1] starts the engines; [45]-[52] the flight recorder's variables and the NCCL groups of a killed rank's run
    # resumed on restarted engines (lane PROMISES); [68]-[85] the exercise checkers' gloo groups beside them (a freed
    # NCCL group's address once read a gloo group as NCCL there), and the stop [106]. Left out: the gloo groups typed
    # by hand in [3]-[43] and in the hang lab [86]-[105], and the launches hidden from the GPUs ({cpu_only}) in [47]
    # and [54]-[67].
    "10_when_things_go_wrong": [*range(0, 3), 45, *range(48, 53), *range(68, 86), 106],
}


# The one-GPU run (TUTORIAL_SIMGPU=1, TUTORIAL_SIMGPU_CELLS=one-gpu) executes every cell but these: launches that a cell
# hides from the GPU (CUDA_VISIBLE_DEVICES=, notebook.cpu_only, or a course helper that hides it: sharded.launch,
# lesson.walltime), and the cells that read what they made. Under the lane's workshop-cpu such a launch trains ResNet-18 on CPU processes
# (sized_for_cpu keeps a preset already sized for a CPU), which no attendee runs: on a GPU node sized_for_cpu(workshop)
# gives the smoke preset's sizes, the very launch strict nbval runs. They cost 2.4 min of the one-GPU lane's 15.6
# (2026-11-29, AVX2 EPYC under load): 08's torchrun and mpirun of train_lightning, 10's gloo size mismatch, lonely
# rank 0, torchrun --max-restarts and walltime launch and its resume.
ONE_GPU_HIDDEN = {
    "08_lightning": [39, 40],
    "10_when_things_go_wrong": [16, 17, 47, 54, 55, 56, 61, 62, 64, 65],
}


# The preset of a notebook's full-node run where the lane's (workshop-cpu: ResNet-18) would not fit 2 cores: 8 ranks of
# ResNet-18 take about a second a step each there. The smoke preset's CNN runs the same cells and collectives.
FULL_NODE_PRESET = {"07_scaling_study": "smoke"}


def groups(entries: list[dict]) -> dict[str, list[dict]]:
    by = defaultdict(list)
    for e in entries:
        if "group" in e:
            by[e["group"]].append(e)
    return by


# Groups made with gloo on purpose by package code, beside the allocation's (README's table holds every other group a
# module of the package makes; a cell's own init_process_group("gloo") is the cell's choice, typed where it is read).
DELIBERATE_GLOO = {
    "tutorial.lessons.ranks": "the exercise checkers run the learner's function on CPU tensors in a gloo group of "
                              "their own (lessons.ranks.on_every_rank)",
}


# The GPUs' own collective libraries: NCCL (RCCL on AMD, under NCCL's name) and oneCCL's xccl on Intel.
GPU_LIBRARIES = ("nccl", "xccl")


def held_to_the_table(caller: str) -> bool:
    return caller.startswith("tutorial.") and caller not in DELIBERATE_GLOO


def table_problems(entries: list[dict]) -> list[str]:
    """README's table, checked per process group of 2 or more ranks that the package made (a trainer, the core, a
    lesson helper: they decide the backend by the allocation; DELIBERATE_GLOO names the exceptions, and a cell that
    types init_process_group("gloo") chose it):
    - every rank sees a GPU of its own (node GPUs >= ranks, or one bound per task): NCCL, one rank per GPU;
    - ranks share a GPU (one GPU per attendee): gloo (NCCL refuses; the simulation refuses as NCCL does);
    - no GPU seen: gloo on the CPU.
    A group that some of its ranks never recorded is a problem too: a rank that did not load the simulation (its
    environment lost PYTHONPATH or TUTORIAL_SIMGPU) would go unchecked."""
    problems = []
    for gid, members in groups(entries).items():
        first = members[0]
        where = f"cell {first.get('cell', '?')}: {first['kind']} of {first['world']} ranks"
        if first["backend"] == "fake":  # torch's fake group: one process plays every rank (11's and 12's dry runs)
            continue
        if len(members) < first["world"]:
            problems.append(f"{where}: only rank(s) {sorted(m['rank'] for m in members)} recorded it (every rank "
                            f"of a group must run the simulation)")
            continue
        caller = first.get("caller", "")
        if first["world"] < 2 or not held_to_the_table(caller):
            continue
        own = [m["uuids"][m["current"]] if m["uuids"] else None for m in members]
        library = first["backend"] in GPU_LIBRARIES
        if any(u is None for u in own):
            if library:
                problems.append(f"{where}: {first['backend']} on a rank that sees no GPU")
            continue
        distinct = len(set(own)) == len(own)
        if distinct and not library and first["node_gpus"] >= first["world"]:
            problems.append(f"{where}: every rank has a GPU of its own ({first['node_gpus']} on the node), but "
                            f"the backend is {first['backend']} (README: one rank per GPU, NCCL, or xccl on Intel), "
                            f"made by {caller}")
        if not distinct and library:
            problems.append(f"{where}: {first['backend']} with ranks sharing a GPU")
    return problems


def read(record: Path) -> list[dict]:
    if not record.exists():
        return []
    return [json.loads(line) for line in record.read_text().splitlines() if line.strip()]


def by_notebook(entries: list[dict]) -> dict[str, list[dict]]:
    """Entries after each cell marker belong to that cell of that notebook."""
    out, notebook, cell = defaultdict(list), None, None
    for e in sorted(entries, key=lambda e: e["time"]):
        if e.get("kind") == "cell":
            notebook, cell = e["notebook"], e["cell"]
            continue
        if notebook:
            out[notebook].append(dict(e, cell=cell))
    return out


def problems_of(notebook: str, entries: list[dict], allocates: bool = False) -> list[str]:
    """What the lane reports for a notebook; `allocates`: its cells ask notebook.allocation for ranks, so its
    launches must have recorded process groups (a record that is empty means the simulation saw none of them)."""
    problems = table_problems(entries)
    if allocates and not groups(entries):
        problems.append("its cells allocate ranks, but no process group was recorded: the launches did not run "
                        "under the simulation (PYTHONPATH, TUTORIAL_SIMGPU or TUTORIAL_SIMGPU_RECORD lost?)")
    for start, what, applies, check, _ in PROMISES.get(notebook, []):
        for e in entries:
            if "group" in e and e.get("cell", -1) >= start and applies(e) and check(e):
                problems.append(f"{what} (cell {start}), but cell {e['cell']}: {check(e)}")
    asked = {(e["cell"], e["asked"], e["where"]) for e in entries if e.get("kind") == "cuda asked"}
    problems += [f"cell {cell}: {what}() asked on an Intel node, where it answers as a build without CUDA (no GPU), so "
                 f"the work runs on the CPU unawares; ask torch.accelerator ({where})" for cell, what, where in
                 sorted(asked)]
    refused = [e for e in entries if e.get("refused")]
    problems += [f"cell {e['cell']}: rank {e.get('rank', '?')} refused: {e['refused']}" for e in refused]
    return problems


def _cell_index(item) -> int:
    """The cell's index in the notebook (nbval's "Cell N" counts code cells only)."""
    cells = getattr(getattr(item, "parent", None), "nb", {}).get("cells", [])
    return next((i for i, c in enumerate(cells) if c is getattr(item, "cell", None)), -1)


_last: dict[str, str] = {}
_LANE_PRESET = os.environ.get("TUTORIAL_PRESET", "")


def pytest_configure(config):
    os.environ["TUTORIAL_SIMGPU_RECORD"] = str(RECORD)  # the kernels, and every process they start, inherit it
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text("")


def pytest_collection_modifyitems(config, items):
    cells = os.environ.get("TUTORIAL_SIMGPU_CELLS")
    if cells == "full-node":
        kept = [i for i in items if _cell_index(i) in FULL_NODE_CELLS.get(Path(str(i.fspath)).stem, [_cell_index(i)])]
    elif cells == "one-gpu":
        kept = [i for i in items if _cell_index(i) not in ONE_GPU_HIDDEN.get(Path(str(i.fspath)).stem, [])]
    else:
        kept = items
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
    for item in items:
        if str(item.fspath).endswith(".ipynb"):
            _last[Path(str(item.fspath)).stem] = item.nodeid


@pytest.hookimpl(tryfirst=True)  # before nbval's setup starts the notebook's kernel, which inherits the environment
def pytest_runtest_setup(item):
    if str(item.fspath).endswith(".ipynb"):
        import time

        if os.environ.get("TUTORIAL_SIMGPU_CELLS") == "full-node":
            preset = FULL_NODE_PRESET.get(Path(str(item.fspath)).stem, _LANE_PRESET)
            if preset:
                os.environ["TUTORIAL_PRESET"] = preset

        with open(RECORD, "a") as f:
            f.write(json.dumps(dict(kind="cell", notebook=Path(str(item.fspath)).stem, cell=_cell_index(item),
                                    time=time.time())) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    notebook = Path(str(item.fspath)).stem
    if _last.get(notebook) == item.nodeid:
        cells = getattr(getattr(item, "parent", None), "nb", {}).get("cells", [])
        allocates = any("allocation(" in "".join(c.get("source", "")) for c in cells if c.get("cell_type") == "code")
        problems = problems_of(notebook, by_notebook(read(RECORD)).get(notebook, []), allocates)
        if problems:
            pytest.fail(f"simulated {os.environ.get('TUTORIAL_SIMGPU')} GPU(s), {notebook}:\n  " +
                        "\n  ".join(problems), pytrace=False)

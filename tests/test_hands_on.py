"""Issue 11's targets, counted by scripts/notebook_stats.py: the learner types the API, and does exercises."""
from __future__ import annotations

import importlib.util
import json

from conftest import ROOT

spec = importlib.util.spec_from_file_location("notebook_stats", ROOT / "scripts" / "notebook_stats.py")
notebook_stats = importlib.util.module_from_spec(spec)
spec.loader.exec_module(notebook_stats)

STAGES = [p for p in sorted(ROOT.glob("notebooks/[0-9][0-9]*_*.ipynb")) if p.stem[:2] != "00"]


def test_a_third_of_all_code_cells_use_the_taught_apis_directly():
    rows = notebook_stats.all_stats()
    code, api = sum(r["code_cells"] for r in rows), sum(r["api_cells"] for r in rows)
    assert api * 3 >= code, f"{api} of {code} code cells use the APIs directly; the target is a third"


def test_every_stage_notebook_has_two_exercises_each_with_a_cell_to_write_in_and_a_check():
    for path in STAGES:
        cells = json.loads(path.read_text())["cells"]
        headings = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                    and notebook_stats.EXERCISE.match("".join(c["source"]).lstrip())]
        assert len(headings) >= 2, f"{path.name}: {len(headings)} exercise(s), at least 2 wanted"
        for i in headings:
            following = [c for c in cells[i + 1:i + 4] if c["cell_type"] == "code"]
            assert len(following) >= 2, f"{path.name} cell {i}: an exercise needs a cell to write in and a check"


def test_the_counter_counts_what_it_should():
    code = ["%%px\nimport torch.distributed as dist\ndist.all_reduce(t)", "!torchrun --nproc_per_node 2 train.py",
            "with torch.autocast('cpu', dtype=torch.bfloat16):\n    y = model(X)", "lesson.profile_steps(cfg)"]
    hits = [bool(notebook_stats.API.search(c)) for c in code]
    assert hits == [True, True, True, False]

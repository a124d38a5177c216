"""Stored notebook outputs without the checkout's absolute path (`make notebooks` runs it after executing): a run
prints where it wrote (`/home/you/workbook/notebooks/runs/...`) and warnings name files in the venv
(`/home/you/workbook/.venv/lib/...`). What a learner and the slides see is the path relative to the notebooks'
folder for the runs (`runs/...`, where the notebook itself writes) and to the checkout for the rest (`.venv/...`):
the maintainer's folders are nobody's business, and the outputs read the same in every checkout.

    python scripts/relative_outputs.py NOTEBOOK.ipynb...   (rewrites in place; prints what it changed)
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def relative(text: str, root: str = str(ROOT)) -> str:
    """The checkout's absolute path taken out where a path starts with it (not inside a longer one)."""
    start = r"(?<![\w./-])" + re.escape(root) + "/"
    return re.sub(start, "", re.sub(start + "notebooks/runs/", "runs/", text))


def rewrite(path: Path, root: str = str(ROOT)) -> int:
    """Rewrite the stored outputs of one notebook; the number of outputs changed."""
    nb = json.loads(path.read_text())
    changed = 0
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            fields = [output] if "text" in output else []
            fields += [output["data"]] if "text/plain" in output.get("data", {}) else []
            for holder in fields:
                key = "text" if holder is output else "text/plain"
                lines = holder[key] if isinstance(holder[key], list) else [holder[key]]
                new = [relative(line, root) for line in lines]
                if new != lines:
                    holder[key] = new if isinstance(holder[key], list) else new[0]
                    changed += 1
            if "traceback" in output:
                new = [relative(line, root) for line in output["traceback"]]
                changed += new != output["traceback"]
                output["traceback"] = new
    if changed:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return changed


if __name__ == "__main__":
    for name in sys.argv[1:]:
        if n := rewrite(Path(name)):
            print(f"{name}: the checkout's path taken out of {n} output(s)")

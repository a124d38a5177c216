"""The course plan's table (slides/course_plan.md) as rows, for the tests that compare it with the notebooks."""
from __future__ import annotations


def plan_table(text: str) -> list[tuple[str, dict[str, str]]]:
    """(the row's first cell, {lower-cased header: cell}) for every row of the markdown table in text."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        rows.append((cells[0], dict(zip(header, cells))))
    return rows

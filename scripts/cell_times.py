"""A stored code cell's run time, from the times nbclient records in its metadata: one helper for the course plan
(scripts/course_plan.py), the speaker notes' timings (scripts/slides_export.py) and tests/test_quoted_numbers.py."""
from __future__ import annotations

from datetime import datetime


def cell_seconds(cell) -> float | None:
    """How long a code cell ran when its outputs were stored; None where no times were recorded. `cell` is a
    notebook's JSON dict or an nbformat node (a dict too)."""
    times = cell.get("metadata", {}).get("execution", {})
    try:
        begin, end = times["iopub.execute_input"], times["iopub.status.idle"]
    except KeyError:
        return None
    return (_when(end) - _when(begin)).total_seconds()


def _when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))  # Python 3.10 reads no "Z"

"""What `make test` spent its time on: every lane's wall time, and every test's and notebook cell's duration.

    python scripts/suite_times.py run LANE HALF -- COMMAND...   run COMMAND, record its wall time as LANE of HALF
    python scripts/suite_times.py report [--slowest 20]       the halves' balance, the lanes, the slowest tests

`make test` runs each of its lanes through `run` and every pytest in it with `--junitxml` into the same folder
(results/test-times/, SUITE_TIMES_DIR to move it), then prints the report, so CI's log keeps the figures and a
maintainer can even the halves out from measured times instead of notes. A lane's exit status is passed on: a failed
lane still records its time, and still fails make.

Standard library only: it runs before and after the virtual environment exists.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER = Path(os.environ.get("SUITE_TIMES_DIR") or ROOT / "results" / "test-times")
LANES = "lanes.jsonl"


def machine() -> dict:
    """The machine and commit, so that figures from two machines are never compared as if from one."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return dict(cpu=cpu, cores=os.cpu_count(), commit=commit.stdout.strip() or None, ci=os.environ.get("CI") == "true")


def machine_ticks() -> tuple[int, int] | None:
    """(busy, all) clock ticks of every CPU of the machine since boot (/proc/stat), whoever used them: the share of
    the machine a lane found busy, daemons and processes no one waits for (which RUSAGE_CHILDREN misses) included."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def run(lane: str, half: str, command: list[str]) -> int:
    FOLDER.mkdir(parents=True, exist_ok=True)
    started, before, ticks = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN), machine_ticks()
    status = subprocess.call(command)
    after, ticks_after = resource.getrusage(resource.RUSAGE_CHILDREN), machine_ticks()
    # CPU time of the lane's processes that have ended (engines, ranks, kernels): with the wall time, how much of the
    # machine the lane kept busy, i.e. whether a third job beside the two halves could gain anything.
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    record = dict(lane=lane, half=half, seconds=round(time.time() - started, 1), cpu_seconds=round(cpu, 1),
                  status=status,
                  date=datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
                  load_average=[round(x, 2) for x in os.getloadavg()], **machine())
    if ticks and ticks_after and ticks_after[1] > ticks[1]:
        # 1.0: every core busy all along (a third job side by side would gain nothing); 0.6: 40 % of it idle
        record["machine_busy"] = round((ticks_after[0] - ticks[0]) / (ticks_after[1] - ticks[1]), 3)
    with open(FOLDER / LANES, "a") as f:
        f.write(json.dumps(record) + "\n")
    return status


def lanes(folder: Path) -> list[dict]:
    """The lanes recorded in folder (make test empties it first), in the order they ended."""
    path = folder / LANES
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def durations(folder: Path) -> list[tuple[float, str, str]]:
    """(seconds, lane, test id) of every test case in the JUnit files of folder (a notebook cell is a test case)."""
    found = []
    for xml in sorted(folder.glob("*.xml")):
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
            found.append((float(case.get("time", 0) or 0), xml.stem, name))
    return sorted(found, reverse=True)


def report(folder: Path, slowest: int) -> str:
    records = lanes(folder)
    if not records:
        return f"no lane times in {folder} (make test writes them)"
    lines = []
    first = records[-1]
    lines.append(f"make test's times ({first['date']}, {first['cpu']}, {first['cores']} cores, "
                 f"commit {first['commit']}, load {first['load_average']}):")
    halves: dict[str, float] = {}
    for r in records:
        if r["lane"] != "test":
            halves[r["half"]] = halves.get(r["half"], 0.0) + r["seconds"]
        mark = "" if r["status"] == 0 else f"  (exit {r['status']})"
        busy = f"  CPU {r['cpu_seconds'] / 60:5.1f} min" if "cpu_seconds" in r else ""
        busy += f"  machine busy {r['machine_busy']:4.0%}" if "machine_busy" in r else ""
        lines.append(f"  {r['half']:>9} {r['lane']:<22} {r['seconds'] / 60:6.1f} min{busy}{mark}")
    if len(halves) > 1:
        lines.append("  halves, side by side: " + ", ".join(f"{h} {s / 60:.1f} min" for h, s in halves.items())
                     + f" (the shorter ends {(max(halves.values()) - min(halves.values())) / 60:.1f} min earlier)")
    cases = durations(folder)
    if cases:
        lines.append(f"the {min(slowest, len(cases))} slowest of {len(cases)} tests and cells "
                     f"({sum(c[0] for c in cases) / 60:.1f} min in all):")
        lines += [f"  {s:7.1f} s  {lane:<12} {name}" for s, lane, name in cases[:slowest]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        if "--" not in argv or argv.index("--") != 3 or len(argv) < 5:
            print("usage: suite_times.py run LANE HALF -- COMMAND...", file=sys.stderr)
            return 2
        return run(argv[1], argv[2], argv[4:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["report"])
    parser.add_argument("--slowest", type=int, default=20)
    parser.add_argument("--folder", type=Path, default=FOLDER)
    args = parser.parse_args(argv)
    print(report(args.folder, args.slowest))
    return 0


if __name__ == "__main__":
    sys.exit(main())

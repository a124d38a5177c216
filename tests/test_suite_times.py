"""scripts/suite_times.py, which make test runs every lane through: a lane's exit status is passed on, its wall time,
CPU time and the machine's busy share are recorded, and the report reads them with the JUnit durations."""
from __future__ import annotations

import importlib.util
import sys

from conftest import ROOT

spec = importlib.util.spec_from_file_location("suite_times", ROOT / "scripts" / "suite_times.py")
suite_times = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite_times)


def test_a_lane_is_recorded_with_its_status_cpu_and_the_machines_busy_share(tmp_path, monkeypatch):
    monkeypatch.setattr(suite_times, "FOLDER", tmp_path)
    spin = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\nraise SystemExit(3)"
    assert suite_times.run("spin", "unit", [sys.executable, "-c", spin]) == 3  # a failed lane still fails make
    (tmp_path / "unit.xml").write_text('<testsuites><testsuite><testcase classname="tests.test_x" name="test_y" '
                                       'time="12.5"/></testsuite></testsuites>')
    [record] = suite_times.lanes(tmp_path)
    assert record["status"] == 3 and record["cpu_seconds"] >= 0.4 and 0 < record["machine_busy"] <= 1, record
    text = suite_times.report(tmp_path, 5)
    assert "unit spin" in text and "(exit 3)" in text and "machine busy" in text, text
    assert "12.5 s  unit         tests.test_x::test_y" in text, text

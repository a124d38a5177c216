"""Run a DDP script under torchrun, each rank under the recorder, in a scratch folder, watched; then its findings.

From Python (a notebook): `check_ddp(script, args=(), nproc=2, ...) -> Report`; report.findings are Finding tuples.
This is the only part of check-ddp that starts processes (tutorial.launch.child_processes stops them all).
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..core.process import threads_per_process
from ..launch.child_processes import Nodes, launcher_env
from . import recorder
from .findings import CHECKED, FATAL, Finding, analyse, display, hanging, lr_findings, relative, steps

STOP_GRACE_S = 20.0  # after --max-seconds, the ranks get this long to reach their next step and stop together
POLL_S = 0.2
PROBE_WAIT_S = 30.0  # the most the one-process run may add after the ranks have finished
MARKER = ".check-ddp"  # in a scratch folder the tool made: it may be reused


class BadInput(ValueError):
    """A value the check cannot run with: one line naming it and what is allowed (the CLI exits 2)."""


@dataclass
class Report:
    script: str
    nproc: int
    device: str
    seconds: float
    out: str
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    steps: dict[int, int] = field(default_factory=dict)  # optimizer steps per rank

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.findings]

    @property
    def exit_code(self) -> int:
        return 1 if self.errors else 0

    def text(self) -> str:
        steps = sorted(set(self.steps.values()))
        lines = [f"check-ddp: {self.script} on {self.nproc} ranks ({self.device}), "
                 f"{'/'.join(map(str, steps)) if steps else 'no'} optimizer steps per rank, {self.seconds:.1f} s"]
        lines += [f.line() for f in self.findings]
        lines += [f"note: {n}" for n in self.notes]
        if self.errors:
            lines.append(f"{len(self.errors)} finding(s); the run's output and reports are in {self.out}")
        else:
            lines.append(f"ok: nothing wrong found (checked: {', '.join(CHECKED)}); scratch folder {self.out}")
        return "\n".join(lines)


def check_ddp(script, args=(), nproc: int = 2, max_seconds: float = 120.0, max_steps: int | None = None,
              out=None, lr_check: bool = True) -> Report:
    """Run `script args` under torchrun on `nproc` ranks, recorded, and return what is wrong with it.

    Bounded by max_seconds (then every rank stops after the same step) and max_steps (optimizer steps); a run that
    hangs is stopped HANG_S after its ranks stood still. lr_check=False skips the one-process run that tells
    whether the learning rate scales with the world size. Raises BadInput for a value it cannot run with."""
    script, args = Path(script), [str(a) for a in args]
    _check_inputs(script, nproc, max_seconds, max_steps)
    out = _scratch(out)
    start = time.monotonic()
    gpus = _gpus() >= nproc  # one GPU per rank; otherwise the CPU, where a script picks gloo
    run = launch(script, args, nproc, out, max_seconds, max_steps, gpus, lr_check)
    findings, notes = analyse(run, nproc)
    if lr_check and not any(f.name in FATAL for f in findings):
        findings += lr_findings(run["reports"], run["lr_probe"], nproc)
    report = Report(display(script), nproc, "one GPU per rank" if gpus else "CPU, gloo", time.monotonic() - start,
                    str(out), [relative(f) for f in findings], notes, {r: steps(run, r) for r in range(nproc)})
    (out / "report.txt").write_text(report.text() + "\n")
    return report


def _check_inputs(script: Path, nproc, max_seconds, max_steps) -> None:
    if not script.is_file():
        raise BadInput(f"script {str(script)!r} is not a file: give the path of your Python training script")
    if not isinstance(nproc, int) or nproc < 2:
        raise BadInput(f"--nproc {nproc} is not allowed: give 2 or more ranks (a check needs ranks to compare)")
    if not max_seconds > 0:
        raise BadInput(f"--max-seconds {max_seconds} is not allowed: give a number of seconds above 0")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
        raise BadInput(f"--max-steps {max_steps} is not allowed: give 1 or more optimizer steps")


def _gpus() -> int:
    if not any(Path("/dev").glob("nvidia[0-9]*")) and not Path("/dev/kfd").exists() and not Path("/dev/dri").exists() \
            and not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return 0  # no NVIDIA, AMD or Intel device: spare the import of torch (seconds) that would say so
    from ..core import accelerator
    return accelerator.device_count()


def _scratch(out) -> Path:
    if out is None:
        out = Path(tempfile.mkdtemp(prefix="check-ddp-"))
    out = Path(out).absolute()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).exists())):
        raise BadInput(f"--out {out} is not an empty folder: give a new or empty one (the script's files go there)")
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("a scratch folder of tutorial check-ddp; its next run may empty it\n")
    for old in (*out.glob("ranks/*"), *out.glob("lr_probe/ranks/*")):  # an earlier check's reports and stop file
        old.unlink()
    for sub in ("ranks", "run", "lr_probe/ranks", "lr_probe/run"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    return out


def _env(folder: Path, cwd: Path, gpus: bool, nproc: int, **extra) -> dict:
    env = launcher_env(threads=threads_per_process(nproc), cpu=not gpus)
    env.update({recorder.DIR_VARIABLE: str(folder), recorder.CWD_VARIABLE: str(cwd)})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def launch(script: Path, args, nproc, out: Path, max_seconds, max_steps, gpus, lr_check) -> dict:
    """torchrun SCRIPT under the recorder, watched: stopped when it hangs or overruns. The reports it left."""
    folder, probe = out / "ranks", out / "lr_probe"
    env = _env(folder, out / "run", gpus, nproc, **{recorder.MAX_SECONDS_VARIABLE: max_seconds,
                                                    recorder.MAX_STEPS_VARIABLE: max_steps or "",
                                                    recorder.LR_PROBE_DIR_VARIABLE: probe if lr_check else ""})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "tutorial.checkddp.recorder", str(script.absolute()), *args]
    nodes = Nodes([cmd], env)
    try:
        hung, overran = _watch(nodes.procs[0], folder, nproc, time.monotonic() + max_seconds + STOP_GRACE_S)
        progress = _read(folder, recorder.PROGRESS_FILE, nproc)  # before the stop: where the ranks stood
        if lr_check and not hung and not overran:
            _wait_for_probe(probe / "ranks", time.monotonic() + min(max_seconds, PROBE_WAIT_S))
        output = nodes.text(0)
    finally:
        nodes.close()
    (out / "output.log").write_text(output)
    return {"reports": _read(folder, recorder.REPORT_FILE, nproc), "progress": progress, "output": output,
            "hung": hung, "overran": overran, "returncode": nodes.procs[0].returncode,
            "augment": _worker_augmentation(folder), "max_seconds": max_seconds, "stop_grace_s": STOP_GRACE_S,
            "lr_probe": _read(probe / "ranks", recorder.REPORT_FILE, 1).get(0)}


def _watch(torchrun, folder: Path, nproc: int, deadline: float) -> tuple[bool, bool]:
    """Wait for torchrun to end; (hung, overran): the ranks stood still in a collective, or the deadline passed."""
    while torchrun.poll() is None:
        time.sleep(POLL_S)
        if hanging(_read(folder, recorder.PROGRESS_FILE, nproc), _read(folder, recorder.REPORT_FILE, nproc),
                   time.time()):
            return True, False
        if time.monotonic() > deadline:
            return False, True
    return False, False


def _wait_for_probe(ranks: Path, until: float) -> None:
    """The one-process run forked by rank 0 stops at its first step; give it the time it needs to get there."""
    started, done = ranks / recorder.PROGRESS_FILE.format(0), ranks / recorder.REPORT_FILE.format(0)
    while started.exists() and not done.exists() and time.monotonic() < until:
        time.sleep(POLL_S)


def _read(folder: Path, pattern: str, nproc: int) -> dict[int, dict]:
    """rank -> the JSON file `pattern` names for it, for the ranks that wrote one."""
    found = {}
    for rank in range(nproc):
        path = folder / pattern.format(rank)
        try:
            found[rank] = json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    return found


def _worker_augmentation(folder: Path) -> dict[int, dict]:
    found = {}
    for path in folder.glob(recorder.AUGMENTATION_FILE.format("*", "*")):
        rank, worker = map(int, re.findall(r"\d+", path.name)[:2])
        found.setdefault(rank, {})[worker] = json.loads(path.read_text())
    return found

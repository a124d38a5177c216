"""When it goes wrong: bounded rendezvous with the missing ranks named, and checkpoints that fail in one line.

Every failure here is real: a trainer process whose partner never starts, a checkpoint file that is corrupt,
truncated or from another model, and a process killed while it writes checkpoints."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch
from conftest import PYTHON, ROOT, env, metrics, params, run, torchrun_cmd, train_cmd
from conftest import skeleton as notebook_skeleton
from test_bad_input import assert_one_line_error

from tutorial.core.process import free_port

TIMEOUT_S = 5
# Python and torch start-up before the rendezvous: up to ~10 s on a busy 2-core machine.
MARGIN_S = 30


def lone_rank(rank: int, world_size: int = 2) -> tuple[subprocess.CompletedProcess, float]:
    """One rank of a 2-rank DDP job started alone, the way a launcher would start it, with a short timeout."""
    extra = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    start = time.monotonic()
    proc = subprocess.run(train_cmd("ddp", "--preset", "smoke", "--timeout", str(TIMEOUT_S)), capture_output=True,
                          text=True, timeout=TIMEOUT_S + MARGIN_S + 60, env=env(**extra), cwd=ROOT)
    return proc, time.monotonic() - start


def one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_a_rank_that_never_joins_is_named_within_the_timeout():
    proc, seconds = lone_rank(0)
    assert proc.returncode == 1
    line = one_error_line(proc)
    assert "1 of 2 ranks arrived" in line and "missing rank(s): 1" in line
    assert TIMEOUT_S <= seconds < TIMEOUT_S + MARGIN_S


def test_rank_0_that_never_starts_is_reported_by_the_others():
    proc, seconds = lone_rank(1)
    assert proc.returncode == 1
    assert "could not reach rank 0's rendezvous at 127.0.0.1:" in one_error_line(proc)
    assert seconds < TIMEOUT_S + MARGIN_S


def test_timeout_must_be_positive():
    assert_one_line_error(run(train_cmd("ddp", "--timeout", "0"), check=False), "timeout must be a positive")


# -------------------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("good")
    run(train_cmd("single", "--preset", "smoke", "--epochs", "1", "--out", out))
    return out / "checkpoint.pt"


def test_corrupt_checkpoint_is_one_line(tmp_path):
    bad = tmp_path / "checkpoint.pt"
    bad.write_bytes(b"this is not a checkpoint\n" * 10)
    proc = run(train_cmd("single", "--resume", bad), check=False)
    assert_one_line_error(proc, f"checkpoint '{bad}' cannot be read")


def test_truncated_checkpoint_is_one_line(tmp_path, good_checkpoint):
    bad = tmp_path / "checkpoint.pt"
    bad.write_bytes(good_checkpoint.read_bytes()[:5000])
    assert_one_line_error(run(train_cmd("single", "--resume", bad), check=False), f"checkpoint '{bad}' cannot be read")


def test_checkpoint_of_another_model_is_one_line(good_checkpoint):
    proc = run(train_cmd("single", "--model", "cnn_bn", "--resume", good_checkpoint), check=False)
    assert_one_line_error(proc, "does not fit this model and optimizer (saved with model 'cnn')")


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    """weights_only=True: a pickle that calls a function on load is rejected, not executed."""
    marker = tmp_path / "pwned"
    bad = tmp_path / "checkpoint.pt"
    torch.save({"model": _Evil(str(marker))}, bad)
    assert_one_line_error(run(train_cmd("single", "--resume", bad), check=False), "cannot be read")
    assert not marker.exists()


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


SAVER = """
import json, os, signal, sys, time
import torch
from tutorial import train_single
from tutorial.core import checkpoint
from tutorial.core.config import TrainConfig
torch.set_num_threads(1)  # no OpenMP pool to inherit across fork: the children only serialize
cfg = TrainConfig.preset("smoke", out=sys.argv[1])
device, precision = train_single.setup(cfg)
model, optimizer, *_ = train_single.build(cfg, device)
path = os.path.join(cfg.out, "checkpoint.pt")
for attempt in range(10):
    pid = os.fork()  # a child that saves in a loop until it is killed; torch is imported once, not ten times
    if pid == 0:
        try:
            state = checkpoint.State()
            while True:
                state.step += 1
                checkpoint.save(cfg, model, optimizer, precision.scaler, state)
        finally:
            os._exit(1)  # a child that failed must not go on with the parent's loop
    time.sleep(0.2 + 0.05 * attempt)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    try:
        step = torch.load(path, weights_only=True)["step"] if os.path.exists(path) else None  # raises if half-written
        print(json.dumps({"attempt": attempt, "step": step}), flush=True)
    except Exception as e:
        print(json.dumps({"attempt": attempt, "error": repr(e)}), flush=True)
"""


def test_killed_while_saving_leaves_a_loadable_checkpoint(tmp_path):
    """The save writes beside the old file and renames over it, so a SIGKILL at any moment leaves either the
    previous or the new checkpoint, never half of one. A saver killed at ten different moments (each a fork of one
    process, which saves in a loop), the file loaded after each kill, then resumed from."""
    proc = run([PYTHON, "-c", SAVER, tmp_path], timeout=120)
    attempts = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(attempts) == 10, proc.stdout + proc.stderr
    assert not [a for a in attempts if "error" in a], attempts
    assert all(a["step"] is None or a["step"] >= 1 for a in attempts), attempts
    assert attempts[-1]["step"], "no save finished in 10 tries"
    resumed = run(train_cmd("single", "--preset", "smoke", "--epochs", "1", "--resume", tmp_path / "checkpoint.pt"))
    assert resumed.returncode == 0


# ------------------------------------------------------------------------------- 10_when_things_go_wrong's exercises
def skeleton(heading: str):
    return notebook_skeleton("10_when_things_go_wrong", heading)



def test_exercise_1_checker_accepts_the_solution_and_names_the_hang(cluster):
    from tutorial.lessons import failures
    assert failures.check_mean_loss(cluster, failures.solution_mean_loss) == "correct: every rank got the mean loss 1.5"
    verdict = failures.check_mean_loss(cluster, skeleton("### Exercise 1"))
    assert verdict.startswith("wrong: rank 0 failed in a collective") and "if rank == 0" in verdict


def test_exercise_2_checker_accepts_the_solution_and_explains_the_shapes(cluster):
    from tutorial.lessons import failures
    assert failures.check_gather(cluster, failures.solution_gather_all).startswith("correct: every rank has all 5")
    verdict = failures.check_gather(cluster, skeleton("### Exercise 2"))
    assert verdict.startswith("wrong: rank 0:") and "gather the sizes first" in verdict


@pytest.mark.parametrize("workers", [0, 2])
def test_a_diverged_loss_stops_the_run_naming_rank_and_step(workers):
    """With loader workers too: they ignore SIGTERM, so a failed trainer must not end through the interpreter's exit,
    which SIGTERMs its worker processes and waits for them (it hung there until this was fixed)."""
    proc = run(train_cmd("single", "--preset", "smoke", "--lr", "1e5", "--warmup-epochs", "0", "--log-every", "1",
                         "--workers", str(workers)), check=False, timeout=60)
    assert proc.returncode == 1
    line = one_error_line(proc)
    assert line.startswith("error: rank 0: the training loss is nan at step ") or "loss is inf" in line
    assert "lower --lr" in line


# --------------------------------------------------------------------------------------- a walltime kill (SIGTERM)
def stopped_by_sigterm(cmd, out, timeout: float = 240) -> subprocess.CompletedProcess:
    """Start cmd, send SIGTERM once the first epoch's checkpoint exists (a scheduler's walltime kill on cue, so it
    lands in epoch 1 or later, after the loop has started) and let the trainer save and exit."""
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not (out / "checkpoint.pt").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)  # the SIGKILL a scheduler sends after its grace period
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def test_sigterm_saves_mid_epoch_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path):
    args = ["--preset", "smoke", "--epochs", "3", "--log-every", "2"]
    stopped = stopped_by_sigterm(train_cmd("single", *args, "--out", tmp_path / "parts"), tmp_path / "parts")
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert stopped.stderr.strip().splitlines()[-1].startswith("stopped: SIGTERM: saved epoch ")
    saved = torch.load(tmp_path / "parts" / "checkpoint.pt", weights_only=True)
    assert saved["batch"] > 0 and saved["step"] % 2 == 0  # mid-epoch, at a step where the ranks compare flags
    run(train_cmd("single", *args, "--out", tmp_path / "parts", "--resume"))
    run(train_cmd("single", *args, "--out", tmp_path / "whole"))
    assert metrics(tmp_path / "parts")["steps"] == metrics(tmp_path / "whole")["steps"]
    assert torch.equal(params(tmp_path / "parts"), params(tmp_path / "whole"))


def test_sigterm_to_torchrun_stops_every_ddp_rank_at_the_same_step_and_resumes(tmp_path):
    args = ["--preset", "smoke", "--epochs", "3", "--log-every", "2", "--out", tmp_path]
    stopped = stopped_by_sigterm(torchrun_cmd(2, "ddp", *args), tmp_path)
    # Each rank exits 143; torchrun itself turns its own SIGTERM into a SignalException and exits 1 (not 0: a
    # scheduler must not read the stopped job as finished).
    assert stopped.returncode == 1 and "SignalException" in stopped.stderr, stopped.stderr[-2000:]
    said = [line for line in stopped.stderr.splitlines() if line.startswith("stopped: SIGTERM")]
    assert len(said) == 2 and said[0] == said[1], stopped.stderr[-3000:]  # both ranks, the same epoch/batch/step
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["batch"] > 0
    run(torchrun_cmd(2, "ddp", *args, "--resume"))
    m = metrics(tmp_path)
    assert [e["epoch"] for e in m["epochs"]] == [0, 1, 2] and m["replicas_identical"]


def test_a_sigterm_on_an_epochs_last_step_finishes_that_epoch_then_stops():
    """Epochs of a few steps (workshop-cpu: 2) may put every check on an epoch's last batch: the stop must still
    happen, after the epoch's own checkpoint, not be put off for ever."""
    from tutorial.core import checkpoint
    from tutorial.core.loop import Loop
    from tutorial.core.tracking import Agreement
    assert checkpoint.stop_requested(Agreement(4, True))
    mid, last = (Loop(*[None] * 7, state=checkpoint.State(epoch=1, step=4)) for _ in range(2))
    mid.stop(i=1, batches=4)
    last.stop(i=3, batches=4)
    assert (mid.stopping, mid.state.batch) == (True, 2) and (last.stopping, last.state.batch) == (True, 0)
    assert not checkpoint.stop_requested(None)  # a step the ranks did not compare flags at
    assert "the end of epoch 0" in str(checkpoint.stop_exception(last.state, "out"))

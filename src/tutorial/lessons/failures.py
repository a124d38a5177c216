"""10_when_things_go_wrong: what the notebook needs around the failures it provokes on purpose.

The failures themselves (a collective one rank skips, shapes that differ, a barrier nobody else reaches) are typed in
the notebook's %%px cells. Here: reading every rank's Python stack while it hangs (py-spy), killing a process at a
chosen moment, and finding the line a rank waits on in a dump.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .ranks import on_every_rank


def python_stacks(pids: list[int], timeout: float = 30) -> dict[int, str]:
    """Each process's Python stack right now, as `py-spy dump` prints it (it reads the process's memory from the
    outside, so it works on a process stuck in C++ inside a collective; it needs ptrace rights: root, or
    kernel.yama.ptrace_scope=0). Processes must be on this host."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        raise FileNotFoundError("py-spy is not installed (pip install py-spy, or make install)")
    stacks = {}
    for pid in pids:
        proc = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout)
        text = proc.stdout if proc.returncode == 0 else f"py-spy failed: {proc.stderr.strip()[-300:]}"
        stacks[pid] = re.sub(r"\x1b\[[0-9;]*m", "", text)  # py-spy colours its output even into a pipe
    return stacks


def innermost_call(stack: str, skip=("torch/distributed/c10d_logger.py", "threading.py")) -> str:
    """The innermost frame of the main thread's stack that is not a logging wrapper: `function (file:line)`."""
    main = stack.split("\nThread ")[1] if "\nThread " in stack else stack
    frames = [line.strip() for line in main.splitlines()[1:] if line.startswith("    ") and "(" in line]
    frames = [f for f in frames if not any(s in f for s in skip)]
    return frames[0] if frames else "(no Python frame)"


def kill_when(condition, pid: int, sig: int = signal.SIGKILL, timeout: float = 120, poll: float = 0.02):
    """In a background thread: wait until condition() is true, then send `sig` to pid (the scheduler, the OOM
    killer or a failing node, on cue). Returns the thread; .killed_at holds what condition() saw, or None."""
    def watch():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = condition()
            if seen:
                thread.killed_at = seen
                os.kill(pid, sig)
                return
            time.sleep(poll)

    thread = threading.Thread(target=watch, daemon=True)
    thread.killed_at = None
    thread.start()
    return thread


def checkpoint_epochs(out: str) -> int:
    """How many epochs the checkpoint in `out` holds (0 if none yet), read from its metrics-free header cheaply:
    metrics.json is written together with every checkpoint."""
    path = Path(out) / "metrics.json"
    try:
        return len(json.loads(path.read_text()).get("epochs", []))
    except (OSError, ValueError):
        return 0


def _interrupted(command: list[str], out: str, after_epochs: int, interrupt, timeout: float) -> dict:
    """Run `command`; once the checkpoint in `out` holds `after_epochs` epochs, call interrupt(process, seconds
    left) and wait for the end. Returns the command, the exit code and the output; nothing is left running."""
    from ..launch import commands, processes
    nodes = processes.Nodes([command], processes.launcher_env())
    job = nodes.procs[0]
    try:
        deadline = time.monotonic() + timeout
        while checkpoint_epochs(out) < after_epochs:
            if time.monotonic() > deadline or job.poll() is not None:
                raise RuntimeError(f"the run did not reach epoch {after_epochs}:\n{nodes.text(0)[-2000:]}")
            time.sleep(0.02)
        interrupt(job, max(1.0, deadline - time.monotonic()))
        return dict(command=commands.display(command), returncode=job.returncode, output=nodes.text(0))
    finally:
        nodes.close()


def torchrun_losing_a_worker(out: str, args: list[str], after_epochs: int, max_restarts: int = 1,
                             timeout: float = 300) -> dict:
    """`torchrun --max-restarts N ... --resume --out OUT` with 2 workers; once the checkpoint holds `after_epochs`
    epochs, one worker is SIGKILLed (a node's OOM killer, say). torchrun then stops the other worker and starts both
    again, and they resume from the checkpoint. Returns the command, torchrun's exit code and its output."""
    import psutil

    def kill_a_worker(torchrun, seconds_left):
        psutil.Process(torchrun.pid).children()[-1].kill()
        torchrun.wait(timeout=seconds_left)

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", str(max_restarts), "-m", "tutorial.train_ddp", *args, "--resume", "--out", out]
    return _interrupted(cmd, out, after_epochs, kill_a_worker, timeout)


def walltime(command: list[str], out: str, after_epochs: int, grace: float = 30, timeout: float = 300) -> dict:
    """Run a training command as a batch job that reaches its walltime once the checkpoint in `out` holds
    `after_epochs` epochs: SIGTERM, then SIGKILL `grace` seconds later if it is still running (Slurm's KillWait, PBS's
    kill_delay). Returns the command, the exit code and the output."""
    def sigterm_then_sigkill(job, seconds_left):
        job.send_signal(signal.SIGTERM)
        try:
            job.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()

    return _interrupted(command, out, after_epochs, sigterm_then_sigkill, timeout)


def fresh_dir(name: str) -> str:
    """An empty runs/<name> (absolute, so engines and launchers in other folders find it): a checkpoint left by an
    earlier execution of the notebook would otherwise be resumed."""
    from .notebook import runs_dir
    path = os.path.abspath(runs_dir(name))
    shutil.rmtree(path)
    os.makedirs(path)
    return path


# ---------------------------------------------------------------------------------------------------- exercises
def _loss_of(rank: int, world_size: int) -> tuple:
    return (float(rank + 1),)


def _predictions_of(rank: int, world_size: int = 0) -> tuple:
    import torch
    return (torch.arange(rank + 2, dtype=torch.float32) + 10 * rank,)  # rank r holds r + 2 predictions


def check_mean_loss(cluster, mean_loss) -> str:
    """Exercise 1: every rank calls mean_loss(loss) with loss = rank + 1 and must get the mean over all ranks."""
    cluster.run(on_every_rank, mean_loss, inputs=_loss_of, seconds=5.0)
    expected = sum(range(1, cluster.n + 1)) / cluster.n
    for rank, (status, value) in enumerate(cluster.results):
        if status == "error" and not value.startswith(("RuntimeError", "DistBackendError", "DistError")):
            return f"wrong: rank {rank} raised {value}"
        if status == "error":
            return (f"wrong: rank {rank} failed in a collective ({value[:90]}): a collective that only some ranks "
                    "call, inside `if rank == 0`, waits for the others in vain; call it on every rank")
        if not isinstance(value, (int, float)) or abs(value - expected) > 1e-6:
            return f"wrong: rank {rank} returned {value!r}; every rank should get the mean {expected:g}"
    return f"correct: every rank got the mean loss {expected:g}"


# The collectives that pickle Python objects: the exercise asks for the tensor way, which scales to large tensors.
OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list")


def _gather_trial(gather_all, preds):
    """On an engine, in a group: gather_all(preds), noting any collective that pickles objects (they still work)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    used, originals = [], {name: getattr(dist, name) for name in OBJECT_COLLECTIVES}

    def noting(name):
        def call(*args, **kwargs):
            used.append(name)
            return originals[name](*args, **kwargs)
        return call

    for name in OBJECT_COLLECTIVES:  # both places a learner may take it from
        setattr(dist, name, noting(name))
        setattr(distributed_c10d, name, getattr(dist, name))
    try:
        return {"value": gather_all(preds), "object_collectives": sorted(set(used))}
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
            setattr(distributed_c10d, name, fn)


def check_gather(cluster, gather_all) -> str:
    """Exercise 2: rank r holds r + 2 predictions; gather_all must return all of them, in rank order, on every
    rank, with tensor collectives (no all_gather_object, which pickles)."""
    import torch
    cluster.run(on_every_rank, _gather_trial, gather_all, inputs=_predictions_of, seconds=10.0, detail=True)
    expected = torch.cat([_predictions_of(r)[0] for r in range(cluster.n)])
    for rank, (status, value) in enumerate(cluster.results):
        if status == "error" and not value.startswith(("RuntimeError", "DistBackendError", "DistError")):
            return f"wrong: rank {rank}: {value} -- your code raised this before any collective could fail"
        if status == "error":
            return (f"wrong: rank {rank}: {value[:120]} -- all_gather needs the same shape on every rank: gather "
                    "the sizes first, pad to the largest, gather, then cut each piece to its size")
        if value["object_collectives"]:
            return (f"wrong: rank {rank} called dist.{value['object_collectives'][0]}, which pickles the tensor, "
                    "sends bytes and unpickles them on every rank: it works, but is slow for large tensors (and on "
                    "NCCL moves through the GPU anyway). Gather the sizes with all_gather, pad to the largest, "
                    "all_gather the padded tensors, then cut each piece to its size")
        value = value["value"]
        if not isinstance(value, torch.Tensor) or value.shape != expected.shape or not torch.equal(value, expected):
            got = value.tolist() if isinstance(value, torch.Tensor) else value
            return f"wrong: rank {rank} got {got}, expected {expected.tolist()}"
    return f"correct: every rank has all {len(expected)} predictions in rank order"


# The solutions; tests/test_exercises_10.py checks that each checker accepts its solution and rejects the
# skeleton the notebook starts from.
def solution_mean_loss(loss: float) -> float:
    import torch
    import torch.distributed as dist
    t = torch.tensor([loss])
    dist.all_reduce(t)  # every rank calls the collective...
    mean = t.item() / dist.get_world_size()
    if dist.get_rank() == 0:  # ...and only the printing is rank 0's
        print(f"mean loss {mean:.3f}")
    return mean


def solution_gather_all(preds):
    import torch
    import torch.distributed as dist
    n = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([len(preds)]))  # 1. every rank learns every size
    longest = max(int(s) for s in sizes)
    padded = torch.cat([preds, preds.new_zeros(longest - len(preds))])  # 2. the same shape everywhere
    pieces = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(pieces, padded)  # 3. now all_gather can work
    return torch.cat([p[:int(s)] for p, s in zip(pieces, sizes)])  # 4. cut the padding off again


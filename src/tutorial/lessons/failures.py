"""10_when_things_go_wrong: what the notebook needs around the failures it provokes on purpose.

The failures themselves (a collective one rank skips, shapes that differ, a barrier nobody else reaches) and the
tools (`py-spy dump`, torch's debug server, `os.kill`, `torchrun --max-restarts`) are typed in the notebook. Here: the
line a rank waits on in a py-spy dump, the debug server's pages taken apart and read together, every rank's flight
recorder written when a collective times out (the hang lab) and torchfrtrace's report read, the pid of a torchrun
worker to kill, a walltime's SIGTERM-then-SIGKILL, and the exercises' checkers and solutions.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from .ranks import first_error, on_every_rank


def innermost_call(stack, skip=("torch/distributed/c10d_logger.py", "threading.py")) -> str:
    """The innermost frame of the main thread's stack that is not a logging wrapper: `function (file:line)`. `stack`
    is py-spy dump's output: a text, or the list of lines `dump = !py-spy dump --pid PID` captures (coloured)."""
    if not isinstance(stack, str):
        stack = "\n".join(stack)
    stack = re.sub(r"\x1b\[[0-9;]*m", "", stack)  # py-spy colours its output even into a pipe
    main = stack.split("\nThread ")[1] if "\nThread " in stack else stack
    frames = [line.strip() for line in main.splitlines()[1:] if line.startswith("    ") and "(" in line]
    frames = [f for f in frames if not any(s in f for s in skip)]
    return frames[0] if frames else "(no Python frame)"


def torchrun_worker(out: str, local_rank: int = 1, timeout: float = 60) -> int:
    """The pid of the torchrun worker with this LOCAL_RANK whose command line writes to `out` (10 kills it), waiting
    up to `timeout` s for torchrun to start it."""
    import psutil
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if out in (proc.info["cmdline"] or []) and proc.environ().get("LOCAL_RANK") == str(local_rank):
                    return proc.pid
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.05)
    raise TimeoutError(f"no torchrun worker with LOCAL_RANK={local_rank} writing to {out} within {timeout:g} s")


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
    from ..launch import child_processes, commands
    nodes = child_processes.Nodes([command], child_processes.launcher_env())
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
    """An empty runs/<name> (notebook.runs_dir), absolute, so that engines and launchers in other folders find it."""
    from .notebook import runs_dir
    return os.path.abspath(runs_dir(name))


# ------------------------------------------------------------------------------ the debug server (section 5)
# torch.distributed.debug.start_debug_server (torch 2.14) is typed in the notebook; here: waiting for its front end,
# taking its pages apart per rank, the conclusion they allow, and stopping it on every rank.
_RANK_BLOCK = re.compile(r"<h2>Rank (\d+): (\S+?)</h2>\s*(?:<p>Failed to fetch: status=(\d+)</p>\s*)?<pre>(.*?)</pre>",
                         re.S)
_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def wait_for_front_end(port: int, timeout: float = 60) -> None:
    """Wait until rank 0's debug front end accepts connections on 127.0.0.1:port (it starts in a process of its
    own, seconds after start_debug_server returns); TimeoutError after `timeout` s."""
    import socket
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no debug front end on 127.0.0.1:{port} within {timeout:g} s") from None
            time.sleep(0.2)


def by_rank(page: str) -> dict[int, str]:
    """The per-rank parts of a front-end page (/stacks, /fr_trace_json): {rank: text}. A rank whose worker server
    did not answer maps to 'failed: status N'. The pages are HTML that Jinja2 fills without escaping: the text
    between <pre> and </pre> is the worker's answer as it came."""
    return {int(rank): (text if not status else f"failed: status {status}")
            for rank, _url, status, text in _RANK_BLOCK.findall(page)}


def worker_ports(page: str) -> list[int]:
    """The ports of the ranks' worker servers, from the addresses a front-end page names (http://host:port/...)."""
    return [int(re.search(r":(\d+)/", url).group(1)) for _rank, url, _status, _text in _RANK_BLOCK.findall(page)]


def collective_frame(stacks: str) -> tuple[str, str] | None:
    """From one rank's faulthandler dump (the /stacks text): (the torch.distributed function its thread waits in,
    the caller's place: 'line N of the cell' for code run in a notebook, else 'file:line'), or None when no thread
    is inside torch.distributed."""
    for thread in re.split(r"\n\s*\n", stacks):
        frames = _FRAME.findall(thread)  # innermost first
        inside = [i for i, (path, _, _) in enumerate(frames) if "/torch/distributed/" in path]
        if not inside:
            continue
        op = next(fn for path, _, fn in frames if path.endswith("distributed_c10d.py"))
        caller = next(((path, line) for path, line, _ in frames[inside[-1] + 1:]), None)
        if caller is None:
            return op, "(no caller)"
        return op, _place(*caller)
    return None


def _place(path: str, line) -> str:
    """'line N of the cell' for code run in a notebook (IPython's cell files), else 'file:line'."""
    cell = "ipykernel_" in path or re.fullmatch(r"\d+\.py", os.path.basename(path))
    return f"line {line} of the cell" if cell else f"{os.path.basename(path)}:{line}"


def last_collectives(events: str) -> list[dict]:
    """One rank's flight-recorder dump (the /fr_trace_json text) reduced to its latest process group's collectives,
    in order: [{"seq": 1, "op": "all_reduce", "sizes": [[4]], "completed": True}, ...]. The recorder is one ring
    buffer per process, across every process group the process has made, so older groups are dropped."""
    entries = json.loads(events).get("entries", [])
    if not entries:
        return []
    latest = max(e["pg_id"] for e in entries)
    return [{"seq": e["collective_seq_id"], "op": e["profiling_name"].split(":")[-1], "sizes": e["input_sizes"],
             "completed": bool(e["retired"])} for e in entries if e["pg_id"] == latest]


def diagnose(stacks_page: str, events_page: str) -> list[str]:
    """What the debug server's two pages say together, one line per rank and a conclusion: which collective (and
    its sequence number, from the flight recorder) every rank waits in, called from which line (from its stack)."""
    stacks, events = by_rank(stacks_page), by_rank(events_page)
    lines, waiting = [], {}
    for rank in sorted(events):
        if events[rank].startswith("failed:"):
            lines.append(f"rank {rank}: its worker server did not answer ({events[rank]})")
            continue
        done = [c for c in last_collectives(events[rank]) if c["completed"]]
        pending = [c for c in last_collectives(events[rank]) if not c["completed"]]
        so_far = f"collectives #1-#{done[-1]['seq']} completed" if done else "no collective completed"
        frame = collective_frame(stacks.get(rank, ""))
        where = f" ({frame[1]})" if frame else ""
        if pending:
            waiting[rank] = pending[0]
            lines.append(f"rank {rank}: waits in {pending[0]['op']} #{pending[0]['seq']}{where}; {so_far}")
        else:
            lines.append(f"rank {rank}: in no collective; {so_far}")
    seqs = {c["seq"] for c in waiting.values()}
    ops = {c["op"] for c in waiting.values()}
    if len(waiting) < len(events):
        idle = sorted(set(events) - set(waiting))
        lines.append(f"so: rank(s) {idle} never reached the collective the others wait in; look at their stacks")
    elif len(seqs) == 1 and len(ops) > 1:
        seq = seqs.pop()
        calls = ", ".join(f"{c['op']} on rank {r}" for r, c in sorted(waiting.items()))
        lines.append(f"so: collective #{seq} differs between the ranks ({calls}): one rank called a collective "
                     "the others skipped, and from there on the ranks pair the wrong calls")
    elif len(seqs) > 1:
        lines.append("so: the ranks wait at different sequence numbers: the one furthest behind skipped a collective")
    else:
        lines.append("so: every rank waits in the same collective: look for a rank that is slow, not one that skipped")
    return lines


def listening(ports) -> dict[int, str]:
    """{port: the address it listens on} for those of `ports` that some process on this host listens on ('::'
    and '0.0.0.0' mean every interface of the host)."""
    import psutil
    wanted = set(ports)
    return {c.laddr.port: c.laddr.ip for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in wanted}


def stop_debug_server() -> None:
    """On an engine: stop what start_debug_server started on this rank. torch 2.14.1's stop_debug_server works on
    rank 0 only: elsewhere it asserts that the front-end process exists (only rank 0 has one) before it shuts
    anything down, so the other ranks shut their worker server down themselves, as it would."""
    from torch.distributed import debug
    if debug._DEBUG_SERVER_PROC is not None:
        debug.stop_debug_server()  # rank 0: the front end's process and the worker server
    elif debug._WORKER_SERVER is not None:
        debug._WORKER_SERVER.shutdown()
        debug._WORKER_SERVER = None


# ---------------------------------------------------------------------------------------------------- the hang lab
FR_PREFIX = "fr_trace_rank_"  # <folder>/fr_trace_rank_<rank>: torchfrtrace finds the ranks by this prefix


def next_record_id() -> int:
    """The record id the flight recorder gives its next entry: one counter per process, across all its groups."""
    import pickle

    from torch._C._distributed_c10d import _dump_fr_trace
    entries = pickle.loads(_dump_fr_trace(True, False, False)).get("entries", [])
    return max((e["record_id"] for e in entries), default=-1) + 1


def write_flight_record(path: str, since: int = 0) -> None:
    """On an engine: this rank's flight recorder, written to `path` as NCCL's watchdog writes it on a timeout (the
    pickle torchfrtrace reads): the entries recorded since record id `since` (next_record_id() when the code that may
    hang began), for the process groups alive now. Three things are put right first. torch 2.14.1's gloo recorder
    files every group under the name '' in its group table (the table is filled before the group is named) while the
    entries carry the real name, so torchfrtrace cannot match them (KeyError): the table is written again from the
    live groups. The recorder is one ring buffer for every group the process made, where a group made again after a
    destroy gets the old one's name: hence `since`. And its record ids count every collective the process ever made,
    which torchfrtrace lines the ranks up by: they are numbered from 0 again, so ranks that made different numbers
    of collectives before still line up."""
    import pickle

    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace
    from torch.distributed import distributed_c10d as c10d
    record = pickle.loads(_dump_fr_trace(True, True, False))  # collectives, with their stacks, completed ones too
    groups = {c10d._get_process_group_name(pg): pg for pg in c10d._world.pg_names}
    record["pg_config"] = {name: {"name": name, "desc": pg.group_desc, "ranks": str(dist.get_process_group_ranks(pg))}
                           for name, pg in groups.items()}
    record["entries"] = [e for e in record["entries"] if e["record_id"] >= since and e["process_group"][0] in groups]
    for number, entry in enumerate(record["entries"]):
        entry["record_id"] = number
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(pickle.dumps(record))


def collective_error(exc: BaseException) -> str:
    """gloo's error in one line without its source file and addresses: 'Timed out waiting 5000ms for recv operation
    to complete', 'Connection closed by peer'."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).strip())  # "[.../unbound_buffer.cc:78] "
    text = re.sub(r"\s*\[[0-9a-fA-F.:]+\]:\d+", "", text)  # " [127.0.0.1]:61056"
    return text.split(". ")[0].splitlines()[0]


_dump_uses: dict = {}  # folder -> how many blocks have written there in this process (every rank counts the same)


def _from_a_collective(exc: BaseException) -> bool:
    """Whether exc was raised inside torch.distributed (a collective's timeout, a peer gone: gloo raises both as
    plain RuntimeError), not by the learner's own code."""
    import traceback
    return any("/torch/distributed/" in frame.filename.replace("\\", "/")
               for frame in traceback.extract_tb(exc.__traceback__))


@contextlib.contextmanager
def dump_on_timeout(folder: str, wait: float = 60, poll: float = 0.1):
    """On an engine, around code that may hang: for a gloo group, what TORCH_NCCL_DUMP_ON_TIMEOUT=1 has NCCL's
    watchdog do. When a collective inside fails on a rank (the group's timeout, or a peer that gave up), that rank
    asks for the dumps in the group's store and writes its own; every other rank writes the collectives it recorded
    inside the block to <folder>/fr_trace_rank_<rank> from a thread of its own, so a rank still busy in its own work
    writes what it had done by then. A rank whose block ended stays until every rank's has, or until it has written.
    Each rank that wrote says so in one line, and the collective's error is not raised (the point is the dump); any
    other error leaves the block as it came, nothing asked. Every wait is bounded: about 2 x `wait` s at most. The
    group is broken after a failed collective: destroy it."""
    import threading

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    store, rank, size = c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    _dump_uses[folder] = _dump_uses.get(folder, 0) + 1  # a key per use: a folder used twice asks afresh
    key = f"dump_on_timeout:{folder}:{_dump_uses[folder]}"
    path, since = os.path.join(folder, f"{FR_PREFIX}{rank}"), next_record_id()
    written, done, failed, lock = threading.Event(), threading.Event(), [], threading.Lock()

    def write():  # once per rank, by whichever thread gets here first
        with lock:
            if not written.is_set():
                try:
                    write_flight_record(path, since)
                except Exception as exc:  # noqa: BLE001 (raised in the block's thread)
                    failed.append(exc)
                written.set()

    def watch():  # NCCL's watchdog, in short: wait for any rank's word, then write
        while not done.is_set():
            try:
                asked = store.check([key])
            except RuntimeError:  # the store's server (rank 0's process) is gone: nobody can ask any more
                return
            if asked:
                write()
                return
            time.sleep(poll)

    def stop_watching():
        done.set()
        watcher.join(timeout=wait)
        if watcher.is_alive():
            raise TimeoutError(f"rank {rank}: its flight recorder's writer did not stop within {wait:g} s")

    watcher = threading.Thread(target=watch, name="dump_on_timeout", daemon=True)
    watcher.start()
    error = None
    try:
        yield
    except RuntimeError as exc:
        if not _from_a_collective(exc):
            error = exc
        else:  # gloo's timeout, a peer gone: ask the others, then write this rank's own (it is not busy)
            error = exc
            try:
                store.set(key, str(rank))
            except RuntimeError:
                pass  # the store went with rank 0's process: the others cannot be asked any more
            stop_watching()
            write()
    except BaseException:
        error = None
        _leave(store, f"{key}:left")
        stop_watching()
        raise
    if error is not None and not _from_a_collective(error):  # the learner's own error: not a hang
        _leave(store, f"{key}:left")
        stop_watching()
        raise error
    try:  # stay until every rank has left its block (then no dump was asked), or this rank has written
        left, deadline = store.add(f"{key}:left", 1), time.monotonic() + wait
        while not written.is_set() and time.monotonic() < deadline and (left < size or store.check([key])):
            time.sleep(poll)
            left = store.add(f"{key}:left", 0)
    except RuntimeError:  # the store is gone: nobody can ask any more
        pass
    stop_watching()
    if failed:
        raise failed[0]
    if written.is_set():
        said = collective_error(error) if error is not None else "another rank's collective failed"
        print(f"rank {rank}: {said}; flight recorder written")


def _leave(store, counter: str) -> None:
    """Count this rank out of a dump_on_timeout block, so that no rank waits for it; a store gone is no matter."""
    try:
        store.add(counter, 1)
    except RuntimeError:
        pass


def fr_summary(report) -> str:
    """torchfrtrace's first finding as the notebook prints it: its lines up to the stack of the call (the call of
    the rank it compared the others with), without the recorder's internal record id, and then the stack's line in
    the learner's code ('line 9 of the cell', as collective_frame says it) in place of the stack's thirty frames."""
    lines = report.splitlines() if isinstance(report, str) else list(report)
    at = next((i for i, line in enumerate(lines) if line.startswith("collective stack trace")), len(lines))
    kept = [line for line in lines[:at] if not line.startswith("internal record id")]
    for line in lines[at + 1:]:
        frame = re.match(r"\s*(\S+) at (.+):(\d+)$", line)
        if frame and "/torch/" not in frame.group(2):
            kept.append(f"called at {_place(frame.group(2), frame.group(3))}")
            break
    return "\n".join(kept)


def fr_verdicts(report) -> list[str]:
    """torchfrtrace's report (`report = !torchfrtrace FOLDER 2>&1`), one line per problem it found, in words that do
    not depend on which rank it compared the others with (the rank of the first file the file system lists):
    'collective #4: rank(s) {1} never joined all_reduce', 'collective #4: COLLECTIVE_TYPE_MISMATCH (all_reduce,
    barrier)' (the two types in alphabetical order); ['no mismatch'] for a report that found nothing. A report this
    cannot read (a traceback, missing dumps, a verdict of another kind) raises ValueError, never 'no mismatch'."""
    text = report if isinstance(report, str) else "\n".join(report)
    verdicts = []
    for block in re.split(r"\n(?=Collective sequence number|Not all ranks joining)", "\n" + text):
        seq = re.search(r"sequence number:?\s*(\d+)", block)
        if not seq or not block.startswith(("Collective sequence number", "Not all ranks joining")):
            continue
        op = re.search(r"^collective: \w+:(\w+)", block, re.M)
        missing = re.search(r"^missing ranks: (\{.*\})", block, re.M)
        error = re.search(r"^error msg: Culprit rank \d+; Error type: (\w+), (.*)$", block, re.M)
        if missing:
            verdicts.append(f"collective #{seq.group(1)}: rank(s) {missing.group(1)} never joined "
                            f"{op.group(1) if op else 'it'}")
        elif error:
            types = re.findall(r"collective type: '(\w+)'", error.group(2))
            said = f" ({', '.join(sorted(set(types)))})" if types else f": {error.group(2)}"
            verdicts.append(f"collective #{seq.group(1)}: {error.group(1)}{said}")
        else:
            raise ValueError(f"torchfrtrace reported what this does not read: {block.strip()[:300]}")
    unread = [line for line in text.splitlines() if re.search(r"Traceback|Error|cannot decide|Missing dump", line)
              and not line.startswith("error msg:")]
    if unread:
        raise ValueError(f"torchfrtrace's report is not a verdict: {unread[-1][:300]}")
    return verdicts or ["no mismatch"]


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


# ------------------------------------------------------------------------- two DDP errors (exercises 3 and 4)
def _rank_and_size(rank: int, world_size: int) -> tuple:
    return rank, world_size


def skip_net():
    """A model whose forward never uses `spare` (an auxiliary head left in, a branch not taken): under plain DDP
    its gradient never arrives, and the second step fails with "Expected to have finished reduction ..."."""
    import torch
    from torch import nn

    class SkipNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 8)
            self.head = nn.Linear(8, 1)
            self.spare = nn.Linear(8, 1)  # defined, never called

        def forward(self, x):
            return self.head(torch.relu(self.body(x)))

    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return SkipNet()


def _unused_batch(rank: int, step: int):
    import torch
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


UNUSED_STEPS = 3


def _unused_probe():
    import torch
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(7))


def _unused_trial(wrap, rank: int, world_size: int):
    """On an engine, in a group: wrap(model), then UNUSED_STEPS SGD steps on this rank's batches. Returns whether the
    result is a DDP model, whether its output before training equals the unwrapped skip_net's (a fix must not change
    what the model computes), and the weights the model still has after training."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = wrap(skip_net())
    if not isinstance(model, torch.nn.Module):
        return {"returned": type(model).__name__}
    with torch.no_grad():
        same_output = torch.allclose(model(_unused_probe()), skip_net()(_unused_probe()), atol=1e-6)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(UNUSED_STEPS):
        x, y = _unused_batch(rank, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    inner = model.module if isinstance(model, DDP) else model
    return {"ddp": isinstance(model, DDP), "same_output": same_output,
            "weights": {name: p.detach().clone() for name, p in inner.named_parameters()}}


def check_unused(cluster, wrap) -> str:
    """Exercise 3: wrap(model) must give a model that trains under DDP although model.spare is never used, with
    the gradients averaged over the ranks: the weights it still has equal one process's on both ranks' batches
    together. Every correct fix passes: find_unused_parameters=True, static_graph=True, removing `spare` (md's "best
    of all") or freezing it; a fix that changes what the model computes, drops a layer the forward uses or leaves
    the model unwrapped does not."""
    import torch
    cluster.run(on_every_rank, _unused_trial, wrap, inputs=_rank_and_size, seconds=10.0)
    failed = first_error(cluster.results)
    if failed and "Expected to have finished reduction" in failed[1]:
        return (f"wrong: rank {failed[0]} stopped at the second step with \"Expected to have finished reduction in "
                "the prior iteration ...\": DDP waits for a gradient of every parameter, and model.spare never gets "
                "one; tell DDP to look for unused parameters (find_unused_parameters=True) or that the graph is "
                "the same every step (static_graph=True), or remove the layer the forward never uses")
    if failed:
        return f"wrong: rank {failed[0]} raised {failed[1]}"
    reference = skip_net()  # one process, both ranks' batches at once: what averaged gradients must give
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(UNUSED_STEPS):
        x, y = (torch.cat(t) for t in zip(*(_unused_batch(r, step) for r in range(cluster.n))))
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
    used = [n for n, _ in reference.named_parameters() if not n.startswith("spare.")]  # what the forward needs
    for rank, (_, got) in enumerate(cluster.results):
        if "returned" in got:
            return f"wrong: rank {rank}: wrap returned a {got['returned']}, not the model wrapped for training"
        missing = [n for n in used if n not in got["weights"]]
        if missing:
            return (f"wrong: rank {rank}: the model has no {missing[0]} any more, but the forward uses it; remove "
                    "only the layer the forward never calls (spare)")
        if not got["same_output"]:
            return (f"wrong: rank {rank}: the model's output changed: a fix may tell DDP about the unused layer, or "
                    "remove it, but not change what the model computes (spare must not add to the output)")
        for name, p in reference.named_parameters():
            if name in got["weights"] and not torch.allclose(got["weights"][name], p.detach(), atol=1e-6):
                return (f"wrong: rank {rank}'s {name} differs from one process trained on all ranks' batches: the "
                        "gradients were not averaged over the ranks; the model must still be wrapped in DDP"
                        + ("" if got["ddp"] else " (wrap returned it unwrapped)"))
    kept = "without spare" if "spare.weight" not in cluster.results[0][1]["weights"] else "spare unchanged"
    return (f"correct: {UNUSED_STEPS} steps on every rank, weights equal to one process on all batches ({kept})")


def _uneven_batches(rank: int):
    import torch
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)) for _ in range(3 + 2 * rank)]


def _uneven_trial(train, rank: int, world_size: int):
    """On an engine, in a group: a DDP model and 3 + 2 * rank batches (rank 0 has 3, rank 1 has 5); train(model,
    batches); how many batches this rank's model saw and its weights."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    inner = torch.nn.Linear(4, 1)
    seen = []
    inner.register_forward_hook(lambda module, args, out: seen.append(1))
    train(DDP(inner), _uneven_batches(rank))
    return {"batches": len(seen), "weights": [p.detach().clone() for p in inner.parameters()]}


def check_uneven(cluster, train, seconds: float = 10.0) -> str:
    """Exercise 4: rank r has 3 + 2r batches; train(model, batches) must train on all of them on every rank and
    end with identical replicas, without hanging (collectives give up after `seconds`)."""
    import torch
    cluster.run(on_every_rank, _uneven_trial, train, inputs=_rank_and_size, seconds=seconds)
    counts = [len(_uneven_batches(r)) for r in range(cluster.n)]
    failed = first_error(cluster.results)
    if failed and failed[1].startswith(("RuntimeError", "DistBackendError", "DistError")):
        # the error itself is gloo's "Connection closed by peer [host]:port" or a timeout, depending on timing
        return (f"wrong: rank {failed[0]} failed in a collective: the ranks have {counts} "
                f"batches; once rank 0 has run out, the others wait in a gradient all-reduce nobody joins. Train "
                "inside `with Join([model]):` (torch.distributed.algorithms.join), which makes a finished rank "
                "join the others' collectives")
    if failed:
        return f"wrong: rank {failed[0]} raised {failed[1]}"
    for rank, (_, got) in enumerate(cluster.results):
        if got["batches"] != counts[rank]:
            return (f"wrong: rank {rank} trained on {got['batches']} of its {counts[rank]} batches: every batch "
                    "must be used; let the ranks that finish first join the others (Join) instead of cutting")
    first = cluster.results[0][1]["weights"]
    for rank, (_, got) in enumerate(cluster.results[1:], start=1):
        if not all(torch.equal(a, b) for a, b in zip(first, got["weights"])):
            return (f"wrong: rank {rank}'s weights differ from rank 0's: the extra steps were not all-reduced (a "
                    "rank trained on its own); train the DDP model itself inside `with Join([model]):`")
    return f"correct: the ranks trained on {counts} batches, no hang, identical replicas"


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


def solution_wrap(model):
    from torch.nn.parallel import DistributedDataParallel as DDP
    del model.spare  # best of all: no unused layer, nothing for DDP to wait for or to search every step
    return DDP(model)  # or keep it: DDP(model, find_unused_parameters=True) or DDP(model, static_graph=True)


def solution_train(model, batches):
    import torch
    from torch.distributed.algorithms.join import Join
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Join([model]):  # a rank out of batches shadows the others' all-reduces until every rank is done
        for x, y in batches:
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    return model

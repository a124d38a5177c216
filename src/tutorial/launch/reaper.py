"""A cluster's reaper: the process that stops the cluster's processes when the kernel that started them goes.

Engines run in sessions of their own, so a restarted, shut down or killed kernel would leave them running. start()
starts `python -m tutorial.launch.reaper CLUSTER_FILE TAG` in a session of its own too, with a pipe as its stdin. The
pipe ends when the kernel closes it (Cluster.stop) or dies. If ipyparallel's cluster file is still there (stop()
removes it; a kernel that died may not have), the reaper stops what the file lists; then, in every case, every
process that carries the cluster's tag.
"""
from __future__ import annotations

import os
import subprocess
import sys

from . import child_processes
from .engine_options import IPP_LOG


def start(cluster_file: str, tag: str) -> subprocess.Popen:
    """The reaper of the cluster whose processes carry `tag`; it waits for release(), or for this process to die."""
    return subprocess.Popen([sys.executable, "-m", __name__, cluster_file, tag], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, env=dict(os.environ, **{child_processes.TAG_VARIABLE: tag}),
                            start_new_session=True)


def release(reaper: subprocess.Popen, timeout: float = 30.0) -> None:
    """Let the reaper stop what is left and exit; after `timeout` seconds, go on (a sweep by tag ends it too)."""
    reaper.stdin.close()
    try:
        reaper.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass


def reap(cluster_file: str, tag: str) -> None:
    """Wait for the pipe to end, then stop the cluster and every process with its tag. The sweep runs even where
    the cluster file is gone: a kernel killed in the middle of its stop (a restart kills it 5 s after asking it to
    shut down, and ipyparallel's own stop at exit removes the file before its engines are gone) left an engine and
    its nanny running until their 175 s without a hub (test_cluster, under load, 2026-11-30)."""
    sys.stdin.read()
    try:
        if os.path.exists(cluster_file):
            import ipyparallel as ipp
            ipp.Cluster.from_file(cluster_file, log=IPP_LOG).stop_cluster_sync()
    finally:
        child_processes.stop(child_processes.leftovers(tag))


if __name__ == "__main__":
    reap(*sys.argv[1:])

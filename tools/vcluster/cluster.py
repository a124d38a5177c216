"""The whole virtual cluster: the nodes (vcluster.nodes) and, when asked, Slurm on them (vcluster.slurm).

Slurm runs on the nodes, so slurm imports nodes; what takes both up and down together lives here, above the two,
so that nodes knows nothing of Slurm and no module of the tool imports one that imports it back.
"""
from __future__ import annotations

import contextlib

from . import nodes, slurm


def up(n: int, with_slurm: bool = False, quiet: bool = False, gpus: int = 0, cpus: int | None = None) -> list[str]:
    """Create node1..nodeN (replacing a virtual cluster that is up, Slurm included), and start Slurm on them if
    asked (with `gpus` GPUs and `cpus` cores per node for its jobs); on any error, nothing is left up."""
    down(quiet=True)
    names = nodes.up(n, quiet=True)
    try:
        if with_slurm:
            slurm.up(quiet=True, gpus=gpus, cpus=cpus)
    except BaseException:
        down(quiet=True)
        raise
    if not quiet:
        print(f"up: {', '.join(f'{m} ({nodes.address(m)})' for m in names)} on {nodes.SWITCH}"
              f"{'; Slurm: slurmctld on node1, slurmd on every node' if with_slurm else ''}")
    return names


def down(quiet: bool = False) -> None:
    """Stop Slurm (jobs, daemons, munged, their files), then remove the nodes. Safe to repeat."""
    nodes.require_root()
    slurm.down(quiet=True)
    nodes.down(quiet=quiet)


@contextlib.contextmanager
def cluster(n: int = 2, with_slurm: bool = False, lock_timeout: float = 900.0, gpus: int = 0,
            cpus: int | None = None):
    """`with cluster.cluster(2) as names:` a fresh virtual cluster, removed afterwards, even after an error."""
    nodes.require_root()
    with nodes.lock(lock_timeout):
        try:
            yield up(n, with_slurm=with_slurm, quiet=True, gpus=gpus, cpus=cpus)
        finally:
            down(quiet=True)

"""The worker of the hand-written launch (seed 004's demo 3), one command per node:

    python -m tutorial.launch.worker --init-method tcp://NODE0:29500 --rank 0 --world-size 2     # on node 0
    python -m tutorial.launch.worker --init-method tcp://NODE0:29500 --rank 1 --world-size 2     # on node 1

It joins a gloo group, all-reduces, broadcasts rank 0's random weights and prints one JSON line of what it saw.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import socket
import sys
import time


def rank_report(init_method: str = "env://", rank: int | None = None, world_size: int | None = None,
                hold: float = 0.0) -> dict:
    """Inside one process: join the group, all-reduce, broadcast rank 0's random weights, report what it saw."""
    import torch
    import torch.distributed as dist

    kwargs = {} if rank is None else dict(rank=rank, world_size=world_size)
    dist.init_process_group("gloo", init_method=init_method, timeout=datetime.timedelta(seconds=60), **kwargs)
    try:
        me, n = dist.get_rank(), dist.get_world_size()
        total = torch.tensor([float(me + 1)])
        dist.all_reduce(total)  # 1 + 2 + ... + n on every rank
        weights = torch.randn(1000, generator=torch.Generator().manual_seed(1234 + me))
        dist.broadcast(weights, src=0)  # what DDP does when it wraps a model: everyone starts from rank 0's copy
        digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()[:16]
        digests = [None] * n
        dist.all_gather_object(digests, digest)
        if hold:
            print(f"rank {me} joined, holding {hold} s", flush=True)
            time.sleep(hold)
        return dict(rank=me, world_size=n, all_reduce_sum=int(total.item()),
                    weights_match_rank_0=len(set(digests)) == 1, init_method=init_method.split(":")[0],
                    host=socket.gethostname(), pid=os.getpid())
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Join a gloo process group with an explicit rank (seed 004).")
    parser.add_argument("--init-method", default="env://", help="tcp://HOST:PORT, file:///shared/path or env://")
    parser.add_argument("--rank", type=int, default=None, help="this process's rank (default: from the launcher)")
    parser.add_argument("--world-size", type=int, default=None, help="how many processes join in all")
    parser.add_argument("--hold", type=float, default=0.0, help="seconds to stay in the group before leaving")
    args = parser.parse_args(argv)
    if (args.rank is None) != (args.world_size is None):
        parser.error("give --rank and --world-size together, or neither (then a launcher sets them)")
    # One write per line: ranks that share a launcher's unbuffered stdout would otherwise interleave their lines.
    sys.stdout.write(json.dumps(rank_report(args.init_method, args.rank, args.world_size, args.hold)) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

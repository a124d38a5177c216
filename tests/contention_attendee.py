"""One attendee's notebook, as a process of its own, for tests/test_races.py: start 2 engines, then rendezvous after
rendezvous on them the ways the notebooks do (a process group typed in a %%px cell, Lightning adopting the engines,
a trainer through cluster.run), and print one JSON line with what happened. Several of these at once, beside
torchrun launches and the unit tests, are the contention that hung 08 in CI (issue 38).

    python tests/contention_attendee.py ROUNDS OUT_DIR
"""
from __future__ import annotations

import json
import os
import sys
import time

# A process group made by hand, as 00 [10] and 03a [9] type it: env://, the engines' RANK, WORLD_SIZE, MASTER_ADDR
# and MASTER_PORT (new_master_port's), one all-reduce whose sum proves both ranks met, then leave the group.
BY_HAND = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
dist.destroy_process_group()
"""


def lightning_on_the_engines(steps: int = 3) -> int:
    """08 [13]: Lightning's DDP over the engines, which creates the process group itself (env://, MASTER_PORT)."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from tutorial.core.distributed import world_from_env
    from tutorial.core.lightning_glue import LaunchedDDP, WorldEnvironment, quiet_lightning

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            X, y = batch
            return torch.nn.functional.mse_loss(self.layer(X), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    world = world_from_env()
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    with quiet_lightning():
        trainer = L.Trainer(accelerator="cpu", devices=world.local_world_size, max_steps=steps,
                            strategy=LaunchedDDP(cluster_environment=WorldEnvironment(world)), logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Tiny(), DataLoader(data, batch_size=8))
    torch.distributed.destroy_process_group()
    return trainer.global_step


def main(rounds: int, out: str) -> dict:
    from tutorial.core.config import TrainConfig
    from tutorial.launch import engines
    from tutorial import train_ddp

    started = time.monotonic()
    report = {"pid": os.getpid(), "by_hand": 0, "lightning": 0, "trainer": 0}
    with engines.start(n=2, show=False, activate=False) as cluster:
        report["start_s"] = round(time.monotonic() - started, 1)
        for i in range(rounds):
            cluster.new_master_port()
            cluster.view.execute(BY_HAND, block=True)
            sums = cluster.view["total"]
            assert [t.item() for t in sums] == [3.0, 3.0], sums
            report["by_hand"] += 1
        cluster.new_master_port()
        assert cluster.view.apply_sync(lightning_on_the_engines) == [3, 3]
        report["lightning"] += 1
        cfg = TrainConfig.preset("smoke", epochs=1, max_steps=3, out=os.path.join(out, "ddp"), quiet=True)
        metrics = cluster.run(train_ddp.main, cfg, timeout=300)
        assert metrics["replicas_identical"], metrics
        report["trainer"] += 1
        report["leftovers"] = len(cluster.leftovers())
    report["left_after_stop"] = len(cluster.leftovers())
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2])), flush=True)

"""The course's LaunchedDDP runs where a launcher gives each rank one device of its own (two real processes).

What 08 types for its plain Lightning launches is run by strict nbval, not here: cell 33 launches the notebook's
lit_plain.py under torchrun and cell 34 checks its world size, ranks, sampler and accuracy; cell 36 forks the kernel
with ddp_notebook. (This file used to grep those cells' source, which nbval runs anyway, and to test Lightning's own
SLURMEnvironment and TorchElastic checks of devices x num_nodes, which are Lightning 2.6.6's behaviour, pinned in
requirements.txt, not the course's code: review 5, §2.3 #12.)"""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT, env


PER_TASK = '''
import json, sys
import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from tutorial.core.distributed import init_process_group, world_from_env
from tutorial.core.lightning_glue import LaunchedDDP, WorldEnvironment, quiet_lightning

class Plain(LaunchedDDP):  # the control: Lightning's own device and sampler rules
    root_device = L.pytorch.strategies.DDPStrategy.root_device
    distributed_sampler_kwargs = L.pytorch.strategies.DDPStrategy.distributed_sampler_kwargs

class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

world = world_from_env()
init_process_group(world, torch.device("cpu"), timeout=60)
strategy = (Plain if sys.argv[1] == "plain" else LaunchedDDP)(cluster_environment=WorldEnvironment(world))
# devices=1: what each rank gets where a launcher binds one GPU per task (each rank sees only its own)
with quiet_lightning():
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=world.world_size // world.local_world_size,
                        strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer.fit(Tiny(), DataLoader(data, batch_size=8))
sampler = trainer.train_dataloader.sampler
# a file per rank: the ranks share torchrun's unbuffered stdout, where two lines can interleave
with open(f"{sys.argv[2]}/rank{world.rank}.json", "w") as f:
    json.dump(dict(rank=world.rank, replicas=sampler.num_replicas, sampler_rank=sampler.rank), f)
torch.distributed.destroy_process_group()
'''


def test_lightning_runs_where_each_rank_sees_one_device_of_its_own(tmp_path):
    """Slurm's --gpus-per-task=1: every rank sees one GPU (its own, as cuda:0), so each rank's Trainer gets devices=1
    while its node runs several ranks. Lightning's own rules index this node's one-entry device list by local rank
    (rank 1 fails) and count the sampler's replicas as nodes x devices (1, so every rank would train on all the
    data). LaunchedDDP takes the device as pick_device does and the replicas from the launcher. Shown with CPU
    devices, the same rules; the control is Lightning's own."""
    script = tmp_path / "per_task.py"
    script.write_text(PER_TASK)

    def launch(rules: str):
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               str(script), rules, str(tmp_path)], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env())

    ours = launch("launched")
    assert ours.returncode == 0, ours.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert seen == [dict(rank=r, replicas=2, sampler_rank=r) for r in range(2)]
    plain = launch("plain")
    assert plain.returncode != 0 and "IndexError" in plain.stderr, plain.stderr[-3000:]

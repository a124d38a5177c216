"""08's plain Lightning launches: the notebook types them (a %%writefile script with strategy="ddp", devices and
num_nodes under a typed !torchrun, an srun line, ddp_notebook on the CPU), and what its prose says Lightning does
with a launcher's variables holds: Slurm's and torchrun's variables give the ranks, and devices/num_nodes that do not
match the job stop the run before any process group (faked environments, no processes started). And the course's
LaunchedDDP runs where a launcher gives each rank one device of its own (two real processes)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import lightning as L
import pytest
from conftest import ROOT, env

NB = ROOT / "notebooks" / "08_lightning.ipynb"


def _cells(kind: str) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(NB.read_text())["cells"] if c["cell_type"] == kind]


def test_08_types_the_plain_launches():
    code, prose = _cells("code"), "\n".join(_cells("markdown"))
    script = next(c for c in code if c.startswith("%%writefile runs/08_lightning/lit_plain.py"))
    assert 'strategy="ddp"' in script and "num_nodes=args.num_nodes" in script and "devices=args.devices" in script
    assert "tutorial" not in script  # no course code in the plain script
    launch = next(c for c in code if re.search(r"^!.*\btorchrun --standalone --nproc_per_node 2 .*lit_plain\.py", c, re.M))
    assert "{alloc.env}" in launch and "notebook.allocation(2, cfg" in launch  # the allocation's GPUs, or none
    assert re.search(r"srun python lit_plain\.py --devices 4 --num-nodes 2", prose)
    assert "#SBATCH --nodes=2" in prose and "#SBATCH --ntasks-per-node=4" in prose
    forked = next(c for c in code if 'strategy="ddp_notebook"' in c)
    assert 'accelerator="cpu"' in forked and "CUDA must not be initialised" in prose


def _trainer(devices: int, num_nodes: int) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy="ddp", logger=False,
                     enable_progress_bar=False, enable_model_summary=False)


SLURM = dict(SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="4", SLURM_NNODES="2", SLURM_PROCID="5", SLURM_LOCALID="1",
             SLURM_NODEID="1", SLURM_NODELIST="node[1-2]", SLURM_JOB_NAME="lit")


def test_srun_with_num_nodes_2_devices_4_is_a_world_of_8(monkeypatch):
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    trainer = _trainer(devices=4, num_nodes=2)
    assert type(trainer.strategy.cluster_environment).__name__ == "SLURMEnvironment"
    assert (trainer.world_size, trainer.global_rank, trainer.node_rank, trainer.local_rank) == (8, 5, 1, 1)
    assert trainer.strategy.cluster_environment.main_address == "node1"  # the job's first node


def test_srun_without_num_nodes_stops_before_training(monkeypatch):
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    trainer = _trainer(devices=4, num_nodes=1)
    with pytest.raises(ValueError, match=r"`--nodes=2` does not match"):
        trainer.strategy.launcher.launch(lambda: None, trainer=trainer)  # what fit() calls first


def test_torchrun_world_that_devices_times_num_nodes_does_not_make_stops(monkeypatch):
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", TORCHELASTIC_RUN_ID="x").items():
        monkeypatch.setenv(name, value)
    for name in SLURM:
        monkeypatch.delenv(name, raising=False)
    trainer = _trainer(devices=2, num_nodes=2)
    assert type(trainer.strategy.cluster_environment).__name__ == "TorchElasticEnvironment"
    with pytest.raises(ValueError, match=r"\(2 \* 2\) does not match the world size \(2\)"):
        trainer.strategy.launcher.launch(lambda: None, trainer=trainer)


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

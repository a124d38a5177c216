"""08's plain Lightning launches: the notebook types them (a %%writefile script with strategy="ddp", devices and
num_nodes under a typed !torchrun, an srun line, ddp_notebook on the CPU), and what its prose says Lightning does
with a launcher's variables holds: Slurm's and torchrun's variables give the ranks, and devices/num_nodes that do not
match the job stop the run before any process group (faked environments, no processes started)."""
from __future__ import annotations

import json
import re

import lightning as L
import pytest
from conftest import ROOT

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

"""Lightning plumbing for train_lightning.py (08_lightning): where the ranks come from, and the run records every
trainer writes. Infrastructure, not the lesson: the notebook shows the LightningModule and the Trainer.

It lives in core, not beside its trainer, because lessons.lightning and notebook 08 build a Trainer from the same
pieces (a module beside train_lightning.py would be a trainer-room module that only one trainer reads; the trainer
file stays what the notebook shows)."""
from __future__ import annotations

import contextlib
import logging
import time
import warnings

import lightning as L
import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.strategies import DDPStrategy

from .distributed import rendezvous


class WorldEnvironment(ClusterEnvironment):
    """Who am I, from the same world_from_env as every trainer: torchrun, mpirun, srun, PALS or the notebook
    engines started the processes (Lightning must not start any), and the process group already exists. A
    ClusterEnvironment (as Lightning's SLURMEnvironment or TorchElasticEnvironment): it answers, it launches nothing."""

    def __init__(self, world):
        super().__init__()
        self.world, self._chosen = world, None

    @property
    def creates_processes_externally(self) -> bool:
        return True

    # Lightning asks where to meet only to make the process group, and it exists already (init_process_group, or a
    # %%px cell): then these are never read. Without a group they are the rendezvous core.distributed would choose.
    @property
    def main_address(self) -> str:
        return self._meeting()[0]

    @property
    def main_port(self) -> int:
        return self._meeting()[1]

    def _meeting(self) -> tuple[str, int]:
        if self._chosen is None:  # once: a lone process holds a new port at each rendezvous()
            self._chosen = rendezvous(self.world)
        return self._chosen

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return self.world.world_size

    def global_rank(self) -> int:
        return self.world.rank

    def local_rank(self) -> int:
        return self.world.local_rank

    def node_rank(self) -> int:
        return self.world.rank // self.world.local_world_size

    def set_world_size(self, size: int) -> None:
        pass  # fixed by the launcher

    def set_global_rank(self, rank: int) -> None:
        pass


class RunRecord(L.Callback):
    """The metrics.json, TensorBoard scalars and console lines of every other trainer, from Lightning's hooks
    (RunLog writes on rank 0 only). Its history travels in Lightning's checkpoint, so a resumed run keeps it."""

    def __init__(self, log, world_size: int):
        self.run_log, self.world_size = log, world_size

    def on_train_epoch_start(self, trainer, module):
        self.start, self.samples, self.seconds = time.perf_counter(), 0, None
        self.stepped = trainer.global_step  # on_train_batch_end logs a step when this changes
        if self.run_log.timer:  # --time-steps: the epoch's first step counts from here, as in the other trainers
            self.run_log.timer.start_epoch()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.samples += len(batch[1])
        if self.run_log.timer:
            self.run_log.timer.samples += len(batch[1])
        if trainer.global_step != self.stepped:  # this micro-batch ended an optimizer step
            self.stepped = trainer.global_step
            self.run_log.step(trainer.global_step, outputs["loss"], trainer.optimizers[0].param_groups[0]["lr"], 1.0)

    def on_validation_epoch_start(self, trainer, module):
        if self.seconds is None and trainer.training:  # the epoch's training ends where its evaluation begins
            self.seconds = time.perf_counter() - self.start

    def on_train_epoch_end(self, trainer, module):
        m, seconds = trainer.callback_metrics, self.seconds or time.perf_counter() - self.start
        self.pending = dict(epoch=trainer.current_epoch, train_loss=m["train_loss"].item(),
                            samples_per_second=self.samples * self.world_size / seconds, epoch_seconds=seconds,
                            lr=trainer.optimizers[0].param_groups[0]["lr"], skipped_steps=0)
        if "test_loss" in m:  # evaluated at the epoch's end; not when --max-steps stopped it earlier
            self.record_epoch(trainer)

    def record_epoch(self, trainer):
        """The epoch's line and record, once its evaluation is done (train_lightning evaluates an epoch that
        --max-steps cut short after fit, as the other trainers do)."""
        m, record, self.pending = trainer.callback_metrics, self.pending, None
        record.update(test_loss=m["test_loss"].item(), test_accuracy=m["test_accuracy"].item())
        self.run_log.epoch(record, trainer.global_step)
        self.run_log.metrics["test_top5_accuracy"] = m["test_top5_accuracy"].item()  # beside test_accuracy

    def state_dict(self):
        return {"history": self.run_log.metrics["epochs"]}

    def load_state_dict(self, state):
        self.run_log.metrics["epochs"][:] = state["history"]


class LaunchedDDP(DDPStrategy):
    """DDP over processes that a launcher or the notebook engines started. Lightning's DDPStrategy always prepares
    its own script launcher, which refuses to run where Python is interactive (the engines are IPython kernels);
    with processes started elsewhere there is nothing for it to launch. Its default timeout is torch's default when
    the strategy is made (DDPStrategy's own froze torch's 30 minutes at import), so the bound that the notebook
    engines set for process groups made in %%px cells (launch.engines.RENDEZVOUS_BOUND_S) holds for Lightning's."""

    def __init__(self, *args, **kwargs):
        if "timeout" not in kwargs:
            from torch.distributed import distributed_c10d
            kwargs["timeout"] = distributed_c10d.default_pg_timeout
        super().__init__(*args, **kwargs)

    def _configure_launcher(self) -> None:
        self._launcher = None

    @property
    def root_device(self) -> torch.device:
        """This rank's device as pick_device takes it. Where a launcher binds one GPU to each task (Slurm
        --gpus-per-task=1), a rank sees only its own GPU, so this node's device list has one entry, and Lightning's
        parallel_devices[local_rank] would be out of range on every rank but the first."""
        devices = self.parallel_devices
        return devices[self.local_rank % len(devices)]

    @property
    def distributed_sampler_kwargs(self) -> dict:
        """Every rank of the job shares the data, as the launcher counts them (Lightning's nodes x this node's
        devices is 1 per node where each task sees one GPU)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}


@contextlib.contextmanager
def quiet_lightning():
    """While Lightning runs: hide its advice that does not apply here. We start the processes ourselves (also where
    srun exists), out/ also holds metrics.json and tb/, and no cloud logger is wanted."""
    def not_litlogger(record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()

    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addFilter(not_litlogger)
    try:
        with warnings.catch_warnings():
            for message in ("The `srun` command is available", "Checkpoint directory .* exists and is not empty",
                            r"`isinstance\(treespec, LeafSpec\)` is deprecated"):
                warnings.filterwarnings("ignore", message)
            yield
    finally:
        logger.removeFilter(not_litlogger)

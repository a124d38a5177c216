"""What a trainer's training loop reads and updates, in one object (every loop trainer's train_one_epoch and fit)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .checkpoint import State
from .config import TrainConfig
from .precision import Precision
from .tracking import RunLog


@dataclass
class Loop:
    """The run as the loop sees it. main() builds it once; train_one_epoch, evaluate and fit take it instead of ten
    positional parameters. The trainer's model and optimizer are here as the trainer built them (wrapped by DDP,
    sharded by FSDP, a DeepSpeed engine): the loop code is the same for all of them."""
    cfg: TrainConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    precision: Precision   # autocast and, for fp16, the loss scaler
    device: torch.device
    peak_lr: float         # the lr after warm-up (cfg.lr, scaled for the global batch where a trainer scales it)
    log: RunLog
    state: State           # epoch and step so far; resumed from a checkpoint where there is one
    stopping: bool = False  # a SIGTERM was agreed on: fit stops once the state is saved (never saved itself)

    def stop(self, i: int, batches: int) -> None:
        """Stop after batch i of the epoch's `batches` (on SIGTERM): fit saves the state and raises Stopped. Mid-epoch,
        state.batch says where the resumed run goes on; after an epoch's last batch the epoch is finished and saved as
        usual, then the trainer stops."""
        self.stopping = True
        self.state.batch = i + 1 if i + 1 < batches else 0

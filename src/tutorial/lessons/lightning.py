"""What notebook 08_lightning needs besides train_lightning: the launch commands, seed 000's figures, and the
exercises' checkers and solutions. The Lightning code itself stays in the notebook's cells."""
from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F

from ..core.config import TrainConfig
from .ranks import describe, first_line

# A Trainer asks mpi4py whether it runs under MPI, which starts Open MPI in this kernel as a "singleton" with a
# helper daemon (orted) that would outlive the lesson; isolated singletons start none.
os.environ.setdefault("OMPI_MCA_ess_singleton_isolated", "1")


# ------------------------------------------------------------------------------------------------------ seed 000
SEED000_EPOCH_SECONDS = {1: 45.48, 2: 23.9, 4: 12.1, 8: 6.16}  # seed 000's table: processes -> seconds per epoch


def seed000_scaling() -> list[dict]:
    """Seed 000's benchmark (two nodes, RTX 2080 Ti, InfiniBand; --batch_size 2 --max_epochs 3 --profiler simple):
    seconds per epoch, with the speed-up and efficiency worked out."""
    one = SEED000_EPOCH_SECONDS[1]
    return [{"processes": n, "seconds per epoch": s, "speed-up": one / s, "efficiency %": 100 * one / s / n}
            for n, s in SEED000_EPOCH_SECONDS.items()]


def seed000_translated(hosts: str = "node1:4,node2:4", np: int = 8) -> dict[str, str]:
    """Seed 000's `horovodrun -np 8 -H node1:4,node2:4 python template.py ...` for a Lightning 2.x trainer, which has
    no Horovod strategy: the same ranks started by mpirun, or by torchrun on every node."""
    nodes = [h.split(":") for h in hosts.split(",")]
    per_node = int(nodes[0][1])
    script = "python -m tutorial.train_lightning --batch-size 2 --epochs 3"
    return {
        "seed 000 (Lightning 1.3 + Horovod)": f"horovodrun -np {np} -H {hosts} python template.py "
                                             f"--batch_size 2 --max_epochs 3",
        "mpirun (Open MPI)": f"mpirun -np {np} -H {hosts} {script}",
        "torchrun, on each node": f"torchrun --nnodes {len(nodes)} --nproc_per_node {per_node} "
                                  f"--rdzv-backend c10d --rdzv-endpoint {nodes[0][0]}:29500 -m tutorial.train_lightning "
                                  f"--batch-size 2 --epochs 3",
        "Slurm": f"srun -N {len(nodes)} --ntasks-per-node {per_node} {script}",
    }


# -------------------------------------------------------------------------------------- exercise 1: training_step
def _tiny_fit(module_cls, steps: int = 3):
    """Fit a LightningModule for a few steps in this process (one CPU device) and return its parameters, the value
    training_step returned, and the metrics it logged."""
    import lightning as L
    from ..core.data import build_datasets, make_loader
    from ..train_lightning import Classifier
    cfg = TrainConfig.preset("smoke", schedule="constant", warmup_epochs=0)
    train_set, _, info = build_datasets(cfg)
    loader = make_loader(torch.utils.data.Subset(train_set, range(cfg.batch_size * steps)), cfg, torch.device("cpu"))
    L.seed_everything(0, verbose=False)
    module = module_cls(cfg, info, cfg.lr, len(loader))
    returned = []
    original = module.training_step

    def spy(batch, batch_idx):
        out = original(batch, batch_idx)
        returned.append(out)
        return out
    module.training_step = spy
    with warnings.catch_warnings():  # Lightning's warnings name files of this machine; the checker explains instead
        warnings.simplefilter("ignore")
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(module, loader)
    return torch.cat([p.detach().reshape(-1) for p in module.model.parameters()]), returned, \
        dict(trainer.callback_metrics)


def check_training_step(module_cls) -> bool:
    """Exercise 1: train 3 steps with your LightningModule and with train_lightning.Classifier; say what differs."""
    from ..train_lightning import Classifier
    import logging
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    try:
        mine, returned, logged = _tiny_fit(module_cls)
    except Exception as exc:  # noqa: BLE001 - Lightning refuses what some training_steps return; say so
        print(f"  - Lightning stopped: {describe(exc)}: training_step must return the loss tensor (or a dict with "
              "'loss'), the tensor backward() runs on")
        print("training_step trains like the reference: False")
        return False
    reference, _, _ = _tiny_fit(Classifier)
    problems = []
    if not returned or returned[0] is None:
        problems.append("training_step returned None: Lightning then skips backward and the optimizer step "
                        "(return the loss)")
    elif not torch.is_tensor(returned[0] if not isinstance(returned[0], dict) else returned[0].get("loss")):
        problems.append("training_step must return the loss tensor (or a dict with 'loss')")
    if "train_loss" not in logged:
        problems.append("no 'train_loss' was logged: self.log('train_loss', loss, on_epoch=True, sync_dist=True)")
    if not problems and not torch.allclose(mine, reference, atol=1e-6):
        problems.append("the parameters differ from the reference after 3 steps: the loss must be "
                        "F.cross_entropy(self(X), y) of the whole batch")
    for p in problems:
        print("  -", p)
    print(f"training_step trains like the reference: {not problems}")
    return not problems


def _solution_training_step(self, batch, batch_idx):
    X, y = batch
    loss = F.cross_entropy(self(X), y)
    self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
    return loss


def _solution_validation_step(self, batch, batch_idx):
    X, y = batch
    loss = F.cross_entropy(self(X), y)
    self.log("test_loss", loss, sync_dist=True)  # the mean over every rank's share of the test set
    return loss


def _solution_class(name: str):
    from ..train_lightning import Classifier
    method = {"SolutionClassifier": ("training_step", _solution_training_step),
              "SolutionValidation": ("validation_step", _solution_validation_step)}[name]
    return type(name, (Classifier,), dict([method]))


def __getattr__(name):  # the solution classes import lightning only when asked for
    if name in ("SolutionClassifier", "SolutionValidation"):
        globals()[name] = _solution_class(name)  # one class: pickled by name to the engines, found again there
        return globals()[name]
    raise AttributeError(name)


# -------------------------------------------------------------------------------------- exercise 2: early stopping
def early_stopping_solution():
    """Seed 000's rule: stop when the test loss has not improved for a few epochs."""
    from lightning.pytorch.callbacks import EarlyStopping
    return EarlyStopping(monitor="test_loss", mode="min", patience=2)


def _stopping_problems(stopper) -> list[str]:
    """What is wrong with an EarlyStopping's settings for train_lightning's metrics, read from its attributes."""
    logged = {"test_loss": "min", "test_accuracy": "max", "train_loss": "min"}
    problems = []
    if stopper.monitor not in logged:
        problems.append(f"monitor={stopper.monitor!r} is never logged (train_lightning logs "
                        f"{', '.join(logged)}): Lightning would stop with an error after the first epoch")
    elif stopper.monitor == "train_loss":
        problems.append("the training loss keeps falling while the model overfits: watch the test loss")
    elif stopper.mode != logged[stopper.monitor]:
        problems.append(f"mode={stopper.mode!r}: {stopper.monitor} improves when it goes "
                        f"{'down' if logged[stopper.monitor] == 'min' else 'up'}, so mode={logged[stopper.monitor]!r}")
    if stopper.patience < 1:
        problems.append("patience=0 stops at the first epoch without improvement; one noisy epoch would end the run")
    return problems


def _stopping_trial(module_cls, stopper, epochs: int = 3) -> dict:
    """On every engine: fit module_cls (a train_lightning.Classifier) with the learner's EarlyStopping for up to
    `epochs` epochs on the digits, every rank validating on its own half of 192 test images, as DDP does. Returns
    this rank's value of the monitored metric after every validation, and the epochs it ran."""
    import copy
    import lightning as L
    import torch.distributed as dist
    from ..core.data import build_datasets, make_loader
    from ..core.distributed import world_from_env
    from ..core.lightning_glue import LaunchedDDP, WorldEnvironment, quiet_lightning
    world = world_from_env()
    created = not dist.is_initialized()
    cfg = TrainConfig.preset("smoke", schedule="constant", warmup_epochs=0, workers=0)
    train_set, test_set, info = build_datasets(cfg)
    cpu = torch.device("cpu")
    train = make_loader(torch.utils.data.Subset(train_set, range(8 * cfg.batch_size)), cfg, cpu)
    test = make_loader(torch.utils.data.Subset(test_set, range(192)), cfg, cpu)
    seen = []

    class Watch(L.Callback):
        def on_validation_end(self, trainer, module):
            value = trainer.callback_metrics.get(stopper.monitor)
            seen.append(None if value is None else float(value))

    L.seed_everything(0, verbose=False)
    module = module_cls(cfg, info, cfg.lr, len(train))
    trainer = L.Trainer(accelerator="cpu", devices=world.local_world_size, num_nodes=world.world_size //
                        world.local_world_size, max_epochs=epochs,
                        strategy=LaunchedDDP(cluster_environment=WorldEnvironment(world)),
                        callbacks=[copy.deepcopy(stopper), Watch()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    try:
        with quiet_lightning(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "log with sync_dist=True": the verdict says it in its place
            trainer.fit(module, train, test)
        return {"seen": seen, "epochs": trainer.current_epoch}
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def check_early_stopping(stopper, module_cls=None, cluster=None) -> bool:
    """Exercise 2: does this EarlyStopping watch a metric train_lightning logs, in the right direction, with some
    patience? With a LightningModule class: fit it with the stopper on 2 engines (`cluster`, or 2 CPU engines
    started for the check and stopped after it), and check that every rank saw the same value of the monitored
    metric (the mean over the whole test set, sync_dist=True), so that the decision to stop is the same
    everywhere. The run is bounded: 3 minutes at most."""
    import contextlib
    problems = _stopping_problems(stopper)
    if not problems and module_cls is not None:
        from ..launch import engines
        from ..launch.engines import EngineTimeout, RankError
        with contextlib.ExitStack() as stack:
            if cluster is None:
                cluster = stack.enter_context(engines.start(n=2, device="cpu", show=False, name="lightning-check"))
            try:
                cluster.run(_stopping_trial, module_cls, stopper, timeout=180)
                runs = list(cluster.results)
            except (EngineTimeout, RankError) as exc:
                problems.append(f"the 2-rank run failed: {first_line(exc)}")
                runs = []
        for epoch, values in enumerate(zip(*(r["seen"] for r in runs))):
            if None in values:
                problems.append(f"{stopper.monitor} was not logged in validation_step")
                break
            if max(values) - min(values) > 1e-6:
                problems.append(
                    f"after epoch {epoch} the ranks saw {stopper.monitor} = "
                    + ", ".join(f"{v:.4f} (rank {r})" for r, v in enumerate(values))
                    + ": each logged the mean over its own half of the test set, so each rank's EarlyStopping "
                    "judged another number (Lightning stops all ranks as soon as one says stop); "
                    "log with self.log(..., sync_dist=True), which averages over the ranks")
                break
    for p in problems:
        print("  -", p)
    print(f"early stopping watches the test loss sensibly: {not problems}")
    return not problems

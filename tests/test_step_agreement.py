"""The ranks agree on two things at every logged step, a loss that is not finite and a SIGTERM, and they do it in
one all-reduce (RunLog.step's), not one each: checkpoint.stop_requested reads the SIGTERM flag that all-reduce
carried. Counted here by the calls to max_over_ranks, the one function that all-reduces them (in one process it does
not all-reduce, but every call would be one collective per step on every rank of a job)."""
from __future__ import annotations

import pytest
import torch

from tutorial.core import checkpoint, distributed, tracking
from tutorial.core.config import TrainConfig
from tutorial.core.process import Sigterm


@pytest.fixture
def calls(monkeypatch):
    made = []

    def counting(values):
        made.append(list(values))
        return distributed.max_over_ranks(values)

    monkeypatch.setattr(tracking, "max_over_ranks", counting)
    monkeypatch.setattr(checkpoint, "max_over_ranks", counting)
    monkeypatch.setattr(Sigterm, "received", False)
    monkeypatch.setattr(Sigterm, "agreed", None)
    return made


def test_one_collective_per_step_carries_both_flags(calls):
    cfg = TrainConfig.preset("smoke", log_every=2, quiet=True)
    log, state = tracking.RunLog(cfg, "single", torch.device("cpu")), checkpoint.State()
    for i in range(4):  # steps 1..4: logged (and agreed) at 2 and 4 only
        state.step += 1
        log.step(state.step, torch.tensor(2.5), 0.1, 1.0)
        assert not checkpoint.stop_requested(state, i, 10, cfg.log_every)
    assert len(calls) == 2 and all(len(values) == 2 for values in calls)
    Sigterm.received = True  # what the handler sets
    state.step += 2
    log.step(state.step, torch.tensor(2.5), 0.1, 1.0)
    assert checkpoint.stop_requested(state, 5, 10, cfg.log_every) and state.batch == 6 and len(calls) == 3


def test_stop_requested_agrees_on_its_own_without_a_logged_step(calls):
    """A loop that does not log at that step (the negative control): stop_requested's own all-reduce, not a stale
    flag from an earlier step or an earlier run in the same process."""
    Sigterm.agreed = (4, True)  # left by another run at another step
    state = checkpoint.State(step=6)
    assert not checkpoint.stop_requested(state, 0, 10, 2) and calls == [[False]]


def test_a_diverged_loss_still_stops_the_run(calls):
    cfg = TrainConfig.preset("smoke", log_every=1, quiet=True)
    with pytest.raises(tracking.DivergedError, match="rank 0: the training loss is nan at step 1"):
        tracking.RunLog(cfg, "single", torch.device("cpu")).step(1, torch.tensor(float("nan")), 0.1, 1.0)
    assert len(calls) == 1

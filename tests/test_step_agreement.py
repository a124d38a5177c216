"""The ranks agree on two things at every logged step, a loss that is not finite and a SIGTERM, and they do it in
one all-reduce (RunLog.step's), not one each. The agreement is a value: RunLog.step returns it and the trainer passes
it to checkpoint.stop_requested, which reads nothing else (no flag left on a class between two modules). Counted here
by the calls to max_over_ranks, the one function that all-reduces them (in one process it does not all-reduce, but
every call would be one collective per step on every rank of a job)."""
from __future__ import annotations

import pytest
import torch

from tutorial.core import checkpoint, distributed, tracking
from tutorial.core.config import TrainConfig
from tutorial.core.loop import Loop
from tutorial.core.process import Sigterm


@pytest.fixture
def calls(monkeypatch):
    made = []

    def counting(values):
        made.append(list(values))
        return distributed.max_over_ranks(values)

    monkeypatch.setattr(tracking, "max_over_ranks", counting)
    monkeypatch.setattr(Sigterm, "received", False)
    return made


def test_one_collective_per_step_carries_both_flags(calls):
    cfg = TrainConfig.preset("smoke", log_every=2, quiet=True)
    log, state = tracking.RunLog(cfg, "single", torch.device("cpu")), checkpoint.State()
    agreed = []
    for _ in range(4):  # steps 1..4: logged (and agreed) at 2 and 4 only
        state.step += 1
        agreed.append(log.step(state.step, torch.tensor(2.5), 0.1, 1.0))
        assert not checkpoint.stop_requested(agreed[-1])
    assert agreed == [None, tracking.Agreement(2, False), None, tracking.Agreement(4, False)]
    assert len(calls) == 2 and all(len(values) == 2 for values in calls)
    Sigterm.request()  # what the handler does
    assert log.step(5, torch.tensor(2.5), 0.1, 1.0) is None  # not a logged step: no agreement, so no stop yet
    agreement = log.step(6, torch.tensor(2.5), 0.1, 1.0)
    assert agreement == tracking.Agreement(6, True) and checkpoint.stop_requested(agreement) and len(calls) == 3


def test_stop_requested_reads_only_the_value_it_is_given(calls):
    """The negative control: a SIGTERM that this process received but the ranks have not agreed on (a step that was
    not logged) stops nothing, and stop_requested makes no collective of its own (one rank stopping alone would
    leave the others waiting in their next all-reduce)."""
    Sigterm.request()
    assert not checkpoint.stop_requested(None) and calls == []
    assert not checkpoint.stop_requested(tracking.Agreement(4, False))
    assert checkpoint.stop_requested(tracking.Agreement(4, True)) and calls == []


def test_the_loop_records_where_it_stopped():
    """Loop.stop: mid-epoch, state.batch says where a resumed run goes on; after an epoch's last batch, 0 (the epoch
    is finished and saved as usual). State holds what is saved; the stop itself is the loop's."""
    mid = Loop(*[None] * 7, state=checkpoint.State(epoch=1, step=4))
    mid.stop(i=1, batches=4)
    assert (mid.stopping, mid.state.batch) == (True, 2)
    last = Loop(*[None] * 7, state=checkpoint.State(epoch=1, step=4))
    last.stop(i=3, batches=4)
    assert (last.stopping, last.state.batch) == (True, 0)
    assert not hasattr(checkpoint.State(), "stopping") and not hasattr(Sigterm, "agreed")


def test_take_resume_offset_hands_the_offset_over_once():
    state = checkpoint.State(epoch=1, step=6, batch=3)
    assert checkpoint.take_resume_offset(state) == 3 and state.batch == 0
    assert checkpoint.take_resume_offset(state) == 0  # the next epoch trains from its first batch


def test_a_diverged_loss_still_stops_the_run(calls):
    cfg = TrainConfig.preset("smoke", log_every=1, quiet=True)
    with pytest.raises(tracking.DivergedError, match="rank 0: the training loss is nan at step 1"):
        tracking.RunLog(cfg, "single", torch.device("cpu")).step(1, torch.tensor(float("nan")), 0.1, 1.0)
    assert len(calls) == 1

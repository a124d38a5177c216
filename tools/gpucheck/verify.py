"""Whether a check's run shows what the check claims: pure functions of what the run left (its exit code, its output,
its metrics.json, its overhead records), one per claim, each returning what failed ([] when it holds)."""
from __future__ import annotations

import contextlib
import json
import math

from .plan import Check


def verify(check: Check, code: int | None, output: str, metrics: dict | None,
           overhead: list | None = None) -> tuple[list[str], dict]:
    """What failed among the check's claims (empty: it passed), and the facts read on the way. overhead: the lines of
    the run's overhead.jsonl (the bare-loop check's)."""
    if "refusal" in check.claims:
        return refused(check, code, output, metrics), dict(errors=sorted(_errors(output)))
    bad = [] if code == 0 else [f"exit code {code}" if code is not None else "timed out"]
    if "metrics" in check.claims and metrics is None:
        return bad + ["no metrics.json"], {}
    facts = read_facts(check, metrics or {}, output, overhead or [])
    for claim in check.claims:
        bad += CLAIMS[claim](check, metrics or {}, facts)
    return bad, facts


def read_facts(check: Check, metrics: dict, output: str, overhead: list) -> dict:
    """What the record keeps of a run: device, ranks, replicas, losses, accuracy, throughput, and per claim the
    trainer/bare-loop ratio or the probe's report."""
    facts: dict = {}
    if metrics:
        facts.update(device=metrics.get("device"), world_size=metrics.get("world_size"),
                     replicas_identical=metrics.get("replicas_identical"), train_losses=train_losses(metrics),
                     test_accuracy=metrics.get("test_accuracy"))
    if metrics.get("epochs"):
        facts["samples_per_second"] = metrics["epochs"][-1].get("samples_per_second")
    if "overhead" in check.claims:
        ratios = [line["results"]["ratio"]["median"] for line in overhead
                  if line.get("parameters", {}).get("device") == check.device]
        facts["overhead_ratio"] = ratios[-1] if ratios else None
    if "probe" in check.claims:
        facts["probe"] = last_json(output)
    return facts


def train_losses(metrics: dict) -> list:
    """The training loss per epoch (the image trainers) or per logged step (the GPT trainers' `losses`)."""
    epochs = metrics.get("epochs") or []
    return [e.get("train_loss") for e in epochs] if epochs else list(metrics.get("losses") or [])


# ------------------------------------------------------------------------------------------------ the claims
def refused(check: Check, code: int | None, output: str, metrics: dict | None) -> list[str]:
    """A non-zero exit whose error line (the same from every rank) says why, and no training."""
    errors = _errors(output)
    bad = [] if code not in (0, None) else [f"exit code {code}: the run was expected to be refused"]
    if len(errors) != 1 or check.expect_error not in next(iter(errors), ""):
        bad.append(f"expected one error line with {check.expect_error!r}, got {sorted(errors)[:3]}")
    if metrics is not None:
        bad.append("it was refused, yet metrics.json was written: it trained")
    return bad


def on_device(check: Check, metrics: dict, facts: dict) -> list[str]:
    if str(metrics.get("device", "")).startswith(check.device):
        return []
    return [f"ran on {metrics.get('device')!r}, not {check.device}"]


def world(check: Check, metrics: dict, facts: dict) -> list[str]:
    if metrics.get("world_size") == check.world:
        return []
    return [f"world size {metrics.get('world_size')}, started with {check.world}"]


def replicas(check: Check, metrics: dict, facts: dict) -> list[str]:
    """Every rank started reported the same parameter checksum."""
    digests = metrics.get("replica_checksums") or []
    if metrics.get("replicas_identical") is True and len(set(digests)) == 1 and len(digests) == check.world:
        return world(check, metrics, facts)
    return world(check, metrics, facts) + [
        f"replicas differ or were not all checked: {len(digests)} checksum(s), {len(set(digests))} distinct, "
        f"replicas_identical={metrics.get('replicas_identical')}"]


def finite_loss(check: Check, metrics: dict, facts: dict) -> list[str]:
    values = [*train_losses(metrics), *(e.get("test_loss") for e in metrics.get("epochs") or [])]
    if values and all(finite(v) for v in values):
        return []
    return [f"loss not finite (or none recorded): {values[:6]}"]


def falling(check: Check, metrics: dict, facts: dict) -> list[str]:
    losses = train_losses(metrics)
    if len(losses) >= 2 and all(finite(v) for v in losses) and losses[-1] < losses[0]:
        return []
    return [f"training loss did not fall from the first epoch to the last: {losses}"]


def accuracy(check: Check, metrics: dict, facts: dict) -> list[str]:
    if check.min_accuracy is None or (finite(metrics.get("test_accuracy"))
                                      and metrics["test_accuracy"] >= check.min_accuracy):
        return []
    return [f"test accuracy {metrics.get('test_accuracy')} below the preset's {check.min_accuracy}"]


def throughput(check: Check, metrics: dict, facts: dict) -> list[str]:
    if finite(facts.get("samples_per_second")) and facts["samples_per_second"] > 0:
        return []
    return [f"no throughput recorded: {facts.get('samples_per_second')}"]


def overhead(check: Check, metrics: dict, facts: dict) -> list[str]:
    if finite(facts.get("overhead_ratio")):
        return []
    return [f"no trainer/bare-loop ratio measured on {check.device}"]


def probe(check: Check, metrics: dict, facts: dict) -> list[str]:
    if facts.get("probe") is None:
        return ["the probe printed no JSON"]
    if check.device == "cuda" and not facts["probe"].get("gpus"):
        return ["torch sees no CUDA GPU"]
    return []


def _holds(check: Check, metrics: dict, facts: dict) -> list[str]:
    return []  # "exit" (decided before the claims) and "metrics" (its absence ends verify early)


CLAIMS = {"exit": _holds, "metrics": _holds, "device": on_device, "world": world, "replicas": replicas,
          "loss": finite_loss, "falling": falling, "accuracy": accuracy, "throughput": throughput,
          "overhead": overhead, "probe": probe}
# "refusal" is not among them: a refused run's only claim is that refusal (refused, above).


# ------------------------------------------------------------------------------------------------ the time
OVERRUN = 1.5        # a run may take this many times its estimate
OVERRUN_SLACK = 5    # plus these seconds: a process start on a busy machine


def over_estimate(check: Check, seconds: float) -> str:
    """Why a run's time breaks its stage's sum of estimates ("" if it does not). Not a failed claim: the run did
    what it claims, and its time becomes its estimate (plan.measured_seconds), but a stage planned on the old
    estimate may no longer fit its 8 minutes (tests/test_gpu_check.py sums them again)."""
    if seconds <= OVERRUN * check.estimate + OVERRUN_SLACK:
        return ""
    return f"took {seconds:.0f} s, over {OVERRUN} x its estimate of {check.estimate:.0f} s (+{OVERRUN_SLACK} s)"


# ------------------------------------------------------------------------------------------------ helpers
def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _errors(output: str) -> set:
    return {line for line in output.splitlines() if line.startswith("error: ")}


def last_json(output: str):
    """The last line of the output that is JSON (the probe's report), or None."""
    for line in reversed(output.strip().splitlines()):
        with contextlib.suppress(ValueError):
            return json.loads(line)
    return None

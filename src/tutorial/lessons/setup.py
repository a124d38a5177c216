"""00_setup: the ring all-reduce drawn step by step, and the checker of the notebook's exercise.

The all-reduce itself is typed by the learner in the notebook's %%px cells; here are only the picture (a simulation
of the ring algorithm on made-up numbers, checked against the plain sum) and the exercise's checker and solution.
"""
from __future__ import annotations

from .ranks import on_every_rank


# ------------------------------------------------------------------------------------------------ the ring, drawn
def ring_allreduce(values: list[list[float]]) -> list[dict]:
    """Simulate the ring all-reduce of nccl and gloo on n ranks: values[r][c] is rank r's chunk c (n chunks each).

    Returns the states, first the initial one: each a dict with `values` (n x n, what every rank holds),
    `summed` (n x n, how many ranks' contributions each chunk holds), `phase` and `sends` (rank, chunk) pairs of the
    step that led there. Reduce-scatter: in n-1 steps every rank sends one chunk to its right neighbour, which adds
    it to its own; afterwards rank r holds the full sum of chunk (r + 1) % n. All-gather: in n-1 more steps the
    finished chunks travel round the ring, each replacing the receiver's copy. Every rank sends 2(n-1) chunks of
    1/n of the data: the 2(n-1)/n of the bus bandwidth formula."""
    n = len(values)
    vals = [list(map(float, row)) for row in values]
    summed = [[1] * n for _ in range(n)]
    states = [{"phase": "start", "step": 0, "values": [r[:] for r in vals], "summed": [r[:] for r in summed],
               "sends": []}]
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            if phase == "reduce-scatter":  # rank r sends chunk (r - step) % n
                sends = [(r, (r - step) % n) for r in range(n)]
            else:  # rank r sends the finished chunk (r + 1 - step) % n
                sends = [(r, (r + 1 - step) % n) for r in range(n)]
            outgoing = [(r, c, vals[r][c], summed[r][c]) for r, c in sends]  # all send at once, then all receive
            for r, c, v, s in outgoing:
                dst = (r + 1) % n
                if phase == "reduce-scatter":
                    vals[dst][c] += v
                    summed[dst][c] += s
                else:
                    vals[dst][c], summed[dst][c] = v, s
            states.append({"phase": phase, "step": step + 1, "values": [r[:] for r in vals],
                           "summed": [r[:] for r in summed], "sends": sends})
    return states


def draw_ring_allreduce(states: list[dict]):
    """One panel per state: rows are ranks, columns chunks; the colour says how many ranks' contributions a chunk
    holds (dark: all of them), the number is its value, an outlined cell just arrived from the rank above."""
    import matplotlib.pyplot as plt
    n = len(states[0]["values"])
    fig, axes = plt.subplots(1, len(states), figsize=(2.0 * len(states), 2.6), sharey=True)
    for ax, state in zip(axes, states):
        ax.imshow(state["summed"], cmap="Blues", vmin=0, vmax=n + 1)
        for r in range(n):
            for c in range(n):
                ax.text(c, r, f"{state['values'][r][c]:g}", ha="center", va="center", fontsize=8,
                        color="white" if state["summed"][r][c] == n else "black")
        for r, c in state["sends"]:  # the chunk r sent landed on r + 1
            ax.add_patch(plt.Rectangle((c - 0.5, (r + 1) % n - 0.5), 1, 1, fill=False, edgecolor="crimson", lw=2))
        title = "start" if state["phase"] == "start" else f"{state['phase']}\nstep {state['step']}"
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(n), [f"c{c}" for c in range(n)], fontsize=7)
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=7)
    fig.suptitle(f"ring all-reduce on {n} ranks: each rank sends one chunk (red: just received) per step, "
                 f"2({n}-1) = {2 * (n - 1)} steps", fontsize=10)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------- the exercise
def _value_of(rank: int, world_size: int) -> tuple:
    return (float(rank + 1),)


def check_mean_over_ranks(cluster, mean_over_ranks) -> str:
    """Exercise 1: rank r calls mean_over_ranks(r + 1); every rank must get the mean over all ranks."""
    cluster.run(on_every_rank, mean_over_ranks, inputs=_value_of, seconds=10.0)  # 00 destroyed its own group
    expected = sum(range(1, cluster.n + 1)) / cluster.n
    for rank, (status, value) in enumerate(cluster.results):
        if status == "error":
            if "NoneType" in value:
                hint = ("dist.all_reduce works in place and returns None (a work handle with async_op=True): reduce "
                        "the tensor, then read the same tensor")
            elif "AVG" in value.upper():
                hint = ("this torch's gloo, which the CPU engines use, has no ReduceOp.AVG (NCCL has): sum (the "
                        "default op) and divide by dist.get_world_size(), which works on every backend")
            else:
                hint = "see the message"
            return f"wrong: rank {rank} raised {value} -- {hint}"
        if not isinstance(value, (int, float)) or abs(value - expected) > 1e-6:
            why = (" (that is the sum: divide by dist.get_world_size())"
                   if isinstance(value, (int, float)) and abs(value - expected * cluster.n) < 1e-6 else "")
            return f"wrong: rank {rank} returned {value!r}, the mean is {expected:g}{why}"
    return f"correct: every rank got the mean {expected:g}"


def solution_mean_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist
    t = torch.tensor([value])
    dist.all_reduce(t)  # in place: t now holds the sum on every rank
    return t.item() / dist.get_world_size()

"""Plots: learning curves (01_single_device, 03b_ddp_trainer) and the scaling study (07_scaling_study).

Each function takes what a trainer returned (metrics) or lines of results/*.jsonl (`tutorial.bench.read_results`),
draws on the given matplotlib axes (or a new figure) and returns the figure, so a notebook cell stays one line.
"""
from __future__ import annotations


def _axes(ax, ncols: int = 1, width: float = 5.0):
    import matplotlib.pyplot as plt
    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(1, ncols, figsize=(width * ncols, 3.6), layout="constrained")
    return fig, ax


def learning_curves(metrics: dict, ax=None, label: str = ""):
    """Train and test loss, and test accuracy, per epoch of one run (a trainer's `main(cfg)` return value)."""
    fig, (loss_ax, acc_ax) = _axes(None, 2) if ax is None else (ax[0].figure, ax)
    epochs = [e["epoch"] for e in metrics["epochs"]]
    prefix = f"{label} " if label else ""
    loss_ax.plot(epochs, [e["train_loss"] for e in metrics["epochs"]], "o-", label=f"{prefix}train")
    loss_ax.plot(epochs, [e["test_loss"] for e in metrics["epochs"]], "s--", label=f"{prefix}test")
    acc_ax.plot(epochs, [e["test_accuracy"] for e in metrics["epochs"]], "o-", label=prefix.strip() or "test")
    loss_ax.set(xlabel="epoch", ylabel="loss", title="loss")
    acc_ax.set(xlabel="epoch", ylabel="accuracy", title="test accuracy")
    loss_ax.legend(), acc_ax.legend()
    return fig


def scaling_plot(line: dict, ax=None):
    """Speed-up against the number of processes, with the ideal line; efficiency written at each point."""
    fig, ax = _axes(ax)
    points = line["results"]["points"]
    n = [p["nproc"] for p in points]
    ax.plot(n, n, "k:", label="ideal")
    ax.plot(n, [p["speedup"] for p in points], "o-", label=f"{line['parameters']['mode']} scaling")
    for p in points:
        ax.annotate(f"{p['efficiency'] * 100:.0f}%", (p["nproc"], p["speedup"]), textcoords="offset points",
                    xytext=(4, -12))
    ax.set(xlabel="processes", ylabel="speed-up", xticks=n,
           title=f"{line['parameters']['strategy']} {line['parameters']['model']} on "
                 f"{line['parameters']['device']} ({line['date'][:10]})")
    ax.legend()
    return fig


def breakdown_plot(line: dict, ax=None):
    """Stacked bars of a step's time: compute, communication, data loading (from a weak-scaling line)."""
    fig, ax = _axes(ax)
    parts = line["results"]["breakdown"]
    labels = [str(p["nproc"]) for p in parts]
    bottom = [0.0] * len(parts)
    for key, name in (("compute_s", "compute"), ("communication_s", "communication"),
                      ("data_loading_s", "data loading")):
        # A slightly negative difference is noise, not negative time: draw it as zero.
        values = [max(p[key], 0.0) * 1000 for p in parts]
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(xlabel="processes", ylabel="ms per step", title="where a step's time goes")
    ax.legend()
    return fig


def allreduce_plot(lines: list[dict], ax=None):
    """Bus bandwidth against message size, one curve per results line (backend x processes)."""
    fig, ax = _axes(ax)
    for line in lines:
        rows = line["results"]["sizes"]
        p = line["parameters"]
        ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"]["median"] for r in rows], "o-",
                label=f"{p['backend']} x{p['nproc']} ({line['date'][:10]})")
    ax.set(xscale="log", xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)", title="all-reduce")
    ax.legend()
    return fig


def speedup_efficiency_plot(series: dict, amdahl=(), ax=None):
    """Speed-up (left, with the ideal line and Amdahl curves) and efficiency (right) against processes for several
    scaling tables on the same axes: `series` maps a label to rows of `tutorial.bench.scaling_table` (results/*.jsonl
    lines or the seeds' published tables); `amdahl` lists parallel fractions p, drawn as 1 / ((1 - p) + p / n)."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter
    fig, (speed_ax, eff_ax) = _axes(None, 2) if ax is None else (ax[0].figure, ax)
    top = max(r["nproc"] for rows in series.values() for r in rows)
    n = [2 ** k for k in range(top.bit_length() + (top & (top - 1) != 0))]
    speed_ax.plot(n, n, "k:", label="ideal")
    eff_ax.axhline(1.0, color="k", ls=":")
    for p in amdahl:
        speed_ax.plot(n, [1 / ((1 - p) + p / k) for k in n], "--", color="grey", lw=1, label=f"Amdahl p={p:.3f}")
    for label, rows in series.items():
        x = [r["nproc"] for r in rows]
        line, = speed_ax.plot(x, [r["speedup"] for r in rows], "o-")
        eff_ax.plot(x, [r["efficiency"] for r in rows], "o-", color=line.get_color(), label=label)
    speed_ax.set(xscale="log", yscale="log", xlabel="processes (GPUs)", ylabel="speed-up", title="speed-up")
    speed_ax.yaxis.set_major_formatter(FormatStrFormatter("%g")), speed_ax.yaxis.set_minor_formatter(NullFormatter())
    eff_ax.set(xscale="log", xlabel="processes (GPUs)", ylabel="efficiency", title="efficiency = speed-up / processes")
    for a in (speed_ax, eff_ax):
        a.set_xticks(n, [str(k) for k in n]), a.xaxis.set_minor_formatter(NullFormatter())
    speed_ax.yaxis.set_major_locator(LogLocator(base=2))
    speed_ax.legend(fontsize="small", loc="upper left")
    # Below both plots: one entry per series, the colours being the same on both axes.
    fig.legend(*eff_ax.get_legend_handles_labels(), loc="outside lower center", ncols=2, fontsize="small")
    return fig

"""The report's figures as PNG files, drawn on matplotlib's Agg canvas: no display on a compute node,
and no pyplot state shared with whatever else runs in the process."""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from hpc.analysis.metrics import (BASELINES, FAST_P, MISSING, PASSED, UNVERIFIED, Run, RunSummary, fast_p_curve,
                                  passed, speedup)

COLORS = {PASSED: "#2ca02c", "static": "#9467bd", "compile": "#d62728", "load": "#ff7f0e",
          "correctness": "#e377c2", "timing": "#8c564b", "baseline": "#bcbd22", "pool": "#17becf",
          UNVERIFIED: "#7f7f7f", MISSING: "#c7c7c7"}
TITLE = {"eager": "eager", "compile": "torch.compile"}

PLAIN = FuncFormatter(lambda v, _: f"{v:g}")   # 0.5, 2 rather than 5x10^-1, 2x10^0 on log axes
SPARSE = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:e}"[0] in "25" else "")   # label 2s and 5s only


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def plot_fast_p(runs: list[Run], path: Path) -> Path:
    """fast_p against p, one curve per run, vs eager and vs torch.compile; the reported p marked."""
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2, sharey=True)
    top = max([2.5] + [min(10.0, 1.05 * speedup(r, b)) for run in runs for r in run.records for b in BASELINES
                       if passed(r) and speedup(r, b) > 0])
    grid = [top * i / 400 for i in range(401)]
    for ax, baseline in zip(axes, BASELINES):
        for run in runs:
            missing = len(run.missing)
            line, = ax.plot(grid, fast_p_curve(run.records, grid, baseline, missing), label=run.label,
                            drawstyle="steps-post")
            ax.plot(FAST_P, fast_p_curve(run.records, FAST_P, baseline, missing), "o", color=line.get_color())
        ax.axvline(1.0, color="black", lw=0.6, ls=":")
        ax.set(title=f"fast_p vs {TITLE[baseline]}", xlabel="p (speedup threshold)",
               xlim=(0, top), ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of all tasks correct with speedup > p")
    axes[1].legend(loc="upper right", fontsize="small")
    return _save(fig, path)


def plot_speedups(runs: list[Run], path: Path) -> Path:
    """Speedups of the passing samples per level (log scale), one box per run within each level."""
    levels = sorted({lv for run in runs for lv in run.levels})
    fig = Figure(figsize=(max(9.0, 3.0 * len(levels) + 3), 4.5))
    axes = fig.subplots(1, 2, sharey=True)
    width = 0.8 / len(runs)
    for ax, baseline in zip(axes, BASELINES):
        drawn = False
        for k, run in enumerate(runs):
            color = f"C{k % 10}"
            for i, lv in enumerate(levels):
                values = [speedup(r, baseline) for r in run.at_level(lv)[0] if passed(r) and speedup(r, baseline) > 0]
                if not values:
                    continue
                x = i - 0.4 + width * (k + 0.5)
                ax.boxplot([values], positions=[x], widths=width * 0.8, showfliers=False, patch_artist=True,
                           boxprops={"facecolor": color, "alpha": 0.35}, medianprops={"color": color})
                ax.plot([x] * len(values), values, ".", color=color, alpha=0.8, label=run.label)
                drawn = True
        ax.axhline(1.0, color="black", lw=0.6, ls=":")
        ax.set_xticks(range(len(levels)), [f"level {lv}" for lv in levels])
        ax.set_xlim(-0.6, len(levels) - 0.4)
        ax.set_title(f"speedup vs {TITLE[baseline]} (passing samples)")
        if drawn:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(PLAIN)
            ax.yaxis.set_minor_formatter(SPARSE)
        else:
            ax.text(0.5, 0.5, "no passing sample", ha="center", va="center", transform=ax.transAxes)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("speedup (baseline ms / candidate ms)")
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        unique = dict(zip(labels, handles))
        axes[1].legend(unique.values(), unique.keys(), fontsize="small")
    return _save(fig, path)


def plot_failures(summaries: list[RunSummary], path: Path) -> Path:
    """Each run's samples split by outcome (passed, the stage that failed, missing), as shares."""
    counts = [{PASSED: s.overall.passed, **s.overall.failures} for s in summaries]
    keys = list(dict.fromkeys(k for c in counts for k in c if c[k]))
    fig = Figure(figsize=(9, 1.2 + 0.6 * len(summaries)))
    ax = fig.subplots()
    y = list(range(len(summaries)))
    left = [0.0] * len(summaries)
    for key in keys:
        ns = [c.get(key, 0) for c in counts]
        shares = [n / s.overall.samples for n, s in zip(ns, summaries)]
        ax.barh(y, shares, left=left, color=COLORS.get(key, "black"), label=key, edgecolor="white")
        for j, (share, n) in enumerate(zip(shares, ns)):
            if share >= 0.06:
                ax.text(left[j] + share / 2, j, str(n), ha="center", va="center", fontsize="small")
        left = [a + b for a, b in zip(left, shares)]
    ax.set_yticks(y, [s.label for s in summaries])
    ax.invert_yaxis()
    ax.set(xlim=(0, 1), xlabel="share of samples (records plus missing tasks)", title="outcome by stage")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    return _save(fig, path)

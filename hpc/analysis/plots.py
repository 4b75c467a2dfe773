"""The report's figures as PNG files, drawn on matplotlib's Agg canvas: no display on a compute node,
and no pyplot state shared with whatever else runs in the process."""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter

from hpc.analysis.metrics import (BASELINES, FAST_P, MISSING, PASSED, UNVERIFIED, Run, RunSummary, fast_p_curve,
                                  passed, speedup, stage_segments)

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


# (title, the panel's series: solid, dashed, dotted); the first panel adds pass_rate on a right axis
TRAINING_PANELS = (
    ("mean reward, pass rate", ("reward_mean",)),
    ("faster than torch.compile / eager", ("faster_than_compile_rate", "faster_than_eager_rate")),
    ("KL to reference", ("kl_to_reference",)),
    ("entropy", ("entropy",)),
    ("clip fraction", ("clip_fraction",)),
    ("explained variance", ("explained_variance",)),
    ("mean response length (tokens)", ("response_length_mean",)),
    ("tokens per second", ("tokens_per_second",)),
    ("seconds per step", ("generation_s", "reward_s", "update_s")),
)
STYLES = ("-", "--", ":")


def _curve(ax, segments: list[tuple[str, list[dict]]], key: str, color: str, style: str) -> bool:
    """One run's series against the step, a line per stage (no line across a stage change); False
    (nothing drawn) when the run never measured it. NaN gaps within a stage break the line too."""
    drawn = False
    for _, rows in segments:
        ys = [r[key] for r in rows]
        finite = sum(math.isfinite(y) for y in ys)
        if finite:
            ax.plot([r["step"] for r in rows], ys, style, color=color, lw=1.2, marker="." if finite <= 30 else None,
                    ms=4)
            drawn = True
    return drawn


def plot_training(runs: list[tuple[str, list[dict]]], path: Path) -> Path:
    """Training curves against the global step, one colour per run, a small panel per metric; dotted
    verticals mark where a stage begins (named along the top row); a metric never measured is not drawn."""
    fig = Figure(figsize=(14, 10))
    axes = fig.subplots(3, 3, sharex=True).flatten()
    segments = [stage_segments(steps) for _, steps in runs]
    starts: dict[float, list[str]] = {}      # where a stage begins -> the stages beginning there (of any run)
    for run in segments:
        for stage, rows in run:
            names = starts.setdefault(rows[0]["step"] - 0.5, [])
            if stage not in names:
                names.append(stage)
    for i, (ax, (title, keys)) in enumerate(zip(axes, TRAINING_PANELS)):
        drawn: dict[str, str] = {}      # series some run measured -> its line style
        for k, run in enumerate(segments):
            for key, style in zip(keys, STYLES):
                if _curve(ax, run, key, f"C{k % 10}", style):
                    drawn[key] = style
        if i == 0:   # the pass rate beside the reward, on its own 0..1 axis
            twin = ax.twinx()
            for k, run in enumerate(segments):
                if _curve(twin, run, "pass_rate", f"C{k % 10}", "--"):
                    drawn["pass_rate"] = "--"
            if "pass_rate" in drawn:
                twin.set_ylim(0, 1.02)
            else:
                twin.set_axis_off()
        for x, names in starts.items():
            ax.axvline(x, color="black", lw=0.6, ls=":")
            if i < 3:
                ax.text(x, 0.98, " / ".join(names), transform=ax.get_xaxis_transform(), rotation=90, va="top",
                        ha="right", fontsize="x-small", bbox={"fc": "white", "ec": "none", "alpha": 0.7, "pad": 1})
        ax.set_title(title, fontsize="medium")
        ax.grid(alpha=0.3)
        if not drawn:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="gray")
        elif i == 0 or len(keys) > 1:
            ax.legend([Line2D([], [], color="gray", ls=style) for style in drawn.values()], list(drawn),
                      fontsize="x-small")
        if i >= 6:
            ax.set_xlabel("step")
    fig.legend([Line2D([], [], color=f"C{k % 10}") for k in range(len(runs))], [label for label, _ in runs],
               loc="upper center", ncol=min(len(runs), 6), fontsize="small")
    fig.subplots_adjust(top=0.93, hspace=0.3)
    return _save(fig, path)

"""The report's figures as PNG files, drawn on matplotlib's Agg canvas: no display on a compute node,
and no pyplot state shared with whatever else runs in the process."""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, MaxNLocator

from hpc.analysis.metrics import (BASELINES, FAST_P, MISSING, PASSED, UNVERIFIED, Run, RunSummary, fast_p_curve,
                                  passed, speedup, stage_segments)

COLORS = {PASSED: "#2ca02c", "static": "#9467bd", "compile": "#d62728", "load": "#ff7f0e",
          "verify": "#e377c2", "profile": "#8c564b", "baseline": "#bcbd22", "pool": "#17becf",
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


# The panels of training.png: (title, the series drawn: solid, dashed, dotted, which steps (the
# x axis), the y limits or None). The supervised stages are drawn against their own steps, the RL
# stages against RL steps only: 18 RL steps after 400 SFT ones get a panel's whole width.
SFT, VALUE, RL = "sft steps", "value pretraining steps", "RL steps"
TRAINING_PANELS = (
    ("SFT loss", ("sft_loss",), SFT, None),
    ("value pretraining: value loss", ("value_loss",), VALUE, None),
    ("mean reward (band: ± its standard error)", ("reward_mean",), RL, None),
    ("pass rate (band: ± its standard error)", ("pass_rate",), RL, (0.0, 1.02)),
    ("faster than torch.compile / eager", ("faster_than_compile_rate", "faster_than_eager_rate"), RL, (0.0, 1.02)),
    ("KL to reference", ("kl_to_reference",), RL, None),
    ("clip fraction", ("clip_fraction",), RL, None),
    ("explained variance (clipped to ±1)", ("explained_variance",), RL, (-1.05, 1.05)),
    ("entropy", ("entropy",), RL, None),
    ("mean response length (tokens)", ("response_length_mean",), RL, None),
    ("value loss (RL)", ("value_loss",), RL, None),
    ("seconds per step", ("generation_s", "reward_s", "update_s"), RL, None),
    ("gradient norm before clipping: actor / critic", ("actor_grad_norm", "critic_grad_norm"), RL, None),
    ("update / weight norm: actor / critic", ("actor_update_ratio", "critic_update_ratio"), RL, None),
)
LOG_PANELS = {"actor_grad_norm", "actor_update_ratio"}   # first series of a panel on a log axis: the
# actor's and the critic's figures lie orders of magnitude apart
STYLES = ("-", "--", ":")
BANDS = {"reward_mean": lambda r: r["reward_std"] / math.sqrt(max(r["samples"], 1)),
         "pass_rate": lambda r: math.sqrt(max(r["pass_rate"] * (1 - r["pass_rate"]), 0.0) / max(r["samples"], 1))}


def _band(key: str, row: dict) -> float:
    half = BANDS[key](row)
    return half if math.isfinite(half) else 0.0


def _finite(row: dict, key: str) -> bool:
    return isinstance(row.get(key), (int, float)) and math.isfinite(row[key])


def _axis_rows(steps: list[dict], axis: str) -> list[dict]:
    """The rows drawn against `axis`, each with its position on it in "x": SFT steps (an sft loss),
    value pretraining steps (a value loss and no reward), RL steps (a reward)."""
    keep = {SFT: lambda r: _finite(r, "sft_loss"),
            VALUE: lambda r: _finite(r, "value_loss") and not _finite(r, "reward_mean"),
            RL: lambda r: _finite(r, "reward_mean")}[axis]
    return [{**r, "x": k + 1} for k, r in enumerate(r for r in steps if keep(r))]


def _curve(ax, rows: list[dict], key: str, color: str, style: str, limits: tuple | None) -> bool:
    """One run's series on its axis, a line per stage (no line across a stage change), with a band
    where BANDS has one; values beyond `limits` drawn at the limit as triangles. False (nothing
    drawn) when the run never measured it."""
    drawn = False
    for _, seg in stage_segments(rows):
        pts = [(r["x"], r[key], r) for r in seg if _finite(r, key)]
        if not pts:
            continue
        xs = [x for x, _, _ in pts]
        ys = [y if limits is None else min(max(y, limits[0]), limits[1]) for _, y, _ in pts]
        ax.plot(xs, ys, style, color=color, lw=1.2, marker="." if len(pts) <= 30 else None, ms=4)
        if limits is not None:
            out = [(x, y) for (x, raw, _), y in zip(pts, ys) if raw != y]
            if out:
                ax.plot([x for x, _ in out], [y for _, y in out], "v", color=color, ms=5, ls="none")
        if key in BANDS and style == "-":
            half = [_band(key, r) for _, _, r in pts]
            ax.fill_between(xs, [y - h for y, h in zip(ys, half)], [y + h for y, h in zip(ys, half)],
                            color=color, alpha=0.15, lw=0)
        drawn = True
    return drawn


def _stage_marks(ax, runs_rows: list[list[dict]], keys: tuple[str, ...], label: bool, width: int) -> None:
    """A dotted vertical where each stage after the first begins on this axis; every stage's name
    along the top, staggered, inside the panel: after its vertical in the panel's first two thirds,
    before it (pointing at it) in the last third, where the name would run past the panel's edge."""
    starts: dict[float, list[str]] = {}
    for rows in runs_rows:
        for stage, seg in stage_segments([r for r in rows if any(_finite(r, key) for key in keys)]):
            names = starts.setdefault(seg[0]["x"] - 0.5, [])
            if stage not in names:
                names.append(stage)
    for k, (x, names) in enumerate(sorted(starts.items())):
        if k:
            ax.axvline(x, color="black", lw=0.6, ls=":")
        if label:
            text = " / ".join(names)
            late = x - 0.5 > 2 * width / 3
            ax.text(x, 0.97 - 0.09 * (k % 3), f"{text} →" if late else f" {text}",
                    transform=ax.get_xaxis_transform(), va="top", ha="right" if late else "left",
                    fontsize="x-small", bbox={"fc": "white", "ec": "none", "alpha": 0.7, "pad": 1})


def plot_training(runs: list[tuple[str, list[dict]]], path: Path) -> Path:
    """Training curves, one colour per run, a small panel per metric: the supervised losses against
    their own steps, everything measured on sampled episodes against RL steps only; dotted verticals
    mark where a stage begins. A metric never measured says so."""
    lines = -(-len(TRAINING_PANELS) // 3)
    fig = Figure(figsize=(15, 3 * lines))
    axes = fig.subplots(lines, 3).flatten()
    for ax in axes[len(TRAINING_PANELS):]:
        ax.set_visible(False)
    first_rl = next(i for i, panel in enumerate(TRAINING_PANELS) if panel[2] == RL)
    for i, (ax, (title, keys, axis, limits)) in enumerate(zip(axes, TRAINING_PANELS)):
        runs_rows = [_axis_rows(steps, axis) for _, steps in runs]
        drawn: dict[str, str] = {}      # series some run measured -> its line style
        for k, rows in enumerate(runs_rows):
            for key, style in zip(keys, STYLES):
                if _curve(ax, rows, key, f"C{k % 10}", style, limits):
                    drawn[key] = style
        width = max((r["x"] for rows in runs_rows for r in rows), default=0)   # the steps on this axis
        _stage_marks(ax, runs_rows, keys, i < first_rl + 3, width)
        if drawn:   # each step's slot whole, so every stage begins and ends inside the panel
            ax.set_xlim(0.5, width + 0.5)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel(axis, fontsize="small")
        ax.grid(alpha=0.3)
        if limits is not None:
            ax.set_ylim(*limits)
        if keys[0] in LOG_PANELS and drawn:
            ax.set_yscale("log", nonpositive="mask")
        if not drawn:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes, color="gray")
        elif len(keys) > 1:
            ax.legend([Line2D([], [], color="gray", ls=style) for style in drawn.values()], list(drawn),
                      fontsize="x-small", loc="lower right")
    fig.legend([Line2D([], [], color=f"C{k % 10}") for k in range(len(runs))], [label for label, _ in runs],
               loc="upper center", ncol=min(len(runs), 6), fontsize="small")
    fig.subplots_adjust(top=1 - 0.24 / lines, hspace=0.45, wspace=0.22)
    return _save(fig, path)

"""The analysis report: one document built once and rendered twice, as Markdown and as
self-contained HTML (inline style; the figures are PNG files beside it, referenced by relative
path), plus summary.json with the same numbers for machines. Evaluation runs and training runs
each get their sections when there are any."""

from __future__ import annotations

import dataclasses
import html
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

from hpc.analysis.metrics import BASELINES, FAST_P, FINAL_STEPS, RunSummary, StageSummary, Summary, TrainingSummary

DOC = "docs/analysis.md"


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Para:
    text: str


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclass
class Image:
    path: str       # relative to the report
    alt: str


Block = Heading | Para | Table | Image


def pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1%}"


def num(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"


def whole(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0f}"


def _group_row(s: Summary) -> list[str]:
    return [s.name, str(s.tasks), str(s.samples), str(s.missing), pct(s.pass_rate), pct(s.faster_eager),
            pct(s.faster_compile), num(s.geomean_eager), num(s.geomean_compile), num(s.mean_reward)]


def _stage_row(s: StageSummary) -> list[str]:
    f = s.final
    return [s.stage, str(s.steps), f"{s.first_step}-{s.last_step}", "-" if math.isnan(s.hours) else f"{s.hours:.2f}",
            num(f["reward_mean"]), pct(f["pass_rate"]), pct(f["faster_than_compile_rate"]), num(f["kl_to_reference"]),
            num(f["entropy"]), num(f["explained_variance"]), num(f["sft_loss"]), num(f["value_loss"]),
            whole(f["response_length_mean"]), whole(f["tokens_per_second"])]


def title(summaries: list[RunSummary], training: list[TrainingSummary]) -> str:
    return "Training report" if not summaries else "Training and evaluation report" if training else "Evaluation report"


def document(summaries: list[RunSummary], images: list[Path], generated: str,
             training: list[TrainingSummary]) -> list[Block]:
    """The report's content, top to bottom: runs, comparison, figures, training stages, then each
    evaluation run in detail (the evaluation parts only with evaluation runs)."""
    blocks: list[Block] = [Heading(title(summaries, training), 1), Para(f"Generated {generated} by jobs/analyze.py.")]
    if summaries:
        blocks += [
            Para("Every rate is over all tasks: a task of the suite without a record counts as a failing sample. "
                 "A sample passes when it is correct and failed no stage; >eager and >compile count passing "
                 "samples faster than that baseline by more than the reward margin; geometric-mean speedups are "
                 "over passing samples only; fast_p is the fraction of all samples that pass with a speedup "
                 f"above p. Definitions: {DOC}."),
            Heading("Runs"),
            Table(["run", "source", "git commit", "tasks", "samples", "faster means", "outside suite"],
                  [[s.label, s.source, s.git_commit[:12] or "-", str(s.overall.tasks), str(s.overall.samples),
                    f"speedup > {1 + s.margin:g}", str(s.outside_suite)] for s in summaries]),
            Heading("Comparison"),
            Table(["run", "pass", ">eager", ">compile", "geomean vs eager", "geomean vs compile", "fast_1 eager",
                   "fast_1 compile", "mean reward"],
                  [[s.label, pct(s.overall.pass_rate), pct(s.overall.faster_eager), pct(s.overall.faster_compile),
                    num(s.overall.geomean_eager), num(s.overall.geomean_compile), pct(s.overall.fast_p_eager[1.0]),
                    pct(s.overall.fast_p_compile[1.0]), num(s.overall.mean_reward)] for s in summaries]),
        ]
    blocks += [Heading("Figures"), *[Image(p.name, p.stem.replace("_", " ")) for p in images]]
    if training:
        blocks += [Heading("Training"),
                   Para("Per stage of each training run (a stage the run returns to is listed again): its steps, "
                        "hours (summed step time) and final metrics, each the mean over the stage's last "
                        f"{FINAL_STEPS} steps that measured it ('-': never measured). Curves: training.png. "
                        f"Definitions: {DOC}.")]
        for t in training:
            blocks += [Heading(f"Training: {t.label}", 3), Para(f"{t.source}: {t.steps} steps."),
                       Table(["stage", "steps", "step range", "hours", "reward", "pass", ">compile", "KL to ref",
                              "entropy", "expl. var.", "SFT loss", "value loss", "resp. tokens", "tokens/s"],
                             [_stage_row(s) for s in t.stages])]
    for s in summaries:
        groups = [*s.levels.values(), s.overall]
        blocks += [
            Heading(f"Run: {s.label}"),
            Heading("Per level", 3),
            Table(["group", "tasks", "samples", "missing", "pass", ">eager", ">compile", "geomean vs eager",
                   "geomean vs compile", "mean reward"], [_group_row(g) for g in groups]),
            Heading("fast_p: fraction of all tasks correct with speedup > p", 3),
            Table(["group", "baseline", *(f"p={p:g}" for p in FAST_P)],
                  [[g.name, b, *(pct((g.fast_p_eager if b == "eager" else g.fast_p_compile)[p]) for p in FAST_P)]
                   for g in groups for b in BASELINES]),
            Heading("Failures by stage", 3),
        ]
        if s.overall.failures:
            blocks.append(Table(
                ["stage", *(g.name for g in groups), "share", "most common reasons"],
                [[stage, *(str(g.failures.get(stage, 0)) for g in groups), pct(n / s.overall.samples),
                  "; ".join(f"{reason} ({k})" for reason, k in s.reasons.get(stage, []))]
                 for stage, n in s.overall.failures.items()]))
        else:
            blocks.append(Para("No failures."))
    return blocks


_NUMBER = re.compile(r"-|-?\d+(\.\d+)?%?")


def _numeric(table: Table) -> list[bool]:
    """Columns whose every cell is a number (or "-"): right-aligned in both renderings."""
    return [all(_NUMBER.fullmatch(row[i]) for row in table.rows) for i in range(len(table.header))]


def to_markdown(blocks: list[Block]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    out = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append(f"{'#' * b.level} {b.text}")
        elif isinstance(b, Para):
            out.append(b.text)
        elif isinstance(b, Image):
            out.append(f"![{b.alt}]({b.path})")
        else:
            lines = ["| " + " | ".join(map(cell, b.header)) + " |",
                     "|" + "|".join("---:" if n else "---" for n in _numeric(b)) + "|"]
            lines += ["| " + " | ".join(map(cell, row)) + " |" for row in b.rows]
            out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


STYLE = """body { font-family: system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; display: block; margin: 0.5em 0 1.5em; }"""


def to_html(blocks: list[Block], title: str = "Evaluation report") -> str:
    e = html.escape
    body = []
    for b in blocks:
        if isinstance(b, Heading):
            body.append(f"<h{b.level}>{e(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            body.append(f"<p>{e(b.text)}</p>")
        elif isinstance(b, Image):
            body.append(f'<img src="{e(b.path)}" alt="{e(b.alt)}">')
        else:
            cls = [' class="n"' if n else "" for n in _numeric(b)]
            rows = ["<tr>" + "".join(f"<th{c}>{e(h)}</th>" for c, h in zip(cls, b.header)) + "</tr>"]
            rows += ["<tr>" + "".join(f"<td{c}>{e(v)}</td>" for c, v in zip(cls, row)) + "</tr>" for row in b.rows]
            body.append("<table>\n" + "\n".join(rows) + "\n</table>")
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{e(title)}</title>\n'
            f"<style>\n{STYLE}\n</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n")


def _jsonable(x):
    """NaN as null, float keys (the p of fast_p) as "0.5", tuples as lists."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {(f"{k:g}" if isinstance(k, float) else str(k)): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def summary_json(summaries: list[RunSummary], generated: str, training: list[TrainingSummary]) -> dict:
    return {"generated": generated, "fast_p": list(FAST_P),
            "runs": [_jsonable(dataclasses.asdict(s)) for s in summaries],
            "training": [_jsonable(dataclasses.asdict(t)) for t in training]}


def write_report(out_dir: Path, summaries: list[RunSummary], images: list[Path],
                 training: list[TrainingSummary]) -> Path:
    """report.md, report.html and summary.json in `out_dir` (the images already there); the Markdown's path."""
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    blocks = document(summaries, images, generated, training)
    (out_dir / "report.md").write_text(to_markdown(blocks))
    (out_dir / "report.html").write_text(to_html(blocks, title(summaries, training)))
    (out_dir / "summary.json").write_text(json.dumps(summary_json(summaries, generated, training), indent=1) + "\n")
    return out_dir / "report.md"

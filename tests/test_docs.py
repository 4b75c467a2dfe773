"""The docs say what the code does: every results column and the schema versions in
results/SCHEMA.md, and no doc or test citing a path outside the repository (it exists on one
machine only). Each failure names what is missing."""

from __future__ import annotations

import re

from hpc.results.hdf5 import ADDED_IN, SCHEMA_VERSION
from hpc.results.record import FIELDS
from hpc.results.training import STEP_ADDED_IN, STEP_FIELDS, TRAIN_SCHEMA_VERSION, TRAJECTORY_FIELDS
from tests.conftest import ROOT

SCHEMA_DOC = ROOT / "results" / "SCHEMA.md"


def _sections(text: str) -> dict[str, str]:
    """Markdown heading -> the text under it, down to the next heading of its level or above
    (a `#` line inside a fenced block is a comment, not a heading)."""
    lines = text.splitlines(keepends=True)
    headings, fenced = [], False
    for number, line in enumerate(lines):
        fenced ^= line.startswith("```")
        if not fenced and (m := re.match(r"(#+) (.*)", line)):
            headings.append((number, len(m.group(1)), m.group(2).strip()))
    sections = {}
    for k, (number, level, title) in enumerate(headings):
        stop = next((other for other, depth, _ in headings[k + 1:] if depth <= level), len(lines))
        sections[title] = "".join(lines[number + 1:stop])
    return sections


def _table_rows(body: str) -> dict[str, str]:
    """Column name -> its row, for a markdown table whose first cell names columns (`a, b`)."""
    rows = {}
    for line in body.splitlines():
        cells = re.split(r"(?<!\\)\|", line)
        if not line.startswith("|") or len(cells) < 3 or set(cells[1].strip()) <= {"-"} or cells[1].strip() == "field":
            continue
        for name in cells[1].split(","):
            rows[name.strip().strip("`")] = line
    return rows


def _column_problems(where: str, rows: dict[str, str], columns: list[str], added_in: dict[str, int]) -> list[str]:
    """Columns without a row, rows of no column, and added columns whose row lacks `(version N)`."""
    problems = [f"{where}: no row for column `{c}`" for c in columns if c not in rows]
    problems += [f"{where}: a row for `{name}`, which the code does not write" for name in rows if name not in columns]
    problems += [f"{where}: the row of `{c}` does not say `(version {v})`, the version that added it"
                 for c, v in added_in.items() if c in rows and f"(version {v})" not in rows[c]]
    return problems


def test_every_results_column_is_in_schema_md():
    sections = _sections(SCHEMA_DOC.read_text())
    problems = _column_problems("## Fields", _table_rows(sections["Fields"]), [f.name for f in FIELDS], ADDED_IN)
    problems += _column_problems("### Step fields", _table_rows(sections["Step fields (`/train/steps`)"]),
                                 list(STEP_FIELDS), STEP_ADDED_IN)
    problems += _column_problems("### Trajectory fields",
                                 _table_rows(sections["Trajectory fields (`/train/trajectories`)"]),
                                 list(TRAJECTORY_FIELDS), {})
    assert not problems, "results/SCHEMA.md does not match the code:\n" + "\n".join(problems)


def _version_problems(where: str, text: str, version: int, constant: str) -> list[str]:
    """Every `schema_version=N` must be the code's version, and no `version N` may exceed it."""
    problems = [f"{where}: states schema_version={n}, the code writes {version} ({constant})"
                for n in map(int, re.findall(r"schema_version=(\d+)", text)) if n != version]
    if not re.search(r"schema_version=\d+", text):
        problems.append(f"{where}: states no schema_version= (the code writes {version}, {constant})")
    stated = [int(n) for pair in re.findall(r"\bversions? (\d+)(?:\s*(?:-|to)\s*(\d+))?", text) for n in pair if n]
    problems += [f"{where}: speaks of version {n}, past the code's {version} ({constant})"
                 for n in sorted(set(stated)) if n > version]
    return problems


def test_schema_md_states_the_versions_the_code_writes():
    text = SCHEMA_DOC.read_text()
    title = re.match(r"# .*\(version (\d+)\)", text)
    problems = [] if title and int(title.group(1)) == SCHEMA_VERSION else [
        f"title: `(version {title.group(1) if title else '?'})`, the code writes {SCHEMA_VERSION}"]
    training = text.index("## Training metrics")
    policy = text.index("## Policy evaluations")
    problems += _version_problems("/records", text[:training], SCHEMA_VERSION, "SCHEMA_VERSION, hpc/results/hdf5.py")
    problems += _version_problems("/train", text[training:policy], TRAIN_SCHEMA_VERSION,
                                  "TRAIN_SCHEMA_VERSION, hpc/results/training.py")
    assert not problems, "results/SCHEMA.md's schema versions:\n" + "\n".join(problems)


# Files that cite paths: the docs, the READMEs a reader starts from, the schema, and the tests.
CITING = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", SCHEMA_DOC, ROOT / "jobs" / "README.md",
          *sorted((ROOT / "tests").glob("*.py"))]
# A checkout's or a person's folder, a data disk, or a sibling of the repository reached by
# climbing out of it: none of them is there in another clone. System paths (/usr, /tmp, /proc,
# /dev, /etc, ...) and placeholders (ROOT/work/, $VAR/...) are not matched.
OUTSIDE = re.compile(r"(?<![\w.$/-])(?:/(?:work|root|home|data)/|(?:\.\./)+shared\b)[^\s`'\")\]]*")
MARKDOWN_LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s#]+)")


def test_no_doc_or_test_cites_a_path_outside_the_repository():
    found = []
    for path in CITING:
        where = path.relative_to(ROOT)
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{where}:{number}: {m.group(0)}" for m in OUTSIDE.finditer(line)]
            if path.suffix == ".md":
                found += [f"{where}:{number}: link {m.group(1)}" for m in MARKDOWN_LINK.finditer(line)
                          if not (path.parent / m.group(1)).resolve().is_relative_to(ROOT.resolve())]
    assert not found, "paths outside the repository (refer to the repository's own files, a config key or an " \
                      "environment variable instead):\n" + "\n".join(found)

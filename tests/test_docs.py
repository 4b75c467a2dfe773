"""The docs say what the code does: every config key with its default in docs/config.md, every
results column (its type, units and meaning: the code's, and what the files carry), every file
attribute and the schema versions in results/SCHEMA.md, and no doc or test citing a path outside
the repository (it exists on one machine only). Each failure names what is missing."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import re
from typing import Any, get_args, get_origin, get_type_hints

import h5py
import yaml

from hpc.agent.config import AgentConfig
from hpc.config import EvalConfig
from hpc.policy.config import PolicyModelConfig
from hpc.results.columns import KIND_NAMES, kind_of_dtype
from hpc.results.hdf5 import ADDED_IN, SCHEMA_DOC, SCHEMA_VERSION, ResultWriter, provenance
from hpc.results.merge import merge_files
from hpc.results.record import FIELDS, EvalRecord
from hpc.results.schema import BEGIN, TABLES, with_tables
from hpc.results.training import (STEP_FIELDS, TRAIN_SCHEMA_VERSION, TRAJECTORY_FIELDS, EvaluationWriter,
                                  TrainingWriter)
from hpc.rl.train_config import TrainConfig
from hpc.synthesis.config import SynthesisConfig
from tests.conftest import ROOT

CONFIG_DOC = ROOT / "docs" / "config.md"
SCHEMA_DOC_PATH = ROOT / "results" / "SCHEMA.md"

# The configs a user's YAML file sets (`hpc eval --config`, `python -m hpc.agent --config`,
# `hpc synthesize --config`, a policy model file or the training config's `policy:`,
# `jobs/train.py --config`): each is one YAML block in the section of docs/config.md whose heading
# names the class. A config nested in another (the training config's `agent:`) is documented in
# its own section; the outer block names its key and may show a few of its keys.
DOCUMENTED = (EvalConfig, AgentConfig, SynthesisConfig, PolicyModelConfig, TrainConfig)
# Keys a loader takes besides the dataclass's fields, with their defaults: policy_config takes
# `preset` out of the mapping before building the dataclass.
EXTRA_KEYS: dict[type, dict[str, Any]] = {PolicyModelConfig: {"preset": "tiny"}}


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


def _config_block(cls: type, doc: str) -> str:
    """The YAML block of the docs/config.md section whose heading names `cls`."""
    titled = [body for title, body in _sections(doc).items() if f"`{cls.__name__}`" in title]
    assert len(titled) == 1, f"docs/config.md: {len(titled)} sections have `{cls.__name__}` in their heading, not 1"
    blocks = re.findall(r"^```yaml\n(.*?)^```", titled[0], re.M | re.S)
    assert len(blocks) == 1, f"docs/config.md, section `{cls.__name__}`: {len(blocks)} yaml blocks, not 1"
    return blocks[0]


def _differs(shown: Any, default: Any) -> bool:
    return shown != default or isinstance(shown, bool) != isinstance(default, bool)


def config_problems(cls: type, shown: Any, default: Any, prefix: str = "", complete: bool = True) -> list[str]:
    """What a documented block gets wrong about config class `cls` (defaults `default`): keys it
    lacks (when it documents the class `complete`ly), keys the class does not have, and values
    other than the defaults. Keys are named by their dotted path, list items as `key[]`."""
    if not isinstance(shown, dict):
        return [f"`{prefix.rstrip('.') or 'top level'}`: a mapping expected, the doc shows {shown!r}"]
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    extra = EXTRA_KEYS.get(cls, {})
    problems = [f"`{prefix}{key}` is not a key of {cls.__name__}" for key in shown
                if key not in names and key not in extra]
    problems += [f"`{prefix}{key}` shows {shown[key]!r}, the default is {value!r}"
                 for key, value in extra.items() if key in shown and _differs(shown[key], value)]
    for name in names:
        key, tp, value = prefix + name, hints[name], getattr(default, name)
        if name not in shown:
            if complete:
                problems.append(f"no key `{key}`")
            continue
        if dataclasses.is_dataclass(tp):
            if tp in DOCUMENTED and shown[name] is None:
                continue   # documented in its own section
            problems += config_problems(tp, shown[name], value, key + ".", complete and tp not in DOCUMENTED)
        elif get_origin(tp) is list and dataclasses.is_dataclass(get_args(tp)[0]):
            (element,) = get_args(tp)
            if not isinstance(shown[name], list) or not shown[name]:
                problems.append(f"`{key}`: a list of {element.__name__} mappings expected, the doc shows "
                                f"{shown[name]!r}")
                continue
            for item in shown[name]:
                problems += config_problems(element, item, element(), key + "[].", complete)
        elif _differs(shown[name], value):
            problems.append(f"`{key}` shows {shown[name]!r}, the default is {value!r}")
    return problems


def _nested_configs(cls: type) -> set[str]:
    """Names of `cls` and every config class its fields hold, directly or in a list."""
    found = {cls.__name__}
    for tp in get_type_hints(cls).values():
        inner = get_args(tp)[0] if get_origin(tp) is list else tp
        if dataclasses.is_dataclass(inner):
            found |= _nested_configs(inner)
    return found


def test_every_config_key_is_in_config_md_with_its_default():
    doc = CONFIG_DOC.read_text()
    problems = [f"section `{cls.__name__}`: {problem}" for cls in DOCUMENTED
                for problem in config_problems(cls, yaml.safe_load(_config_block(cls, doc)), cls())]
    assert not problems, "docs/config.md does not match the config dataclasses:\n" + "\n".join(problems)


def test_every_config_class_the_loaders_build_is_documented():
    """A config class `build_config` builds (hpc/config.py: what reads YAML) is one of DOCUMENTED
    or nested in one: a new config file cannot go undocumented."""
    built = set()
    for path in (ROOT / "hpc").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            called = getattr(node, "func", None)
            if (getattr(called, "id", getattr(called, "attr", "")) == "build_config" and node.args
                    and isinstance(node.args[0], ast.Name) and node.args[0].id.endswith("Config")):
                built.add(node.args[0].id)
    documented = set().union(*map(_nested_configs, DOCUMENTED))
    assert built - documented == set(), f"config classes read from YAML but not in docs/config.md: {built - documented}"


def test_the_config_check_catches_one_removed_key():
    """The check above is line-precise: one key's line gone from a block is named."""
    block = _config_block(EvalConfig, CONFIG_DOC.read_text())
    without = "\n".join(line for line in block.splitlines() if not re.match(r"\s+warmup:", line))
    assert config_problems(EvalConfig, yaml.safe_load(without), EvalConfig()) == ["no key `timing.warmup`"]
    wrong = block.replace("iterations: 100", "iterations: 50")
    assert config_problems(EvalConfig, yaml.safe_load(wrong), EvalConfig()) == [
        "`timing.iterations` shows 50, the default is 100"]


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
    sections = _sections(SCHEMA_DOC_PATH.read_text())
    problems = _column_problems("## Fields", _table_rows(sections["Fields"]), [f.name for f in FIELDS], ADDED_IN)
    problems += _column_problems("### Step fields", _table_rows(sections["Step fields (`/train/steps`)"]),
                                 list(STEP_FIELDS), {})
    problems += _column_problems("### Trajectory fields",
                                 _table_rows(sections["Trajectory fields (`/train/trajectories`)"]),
                                 list(TRAJECTORY_FIELDS), {})
    assert not problems, "results/SCHEMA.md does not match the code:\n" + "\n".join(problems)


def test_schema_md_column_tables_are_the_codes():
    """Each table of results/SCHEMA.md's columns is the one generated from the code's columns
    (hpc.results.columns): a column added, removed or retyped, or its units or meaning changed,
    without `python -m hpc.results.schema`, fails here with the rows that differ."""
    text = SCHEMA_DOC_PATH.read_text()
    expected = with_tables(text)
    diff = difflib.unified_diff(text.splitlines(), expected.splitlines(), "results/SCHEMA.md", "the code's", n=0,
                                lineterm="")
    assert text == expected, "results/SCHEMA.md's column tables are not the code's (run `python -m " \
                             "hpc.results.schema`):\n" + "\n".join(diff)


def _documented_columns(table: str) -> dict[str, tuple[str, str, str]]:
    """Column name -> (type, units, meaning), from results/SCHEMA.md's table of `table`'s columns."""
    body = SCHEMA_DOC_PATH.read_text().split(BEGIN.format(table=table), 1)[1]
    out = {}
    for line in body.lstrip("\n").splitlines()[2:]:   # after the header and its rule
        if not line.startswith("|"):
            break
        name, tp, units, meaning = (cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", line)[1:-1])
        out[name] = (tp, units, meaning)
    return out


def test_every_column_of_a_written_file_is_as_schema_md_says(tmp_path):
    """Every dataset a writer makes (records and both training tables) has a row in results/SCHEMA.md
    with its type, and carries the row's units and meaning as its `units` and `description`
    attributes; the file names the document (`schema_doc`)."""
    path = tmp_path / "r.h5"
    with EvaluationWriter(path) as writer:
        writer.append(EvalRecord(task_id="level1/x"))
        writer.append_step({"step": 1, "stage": "sft", "stage_step": 1, "samples": 1})
        writer.append_trajectories(1, "sft", [{"task_id": "level1/x", "reward": 1.0, "end_reason": "submitted"}])
    problems = []
    with h5py.File(path, "r") as f:
        assert f.attrs["schema_doc"] == SCHEMA_DOC and (ROOT / SCHEMA_DOC).is_file()
        for table in TABLES:
            documented = _documented_columns(table)
            problems += [f"{table}: SCHEMA.md has a row for `{name}`, the file has no such column"
                         for name in documented if name not in f[table]]
            for name, ds in f[table].items():
                if name not in documented:
                    problems.append(f"{table}/{name}: no row in SCHEMA.md")
                    continue
                tp, units, meaning = documented[name]
                if not tp.startswith(KIND_NAMES[kind_of_dtype(ds.dtype)]):
                    problems.append(f"{table}/{name}: SCHEMA.md says {tp}, the file holds {ds.dtype}")
                if ds.attrs.get("units") != units or not meaning.startswith(ds.attrs.get("description", "\0")):
                    problems.append(f"{table}/{name}: units {ds.attrs.get('units')!r}, description "
                                    f"{ds.attrs.get('description')!r}; SCHEMA.md: {units!r}, {meaning!r}")
    assert not problems, "the file and results/SCHEMA.md differ:\n" + "\n".join(problems)


def test_every_file_attribute_is_in_schema_md(tmp_path, monkeypatch):
    """The root attributes of an evaluation's file (under Slurm), a merged one and a training
    run's are each named in the layout of results/SCHEMA.md."""
    for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_CLUSTER_NAME"):
        monkeypatch.setenv(key, "1")
    shard, merged, train = tmp_path / "shard.h5", tmp_path / "merged.h5", tmp_path / "train.h5"
    with ResultWriter(shard, provenance({})) as writer:
        writer.append(EvalRecord(task_id="level1/x"))
    merge_files([shard], merged)
    with TrainingWriter(train) as writer:
        writer.append_step({"step": 1, "stage": "sft", "stage_step": 1, "samples": 1})
    names = set()
    for path in (shard, merged, train):
        with h5py.File(path, "r") as f:
            names |= set(f.attrs)
    layout = _sections(SCHEMA_DOC_PATH.read_text())["Layout"]
    missing = sorted(name for name in names if not re.search(rf"\b{name}\b", layout))
    assert not missing, f"results/SCHEMA.md's layout does not name the file attributes {missing}"


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
    text = SCHEMA_DOC_PATH.read_text()
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
CITING = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", SCHEMA_DOC_PATH, ROOT / "jobs" / "README.md",
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

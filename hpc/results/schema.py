"""results/SCHEMA.md's column tables, generated from the code's columns (hpc.results.columns), so
that the document never says other than the code and the files: a column's type, units and
meaning are edited in the code, and `python -m hpc.results.schema` rewrites the document's tables
from it (tests/test_docs.py fails while they differ)."""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path

from hpc.errors import read_reason
from hpc.logs import add_logging_args, setup_logging
from hpc.results.columns import Column
from hpc.results.record import COLUMNS
from hpc.results.training import STEP_COLUMNS, TRAJECTORY_COLUMNS

# Each table of the files, by its group, with its columns.
TABLES: dict[str, tuple[Column, ...]] = {"/records": COLUMNS, "/train/steps": STEP_COLUMNS,
                                         "/train/trajectories": TRAJECTORY_COLUMNS}
BEGIN = "<!-- the columns of {table}, generated from the code by `python -m hpc.results.schema` -->"
END = "<!-- end of the generated columns -->"
DOCUMENT = Path(__file__).resolve().parents[2] / "results" / "SCHEMA.md"

log = logging.getLogger(__name__)


def markdown_table(columns: tuple[Column, ...]) -> str:
    """The columns as a markdown table: name, type, units, meaning (and the version that added it)."""
    lines = ["| field | type | units | meaning |", "|---|---|---|---|"]
    for c in columns:
        meaning = c.description + (f" (version {c.added_in})" if c.added_in > 1 else "")
        lines.append(f"| {c.name} | {c.type_name} | {c.units} | {meaning.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


def with_tables(text: str) -> str:
    """The document `text` with each table's generated block (between BEGIN and END) the code's;
    ValueError naming a table whose block is missing."""
    for table, columns in TABLES.items():
        begin = BEGIN.format(table=table)
        block = re.compile(re.escape(begin) + r"\n.*?" + re.escape(END), re.S)
        if not block.search(text):
            raise ValueError(f"no block of generated columns for {table} (`{begin}` ... `{END}`)")
        text = block.sub(lambda _: f"{begin}\n{markdown_table(columns)}{END}", text, count=1)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc.results.schema",
                                     description="Rewrite the column tables of results/SCHEMA.md from the code.")
    parser.add_argument("document", nargs="?", type=Path, default=DOCUMENT, help="the schema document to rewrite")
    add_logging_args(parser)
    args = parser.parse_args(argv)
    setup_logging(args.verbose, args.quiet)
    try:
        text = args.document.read_text()
        new = with_tables(text)
    except OSError as e:
        log.error("error: %s: %s", args.document, read_reason(e))
        return 2
    except ValueError as e:
        log.error("error: %s: %s", args.document, e)
        return 2
    if new != text:
        args.document.write_text(new)
    log.info("%s: %s", args.document, "column tables rewritten" if new != text else "column tables already the code's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

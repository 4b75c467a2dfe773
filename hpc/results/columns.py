"""The columns of the results tables, each described once: its name, type, units and meaning.

A writer puts every column's units and meaning on its dataset (the attributes `units` and
`description`), and results/SCHEMA.md's column tables are generated from the same definitions
(hpc.results.schema), so the file, the code and the document say one thing. An EvalRecord field
declares its column with `column(...)`; the training tables list theirs (hpc.results.training).

Units: a unit (`ms`, `s`, `bytes`, `FLOP`, `tokens`, `nat/token`), `1` for a dimensionless number
(a count, a share, a ratio, a reward), empty where none applies (text, JSON, flags, identifiers,
and an output's error, which has the task's own units).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

# How HDF5 stores a column, by the name the journal gives it.
KINDS = {"bool": np.bool_, "int": np.int64, "float": np.float64, "floats": h5py.vlen_dtype(np.float64),
         "str": h5py.string_dtype("utf-8")}
# What results/SCHEMA.md calls each kind.
KIND_NAMES = {"bool": "bool", "int": "int64", "float": "float64", "floats": "float64[]", "str": "str"}
_META = "column"   # the dataclass field metadata key `column` sets


@dataclass(frozen=True)
class Column:
    name: str
    type: Any            # the Python type, or its name (a dataclass field's annotation)
    units: str
    description: str     # what the dataset's `description` attribute says
    json: bool = False   # text holding one JSON value
    added_in: int = 1    # the schema version of its table that added it

    @property
    def kind(self) -> str:
        return kind_of_type(self.type)

    @property
    def type_name(self) -> str:
        """The column's type as results/SCHEMA.md names it."""
        return KIND_NAMES[self.kind] + (" (JSON)" if self.json else "")


def kind_of_type(tp: Any) -> str:
    """The kind of a column of Python type `tp` (a type or its name); text unless a number, a flag
    or a list of floats."""
    tp = typing.get_origin(tp) or tp
    if tp is bool or tp == "bool":
        return "bool"
    if tp is int or tp == "int":
        return "int"
    if tp is float or tp == "float":
        return "float"
    if tp is list or str(tp).startswith("list"):
        return "floats"
    return "str"


def kind_of_dtype(dtype: np.dtype) -> str:
    """The kind of a dataset's dtype."""
    if h5py.check_vlen_dtype(dtype) == np.float64:
        return "floats"
    if h5py.check_string_dtype(dtype) is not None:
        return "str"
    if dtype == np.bool_:
        return "bool"
    return "int" if np.issubdtype(dtype, np.integer) else "float"


def column_dtype(tp: Any) -> object:
    """The HDF5 dtype of a column of Python type `tp` (a type or its name)."""
    return KINDS[kind_of_type(tp)]


def column(default: Any, units: str, description: str, json: bool = False, added_in: int = 1) -> Any:
    """A dataclass field that is a results column: its default (a list is copied for each
    instance) and how the file describes it (Column)."""
    meta = {_META: {"units": units, "description": description, "json": json, "added_in": added_in}}
    if isinstance(default, list):
        return dataclasses.field(default_factory=default.copy, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def columns_of(cls: type) -> tuple[Column, ...]:
    """A dataclass's fields as columns, in order; TypeError for a field not declared with `column`
    (a column the file could not describe)."""
    out = []
    for f in dataclasses.fields(cls):
        if _META not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name}: declare it with hpc.results.columns.column "
                            "(its units and meaning)")
        out.append(Column(f.name, f.type, **f.metadata[_META]))
    return tuple(out)


def describe(group: h5py.Group, columns: Iterable[Column]) -> None:
    """Put each column's units and meaning on its dataset in `group` where they are not there
    already (a file written before datasets carried them, or before a meaning was reworded); a
    column the group lacks is left alone. Called before SWMR mode, in which no attribute can be
    created."""
    for c in columns:
        ds = group.get(c.name)
        if ds is None:
            continue
        for key, value in (("units", c.units), ("description", c.description)):
            if ds.attrs.get(key) != value:
                ds.attrs[key] = value

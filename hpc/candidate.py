"""Candidates: a KernelBench single file (ModelNew + load_inline) or a workdir (model_new.py + kernels/)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from hpc.compile.native import SOURCE_SUFFIX
from hpc.errors import UserError

SINGLE_FILE = "single_file"
WORKDIR = "workdir"
MODEL_FILE = "model_new.py"
MAX_FILES = 64
MAX_BYTES = 4 << 20


@dataclass(frozen=True)
class Candidate:
    path: Path
    kind: str                     # SINGLE_FILE or WORKDIR
    sha256: str                   # over every file that defines it
    files: dict[str, bytes]       # relative path -> content (what gets evaluated, frozen at load)

    @property
    def model_file(self) -> str:
        return MODEL_FILE if self.kind == WORKDIR else self.path.name

    def source_text(self) -> str:
        """All files, concatenated with headers: stored with each result."""
        return "\n".join(f"// ===== {name} =====\n{data.decode('utf-8', 'replace')}"
                         for name, data in sorted(self.files.items()))

    def materialize(self, dest: Path) -> Path:
        """Write the candidate into a fresh workdir; returns the path of its model file."""
        dest.mkdir(parents=True, exist_ok=True)
        for name, data in self.files.items():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        return dest / self.model_file


def load_candidate(path: str | Path) -> Candidate:
    """Read a candidate into memory, so later edits to the source cannot change what is evaluated."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".py":
            raise UserError(f"candidate {path}: expected a .py file or a workdir folder")
        files = {path.name: path.read_bytes()}
        kind = SINGLE_FILE
    elif path.is_dir():
        if not (path / MODEL_FILE).is_file() or not _inside(path / MODEL_FILE, path):
            raise UserError(f"candidate {path}: workdir has no {MODEL_FILE}")
        files = {MODEL_FILE: (path / MODEL_FILE).read_bytes()}
        kdir = path / "kernels"
        if kdir.is_dir():
            for p in sorted(kdir.iterdir()):
                if _inside(p, path) and p.is_file() and p.suffix in (*SOURCE_SUFFIX.values(), ".h", ".hpp", ".cuh"):
                    files[f"kernels/{p.name}"] = p.read_bytes()
        kind = WORKDIR
    else:
        raise UserError(f"candidate {path}: no such file or folder")
    if len(files) > MAX_FILES or sum(map(len, files.values())) > MAX_BYTES:
        raise UserError(f"candidate {path}: too large (at most {MAX_FILES} files, {MAX_BYTES >> 20} MiB)")
    h = hashlib.sha256()
    for name, data in sorted(files.items()):
        h.update(name.encode() + b"\0" + data + b"\0")
    return Candidate(path.resolve(), kind, h.hexdigest(), files)


def _inside(p: Path, root: Path) -> bool:
    """False for a link out of the workdir: it would make the harness read files of its choosing."""
    return p.resolve().is_relative_to(root.resolve())


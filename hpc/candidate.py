"""Candidates: a KernelBench single file (ModelNew + load_inline) or a workdir (model_new.py + kernels/)."""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from hpc.compile.native import SOURCE_SUFFIX
from hpc.errors import CandidateError, MissingCandidateError, read_input, read_reason, shown, utf8_name

SINGLE_FILE = "single_file"
WORKDIR = "workdir"
MODEL_FILE = "model_new.py"
MAX_FILES = 64
MAX_BYTES = 4 << 20
KERNEL_SUFFIXES = (*SOURCE_SUFFIX.values(), ".h", ".hpp", ".cuh")


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
    """Read a candidate into memory, so later edits to the source cannot change what is evaluated.

    MissingCandidateError when `path` does not exist; CandidateError when it exists but is no
    candidate: neither a .py file nor a workdir, unreadable, too large, a FIFO or link loop where a
    file should be, a link out of the workdir, a single file that is a link (read as root through
    it, any file of the machine would be the candidate's source), or a file name that is not valid
    UTF-8 (file names are hashed and stored as text)."""
    path = Path(path)
    what = f"candidate {shown(path)}"
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise MissingCandidateError(f"{what}: no such file or folder") from None
    except OSError as e:
        raise CandidateError(f"{what}: {read_reason(e)}") from None
    budget = _Budget(what)
    if stat.S_ISDIR(st.st_mode):
        files = {MODEL_FILE: budget.read(path, MODEL_FILE)}
        kdir = path / "kernels"
        if os.path.lexists(kdir):
            if not os.path.isdir(kdir):
                raise CandidateError(f"{what}: kernels is not a folder")
            try:
                names = sorted(os.listdir(kdir))
            except OSError as e:
                raise CandidateError(f"{what}: kernels: {read_reason(e)}") from None
            for name in names:
                if os.path.splitext(name)[1] in KERNEL_SUFFIXES:
                    files[f"kernels/{name}"] = budget.read(path, f"kernels/{name}")
        kind = WORKDIR
    elif path.suffix != ".py":
        raise CandidateError(f"{what}: expected a .py file or a workdir folder")
    else:
        if not utf8_name(path.name):
            raise CandidateError(f"{what}: file name is not valid UTF-8")
        if path.is_symlink() and os.path.exists(path):   # a loop is named as one by the read
            raise CandidateError(f"{what}: a symbolic link (name the file it points to)")
        files = {path.name: read_input(path, MAX_BYTES, what, CandidateError, follow=False)}
        kind = SINGLE_FILE
    h = hashlib.sha256()
    for name, data in sorted(files.items()):
        h.update(name.encode() + b"\0" + data + b"\0")
    return Candidate(Path(os.path.realpath(path)), kind, h.hexdigest(), files)


class _Budget:
    """A workdir's files, read one by one within MAX_FILES and MAX_BYTES in all."""

    def __init__(self, what: str):
        self.what, self.files, self.left = what, 0, MAX_BYTES

    def read(self, root: Path, name: str) -> bytes:
        what = f"{self.what}: {shown(name)}"
        if not utf8_name(name):
            raise CandidateError(f"{what}: file name is not valid UTF-8")
        self.files += 1
        if self.files > MAX_FILES:
            raise CandidateError(f"{self.what}: too many files (at most {MAX_FILES})")
        path = root / name
        if not os.path.lexists(path):
            raise CandidateError(f"{self.what}: workdir has no {name}")
        if not _inside(path, root):   # it would make the harness read files of the link's choosing
            raise CandidateError(f"{what}: a link out of the workdir")
        data = read_input(path, self.left, what, CandidateError)
        self.left -= len(data)
        return data


def _inside(p: Path, root: Path) -> bool:
    """False for a link out of the workdir (realpath: a link loop stays inside, and fails to read)."""
    return Path(os.path.realpath(p)).is_relative_to(os.path.realpath(root))

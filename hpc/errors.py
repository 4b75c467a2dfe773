"""Errors that reach the user as one line, never as a traceback: UserError, which only entry
points catch, and its kinds, one for each kind of input, which library code raises; and the
reading of input files that turns every way a file can be odd into such an error."""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from pathlib import Path


_OUT_OF_MEMORY = re.compile(r"\b(?:OutOfMemoryError|MemoryError)\b|out of memory", re.IGNORECASE)


def names_out_of_memory(reason: str) -> bool:
    """Whether a failure's one-line reason is running out of memory: torch's OutOfMemoryError, a
    MemoryError, or the sandboxed worker's own "CUDA out of memory" / "out of memory (address-space
    limit)". On a device shared with other evaluations that may be their memory, not the item's."""
    return bool(_OUT_OF_MEMORY.search(reason))


class UserError(Exception):
    """The boundary's base class: input a user can fix, which an entry point (hpc/cli.py, the
    `python -m` mains, jobs/*.py) shows as one `error:` line and exit 2. It is caught, never raised:
    library code raises the subclass below that says which input is wrong, so that a library caller
    can tell a bad config from a damaged results file, and only the entry point decides that the
    user sees it (tests/test_errors.py holds each module to the classes it may raise)."""


class UsageError(UserError, ValueError):
    """How a command was run: an argument or option, a folder it names, the ranks it was started with."""


class ConfigError(UserError, ValueError):
    """A config file or one of its settings, or a setting a component was given (a client's); the
    message names the key."""


class TaskError(UserError, ValueError):
    """A task's problem file, or a folder of them."""


class CandidateError(UserError):
    """A candidate that exists but cannot be evaluated (unreadable, too large, no candidate's shape):
    the candidate's failure, recorded like any other, where a missing one is a usage error."""


class MissingCandidateError(UserError):
    """A candidate path that names nothing: a usage error where one candidate was asked for by name,
    a failed record where a suite looked for it (CandidateError is the candidate's own failure)."""


class ResultsFileError(UserError):
    """A results file (HDF5) or a run folder of them: unreadable, not ours, of another schema,
    damaged past its journal, or not writable (a full disk)."""


class CheckpointError(UserError):
    """A checkpoint (a training run's, or a Hugging Face model's files): missing, incomplete, not
    the model's, or not writable."""


class TokenizerError(UserError, ValueError):
    """A tokenizer's files, or a tokenizer that does not fit the model or chat format it is used with."""


class DataFileError(UserError, ValueError):
    """A data file or folder read as input (samples, KernelBench results and baselines, ops6k rows,
    synthesis shards and manifests, recorded replies, solutions, a benchmark folder): missing or
    malformed."""


class TrainingError(UserError, RuntimeError):
    """A training run that cannot go on with what its stages produced (a stage left with no data)."""


class ToolchainError(UserError, RuntimeError):
    """This machine's compiler cannot build a part the harness needs (a candidate's failed build is
    its record, not this)."""


def shown(text: object) -> str:
    """`text` (a path, a message, a record's field) as valid UTF-8 without NUL, fit for a terminal
    and for HDF5 strings: the bytes of a non-UTF-8 file name (Python's surrogate escapes) become
    \\xNN, NUL becomes \\x00."""
    text = os.fspath(text) if isinstance(text, os.PathLike) else text
    text = text if isinstance(text, str) else str(text)
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:   # a lone surrogate that is no escaped byte
        raw = text.encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace").replace("\0", "\\x00")


def utf8_name(name: str) -> bool:
    """False for a file name that is not valid UTF-8: it could not be stored as text or hashed."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_input(path: Path, limit: int, what: str, error: type[UserError], follow: bool = True) -> bytes:
    """The bytes of an input file, at most `limit` of them, or `error` naming `what` and why not:
    missing, a folder, a FIFO, socket or device (opened without blocking, never read), a symbolic
    link loop (or any link, with `follow` off: the name is opened, never what a link swapped in for
    it points to), unreadable (root reads files of any mode), or too large (checked before reading)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{what}: no such file") from None
    except OSError as e:
        raise error(f"{what}: {read_reason(e)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what}: {'is a folder' if stat.S_ISDIR(st.st_mode) else 'not a regular file'}")
        if st.st_size > limit:
            raise error(f"{what}: too large ({st.st_size} bytes, over {limit})")
        chunks, left = [], limit + 1
        while left > 0:   # the file may grow while read: never take more than `limit`
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise error(f"{what}: too large (over {limit} bytes)")
        return data
    except OSError as e:
        raise error(f"{what}: {read_reason(e)}") from None
    finally:
        os.close(fd)


def read_reason(e: BaseException) -> str:
    """Why an input could not be opened or read, in a few words."""
    if getattr(e, "errno", None) in (errno.ELOOP, errno.EISDIR, errno.ENOTDIR):
        return os_reason(e)
    return f"cannot read ({os_reason(e)})"


def check_out_folder(path: str | os.PathLike, option: str = "--out") -> Path:
    """A run folder a command will create or fill: refuse one that is, or lies under, a file
    (mkdir would raise deep inside the run, after work was done)."""
    path = Path(path)
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                where = "exists and" if folder == path else f"{folder}"
                raise UsageError(f"{option} {path}: {where} is not a folder")
            break
    return path


HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5")


def check_results_name(path: str | os.PathLike, option: str = "--out") -> Path:
    """A results file a user named: `--out r.txt` would get HDF5 under a text file's name."""
    path = Path(path)
    if path.suffix.lower() not in HDF5_SUFFIXES:
        raise UsageError(f"{option} {path}: an HDF5 results file's name ends in {', '.join(HDF5_SUFFIXES)}")
    return path


def writable_folder(path: str | os.PathLike, option: str = "--out", make: bool = True) -> Path:
    """A run folder known to take new files: a read-only one (or file system) is refused here in
    one line, before any work, not as a traceback deep inside the run. With `make` it is made if
    missing (and probed with a file); without, a missing one is left for the command to make once
    its input checked out, and the folder it would be made in is asked instead."""
    path = check_out_folder(path, option)
    try:
        if not make and not path.exists():
            parent = next(folder for folder in path.parents if folder.exists())
            if not os.access(parent, os.W_OK | os.X_OK):
                code = errno.EROFS if _read_only(parent) else errno.EACCES
                raise OSError(code, os.strerror(code))
            return path
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{option} {shown(path)}: cannot write ({e.strerror or e})") from None
    return path


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def storage_reason(e: BaseException) -> str | None:
    """What the storage refused, in a few words, when `e` (an OSError, or a library's error whose
    text holds one: HDF5's, a checkpoint writer's) is a full disk, a quota or a read-only file
    system; None for anything else. Looks through what `e` wraps too: its cause and context, and
    the per-rank failures of torch's CheckpointException."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        error = todo.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        reason = _storage_reason_of(error)
        if reason:
            return reason
        todo += [x for x in (error.__cause__, error.__context__) if x is not None]
        failures = getattr(error, "failures", None)   # {rank: (exception, traceback)}
        if isinstance(failures, dict):
            for failure in failures.values():
                todo += [x for x in (failure if isinstance(failure, tuple) else (failure,))
                         if isinstance(x, BaseException)]
    return None


def _storage_reason_of(e: BaseException) -> str | None:
    text = str(e)
    code = getattr(e, "errno", None)
    if code == errno.ENOSPC or "No space left" in text or "errno = 28," in text:
        return "no space left on device"
    if code == errno.EDQUOT or "Disk quota exceeded" in text:
        return "disk quota exceeded"
    if code == errno.EROFS or "Read-only file system" in text or "errno = 30," in text:
        return "read-only file system"
    return None


def os_reason(e: BaseException) -> str:
    """An OSError (or a library's error whose text holds one) in a few words."""
    reason = storage_reason(e)
    if reason:
        return reason
    code = getattr(e, "errno", None)
    if code == errno.ELOOP:
        return "a symbolic link loop"
    if code == errno.EISDIR:
        return "is a folder"
    if code == errno.ENOTDIR:
        return "a folder on its path is a file"
    text = str(e)
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return text.splitlines()[0] if text else type(e).__name__

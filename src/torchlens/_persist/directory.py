"""Writing into a trace directory safely: its advisory lock, files created new and flushed to disk,
the directory's own flush, the removal of an old trace's files and of stopped saves' leftovers,
and OS errors worded as `TraceFileError`."""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterable, Iterator

from torchlens._core.errors import write_remedy
from torchlens._persist.format import (
    CHUNK,
    FORMAT,
    JSON_NAME,
    OWN_FILE,
    V1_FILES,
    TraceFileError,
    plain_name,
)

try:
    import fcntl

    _FLOCK = True
except ImportError:  # no flock on this platform (Windows): saves and loads take no lock
    _FLOCK = False


def write_new(path: str, parts: Iterable[memoryview | bytes]) -> int:
    """Create `path` (it must not exist), write `parts` to it and flush it to disk; returns its size."""
    size = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            while len(view):
                n = os.write(fd, view[:CHUNK])
                if n <= 0:
                    raise OSError(errno.EIO, "the file system accepted no bytes", path)
                size += n
                view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    return size


@contextlib.contextmanager
def locked(path: str, exclusive: bool) -> Iterator[int | None]:
    """Hold an advisory lock on the directory `path` (exclusive for a save, shared for a load);
    yields the directory's descriptor, or None where directories cannot be opened or locked."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        yield None
        return
    try:
        if _FLOCK:
            with contextlib.suppress(OSError):  # a file system without locks: go on unlocked
                fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield fd
    finally:
        os.close(fd)  # releases the lock


def named_before(path: str) -> set[str]:
    """The tensor files the trace.json in `path` names now (none if it is unreadable)."""
    try:
        with open(os.path.join(path, JSON_NAME), encoding="utf-8") as f:
            doc = json.load(f)
        files = (
            doc.get("tensor_files", [])
            if isinstance(doc, dict) and doc.get("format") == FORMAT
            else []
        )
        names = {
            e if isinstance(e, str) else e.get("name") if isinstance(e, dict) else None
            for e in files
        }
    except (OSError, ValueError, RecursionError, TypeError, AttributeError):
        return set()
    return {n for n in names if plain_name(n)}


def clean(path: str, keep: set[str], before: set[str]) -> None:
    """Remove what the trace saved before left (its tensor files) and the leftovers of stopped
    saves, except `keep`; every other file in `path` is left alone."""
    with contextlib.suppress(OSError):
        for name in os.listdir(path):
            if name not in keep and (
                name in before or name in V1_FILES or OWN_FILE.fullmatch(name)
            ):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(path, name))


def fsync_dir(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):  # a file system that cannot sync a directory
            os.fsync(fd)


def os_error(call: str, path: str, exc: OSError, what: str, had_trace: bool) -> TraceFileError:
    name = errno.errorcode.get(exc.errno or 0, "")
    remedy = write_remedy(exc.errno)
    kept = (
        f"The trace that was in {path!r} is unchanged."
        if had_trace
        else "No trace was saved there."
    )
    return TraceFileError(
        f"{call}: could not write {what}: {exc.strerror or exc} ({name or exc.errno}). "
        f"{kept} {remedy}".rstrip()
    )


def make_dir(path: str, call: str) -> None:
    """Create the directory `path` if missing, or raise `TraceFileError` saying why it cannot be."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise TraceFileError(f"{call}: that path is a file; a trace is saved as a directory.")
    above = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise TraceFileError(
            f"{call}: {above!r} is a file, so the directory {path!r} cannot be made inside it; "
            f"a trace is saved as a directory. Save to another path."
        )
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise os_error(call, path, exc, f"the directory {path!r}", False) from exc

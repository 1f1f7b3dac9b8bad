"""Portable traces: [`Trace.save`][torchlens.Trace.save] and [`torchlens.load`][torchlens.load].

A saved trace is a directory holding:

- `trace.json`: the module tree, the module calls, the op records, the facet sites, dtypes and
  shapes, the `save=` selection, the model's class and config, the versions that wrote it, and
  a table of the tensors: each one's dtype, shape and SHA-256 digest, and the file it is in. It
  names its tensor file with that file's size and the token of the save that wrote it.
- `tensors.<16 hex digits>.safetensors` (absent when the trace holds no tensor): every tensor the
  trace holds, in the safetensors format. Each save writes a file of a new name.

A save is atomic: the tensor file is written and flushed to disk first, under its new name, then
`trace.json` is written under a temporary name and renamed over the old one, which is the one
step that switches the directory from the old trace to the new one. Only then are the old
trace's tensor file and the leftovers of a save that was stopped removed. Each file is flushed to disk
before the next step, so whatever stops a save (a full disk, `SIGKILL`, a power cut), the
directory holds the old trace or the new one, never a mix. Saves and loads of one directory in several threads or
processes take a lock on it (an advisory `flock`, where the platform has one), so a load never
sees a save's clean-up half done.

Saving runs every pending facet check first ([`Trace.check`][torchlens.Trace.check]), so the file
holds each facet's final tensor and status and a loaded trace has no pending check.

Loading reads only JSON and safetensors, so a trace file cannot run code: no pickle is ever
opened, JSON names classes only from a fixed list of TorchLens record types, each record's
fields are the ones it stores and are checked for type, and tensor files must lie inside the
trace directory. `load` ties `trace.json` to its tensors: the tensor file must have the size and save
token `trace.json` recorded, its header must list exactly the tensors of the table with their
dtypes and shapes, packed end to end (checked before any tensor is allocated), each tensor's
bytes must have the SHA-256 digest the table recorded, and every op output and facet must have
the shape and dtype its record says. Whatever fails raises `TraceFileError` saying
what is wrong. A loaded trace has no model; `mechinterp.resolve_alias`, `alias_report` and
`compare` work on it as on the trace it was saved from.

What cannot be stored portably (a `save=` predicate, a model's KV cache object in the output,
complex tensors, attributes that are not a record's stored fields) is dropped with a warning on
save and listed in `trace.load_notes` after load.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import platform
import re
import secrets
import struct
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from torchlens._core.errors import TorchLensError
from torchlens._core.holdings import storage_ptr
from torchlens._core.persisted import PERSISTED
from torchlens._core.records import Ref
from torchlens._core.version import __version__

if TYPE_CHECKING:
    from torchlens._trace import Trace

try:
    import fcntl

    _FLOCK = True
except ImportError:  # no flock on this platform (Windows): saves and loads take no lock
    _FLOCK = False

__all__ = ["TraceFileError", "save", "load", "FORMAT", "FORMAT_VERSION"]

FORMAT = "torchlens-trace"
#: 2: the tensor file has a name of its own per save, recorded in trace.json with its size and save
#: token, and trace.json holds a table of the tensors' dtypes, shapes and SHA-256 digests.
#: (1: one `tensors.safetensors`, replaced in place, nothing recorded of it.)
FORMAT_VERSION = 2
JSON_NAME = "trace.json"
#: The files a save writes, besides trace.json: `tensors.<token>.safetensors` and, while it writes,
#: `trace.json.<token>.part`. A name of this form that trace.json does not name is a leftover.
_OWN_FILE = re.compile(r"(tensors\.[0-9a-f]{16}\.safetensors|trace\.json\.[0-9a-f]{16}\.part)")
#: What a format-1 save left: its tensor file and its temporary names.
_V1_FILES = ("tensors.safetensors", "tensors.safetensors.tmp", "trace.json.tmp")
_CHUNK = 16 << 20  # bytes per write and read
_INLINE = 1 << 20  # a tensor this small is digested at once; a larger one in a worker thread
_MAX_HEADER = 100 << 20  # the largest safetensors header read (safetensors' own limit)
_LIMIT = 1 << 63  # a tensor's element count (and each size) is an int64 in torch


class TraceFileError(TorchLensError, ValueError):
    """A trace directory could not be written or read: not a trace, malformed, truncated, torn
    (its `trace.json` and tensor file are not from one save), unsafe, written in a format version
    this TorchLens does not read, or on a disk that refused the write (full, read-only). The
    underlying error, if any, is its `__cause__`."""


def _record_classes() -> dict[str, type]:
    """The only classes a trace file may name: TorchLens's own record types (`PERSISTED`)."""
    return dict(PERSISTED)


def _versions() -> dict[str, str]:
    out = {
        "torchlens": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if "transformers" in sys.modules:
        out["transformers"] = sys.modules["transformers"].__version__
    return out


# -- the fields each record stores, and their types --------------------------------------------


class _Kind:
    """The type a stored field must have on load: `ok(value)` tells, `words` says it."""

    __slots__ = ("words", "ok")

    def __init__(self, words: str, ok: Callable[[Any], bool]):
        self.words = words
        self.ok = ok


def _is_shape(v: Any) -> bool:
    if not isinstance(v, tuple) or not all(type(n) is int and 0 <= n < _LIMIT for n in v):
        return False
    return math.prod(v) < _LIMIT


def _opt(k: _Kind) -> _Kind:
    return _Kind(f"{k.words} or None", lambda v: v is None or k.ok(v))


def _tuple(k: _Kind) -> _Kind:
    return _Kind(
        f"a tuple of ({k.words})", lambda v: isinstance(v, tuple) and all(k.ok(x) for x in v)
    )


def _list(k: _Kind) -> _Kind:
    return _Kind(f"a list of ({k.words})", lambda v: type(v) is list and all(k.ok(x) for x in v))


def _dict(key: _Kind, value: _Kind) -> _Kind:
    return _Kind(
        f"a dict of ({key.words}) to ({value.words})",
        lambda v: type(v) is dict and all(key.ok(a) and value.ok(b) for a, b in v.items()),
    )


def _rec(
    name: str,
) -> _Kind:  # the decoder builds records only of the classes `_record_classes` names
    return _Kind(
        f"{'an' if name[0] in 'AEIOU' else 'a'} {name} record",
        lambda v: type(v).__name__ == name and type(v).__module__.startswith("torchlens"),
    )


def _either(*kinds: _Kind) -> _Kind:
    return _Kind(" or ".join(k.words for k in kinds), lambda v: any(k.ok(v) for k in kinds))


_STR = _Kind("a str", lambda v: type(v) is str)
_INT = _Kind("an int", lambda v: type(v) is int)
_COUNT = _Kind("an int >= 0", lambda v: type(v) is int and v >= 0)
_BOOL = _Kind("a bool", lambda v: type(v) is bool)
_NUMBER = _Kind("a number", lambda v: type(v) in (int, float))
_NONE = _Kind("None", lambda v: v is None)
_ANY = _Kind("any value", lambda v: True)
_DTYPE = _Kind("a torch.dtype", lambda v: isinstance(v, torch.dtype))
_DEVICE = _Kind("a torch.device", lambda v: isinstance(v, torch.device))
_TENSOR = _Kind("a tensor", lambda v: isinstance(v, torch.Tensor))
_SHAPE = _Kind("a shape (ints >= 0 whose product is below 2**63)", _is_shape)
_REF = _Kind(
    "a Ref", lambda v: type(v).__name__ == "Ref" and type(v).__module__.startswith("torchlens")
)
_SOURCE = _either(
    _REF, _STR, _NONE
)  # where a tensor came from: an op's output, a parameter, outside
_CALL = _opt(_rec("ModuleCall"))
_STRS = _Kind(
    "a frozenset of str", lambda v: type(v) is frozenset and all(type(x) is str for x in v)
)

#: record class -> stored field -> its type. Only these fields are written, and a record in a
#: trace file must have exactly these (a field that would shadow a method, such as `check`, is
#: refused). `test_persist_faults` checks this table against the record classes.
_FIELDS: dict[str, dict[str, _Kind]] = {
    "Trace": {
        "ops": _list(_rec("OpRecord")),
        "modules": _rec("ModuleMap"),
        "output": _ANY,
        "blocks": _list(_STR),
        "model_class": _STR,
        "save_spec": _rec("SaveSpec"),
        "structure": _opt(_rec("Structure")),
        "edits": _tuple(_rec("EditRecord")),
    },
    "ModuleMap": {"_records": _dict(_STR, _rec("ModuleRecord")), "_aliases": _dict(_STR, _STR)},
    "ModuleRecord": {
        "address": _STR,
        "class_name": _STR,
        "role": _STR,
        "calls": _list(_rec("ModuleCall")),
        "aliases": _tuple(_STR),
    },
    "ModuleCall": {
        "address": _STR,
        "index": _COUNT,
        "role": _STR,
        "class_name": _STR,
        "first_op": _COUNT,
        "end_op": _INT,
        "facets": _opt(_rec("FacetMap")),
        "parent": _CALL,
        "retained": _BOOL,
        "input_ref": _SOURCE,
        "output_ref": _SOURCE,
        "_in": _NONE,
        "_out": _NONE,
        "grads": _opt(_rec("GradMap")),
    },
    "FacetMap": {
        "address": _STR,
        "role": _STR,
        "refused": _dict(_STR, _STR),
        "sites": _dict(_STR, _rec("FacetSite")),
        "ran": _BOOL,
    },
    "GradMap": {
        "address": _STR,
        "role": _STR,
        "refused": _dict(_STR, _STR),
        "sites": _dict(_STR, _rec("FacetSite")),
        "ran": _BOOL,
        "loss": _STR,
    },
    "FacetSite": {
        "name": _STR,
        "kind": _STR,
        "shape": _SHAPE,
        "dtype": _DTYPE,
        "tensor": _opt(_TENSOR),
        "op": _opt(_COUNT),
        "check_error": _opt(_NUMBER),
        "note": _STR,
    },
    "OpRecord": {
        "index": _COUNT,
        "name": _STR,
        "module": _STR,
        "call": _COUNT,
        "inputs": _tuple(_SOURCE),
        "shapes": _tuple(_SHAPE),
        "dtypes": _tuple(_DTYPE),
        "device": _DEVICE,
        "tensors": _tuple(_opt(_TENSOR)),
        "mutated": _BOOL,
        "extra": _opt(_dict(_STR, _ANY)),
    },
    "SaveSpec": {"everything": _BOOL, "addresses": _STRS, "facets": _STRS, "predicate": _NONE},
    "EditRecord": {
        "key": _ANY,
        "module_address": _STR,
        "facet": _STR,
        "calls": _tuple(_COUNT),
        "how": _STR,
        "where": _STR,
        "applied": _COUNT,
    },
    "Layer": {
        "call": _rec("ModuleCall"),
        "attention": _CALL,
        "cross_attention": _CALL,
        "mlp": _CALL,
    },
    "Stack": {
        "name": _STR,
        "layers": _list(_rec("Layer")),
        "kind": _STR,
        "final_norm": _CALL,
        "passes": _Kind("an int >= 1", lambda v: type(v) is int and v >= 1),
        "repeats": _list(_rec("Layer")),
    },
    "Structure": {
        "stacks": _dict(_STR, _rec("Stack")),
        "lm_stack": _opt(_STR),
        "kind": _STR,
        "token_embed": _CALL,
        "unembed": _CALL,
        "final_norm": _CALL,
        "notes": _list(_STR),
        "children": _dict(_INT, _list(_rec("ModuleCall"))),
    },
}

#: Attributes `load` sets from trace.json's own fields, not stored in the record.
_SET_BY_LOAD = {"Trace": ("saved_with", "model_info", "load_notes")}


# -- writing -----------------------------------------------------------------------------------

#: torch dtype -> its safetensors name; a tensor of any other dtype is left out on save, with a note.
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _ST_DTYPES[getattr(torch, _name)] = _code


class _Encoder:
    def __init__(self, classes: dict[str, type]):
        self.classes = {c: n for n, c in classes.items()}
        self.objects: list[Any] = []  # encoded records, by object number
        self.memo: dict[int, int] = {}  # id(record) -> object number
        self.keep: list[Any] = []  # keeps memoized objects alive, so ids stay unique
        self.tensors: dict[str, torch.Tensor] = {}
        self.tensor_keys: dict[int, str] = {}
        self.dropped: list[str] = []

    def tensor(self, t: torch.Tensor, where: str) -> Any:
        key = self.tensor_keys.get(id(t))
        if key is not None:
            return {"tensor": key}
        if t.is_meta or t.layout != torch.strided or t.dtype not in _ST_DTYPES:
            what = (
                "meta"
                if t.is_meta
                else str(t.layout)
                if t.layout != torch.strided
                else str(t.dtype)
            )
            self.dropped.append(f"{where} (a {what} tensor)")
            return {"dropped": f"tensor {t.dtype} {list(t.shape)}"}
        if storage_ptr(t) is None:  # a wrapper subclass: its data is in the tensors it wraps
            self.dropped.append(
                f"{where} (a {type(t).__name__}, a tensor subclass with no storage of its own)"
            )
            return {"dropped": f"tensor {t.dtype} {list(t.shape)}"}
        key = f"t{len(self.tensors)}"
        # Tensors sharing memory are fine: the writer copies each one's bytes into the file (a
        # contiguous copy of one that is not is made as it is written).
        self.tensors[key] = t.detach().to("cpu")
        self.tensor_keys[id(t)] = key
        self.keep.append(t)
        return {"tensor": key, "device": str(t.device)}

    def enc(self, v: Any, where: str) -> Any:
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return v
        if isinstance(v, float):
            return v if math.isfinite(v) else {"float": repr(v)}
        if isinstance(v, torch.Tensor):
            return self.tensor(v, where)
        if isinstance(v, torch.dtype):
            return {"dtype": str(v).removeprefix("torch.")}
        if isinstance(v, torch.Size):
            return {"size": list(v)}
        if isinstance(v, torch.device):
            return {"device_obj": str(v)}
        if isinstance(v, slice):
            return {
                "slice": [
                    self.enc(v.start, where),
                    self.enc(v.stop, where),
                    self.enc(v.step, where),
                ]
            }
        if v is Ellipsis:
            return {"ellipsis": True}
        if isinstance(v, tuple) and hasattr(v, "_fields") and type(v).__name__ == "Ref":
            return {"ref": [v[0], v[1]]}  # a Ref's (op, slot)
        name = self.classes.get(type(v))
        if name is not None:
            return {"obj": self.record(v, name, where)}
        if isinstance(v, tuple):
            return {"tuple": [self.enc(x, f"{where}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self.enc(x, f"{where}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, (set, frozenset)):
            return {"set": sorted((self.enc(x, where) for x in v), key=repr)}
        if isinstance(v, Mapping) and type(v).__module__.split(".")[0] in (
            "builtins",
            "collections",
            "transformers",
        ):
            items = list(v.items())
            if items and all(
                type(k) is int and k in self.memo for k, _ in items
            ):  # keyed by id(record)
                return {"id_keys": [[self.memo[k], self.enc(x, f"{where}[...]")] for k, x in items]}
            out: dict[str, Any] = {
                "items": [[self.enc(k, where), self.enc(x, f"{where}[{k!r}]")] for k, x in items]
            }
            if type(v) is not dict:
                out["mapping"] = type(v).__name__  # a ModelOutput loads as a plain dict
            return out
        self.dropped.append(f"{where} ({type(v).__name__})")
        return {"dropped": type(v).__name__}

    def record(self, obj: Any, name: str, where: str) -> int:
        n = self.memo.get(id(obj))
        if n is not None:
            return n
        n = len(self.objects)
        self.memo[id(obj)] = n
        self.keep.append(obj)
        self.objects.append(None)
        fields: dict[str, Any] = {}
        for f, value in _fields(obj, name):
            if f == "predicate" and value is not None:
                self.dropped.append(f"{where}.predicate (a save= callable)")
                value = None
            fields[f] = self.enc(value, f"{where}.{f}")
        stored = (
            set(_FIELDS[name])
            | set(_SET_BY_LOAD.get(name, ()))
            | set(getattr(type(obj), "_persist_renames", {}).values())
        )
        for attr in vars(obj) if hasattr(obj, "__dict__") else ():
            if not attr.startswith("_") and attr not in stored:
                self.dropped.append(f"{where}.{attr} (not a field a {name} stores)")
        self.objects[n] = {"class": name, "fields": fields}
        return n


def _fields(obj: Any, name: str) -> list[tuple[str, Any]]:
    """The (field, value) pairs a record stores: the fields `_FIELDS` lists for its class."""
    if hasattr(
        type(obj), "_persist_fields"
    ):  # a record that says how it stores them (FacetSite, FacetMap)
        return obj._persist_fields()
    return [(f, getattr(obj, f)) for f in _FIELDS[name]]


def _model_info(model: Any) -> dict | None:
    if model is None:
        return None
    info: dict[str, Any] = {"class": f"{type(model).__module__}.{type(model).__qualname__}"}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        info["config"] = json.loads(json.dumps(config.to_dict(), default=str))
    return info


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of the CPU tensor `t`: without a copy when it is contiguous."""
    t = t.resolve_conj().resolve_neg().contiguous()
    if not t.numel():
        return memoryview(b"")
    # flat with stride 1: a contiguous tensor's size-1 dims may carry any stride
    flat = t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy()
    return memoryview(flat)  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only on Python 3.12+


def _layout(
    tensors: dict[str, torch.Tensor], token: str
) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
    """The safetensors prefix (length and header) and the tensors in file order: widest elements
    first, so each starts at a multiple of its element size (the data starts 8-byte aligned)."""
    order = sorted(tensors.items(), key=lambda kv: -kv[1].element_size())
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT, "save": token}}
    offset = 0
    for key, t in order:
        n = t.numel() * t.element_size()
        header[key] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text, order


def _write_new(path: str, parts: Iterable[memoryview | bytes]) -> int:
    """Create `path` (it must not exist), write `parts` to it and flush it to disk; returns its size."""
    size = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            while len(view):
                n = os.write(fd, view[:_CHUNK])
                if n <= 0:
                    raise OSError(errno.EIO, "the file system accepted no bytes", path)
                size += n
                view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    return size


def _sha256(view: memoryview) -> str:
    return hashlib.sha256(view).hexdigest()


class _Digests:
    """SHA-256 of tensors' bytes: small ones at once, larger ones in worker threads (hashlib lets
    go of the GIL), so digesting overlaps reading or writing and uses several cores. The threads
    end when the `with` block does, also on an error."""

    def __init__(self):
        self.pool: ThreadPoolExecutor | None = None
        self.done: dict[str, str | Future] = {}

    def __enter__(self) -> _Digests:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def add(self, key: str, view: memoryview) -> None:
        if len(view) < _INLINE:
            self.done[key] = _sha256(view)
            return
        if self.pool is None:
            self.pool = ThreadPoolExecutor(
                max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="torchlens-sha256"
            )
        self.done[key] = self.pool.submit(_sha256, view)

    def results(self) -> dict[str, str]:
        return {k: v if isinstance(v, str) else v.result() for k, v in self.done.items()}


@contextlib.contextmanager
def _locked(path: str, exclusive: bool) -> Iterator[int | None]:
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


def _named_before(path: str) -> set[str]:
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
    return {n for n in names if _plain_name(n)}


def _plain_name(name: Any) -> TypeGuard[str]:
    """Whether `name` is a plain `*.safetensors` file name (no directory part)."""
    return (
        isinstance(name, str)
        and bool(name)
        and not os.path.isabs(name)
        and os.sep not in name
        and "/" not in name
        and name not in (".", "..")
        and name.endswith(".safetensors")
    )


def _clean(path: str, keep: set[str], before: set[str]) -> None:
    """Remove what the trace saved before left (its tensor files) and the leftovers of stopped
    saves, except `keep`; every other file in `path` is left alone."""
    with contextlib.suppress(OSError):
        for name in os.listdir(path):
            if name not in keep and (
                name in before or name in _V1_FILES or _OWN_FILE.fullmatch(name)
            ):
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(path, name))


def _fsync_dir(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):  # a file system that cannot sync a directory
            os.fsync(fd)


def _os_error(call: str, path: str, exc: OSError, what: str, had_trace: bool) -> TraceFileError:
    name = errno.errorcode.get(exc.errno or 0, "")
    remedy = {
        errno.ENOSPC: "The disk is full: free space there or save elsewhere.",
        errno.EROFS: "The file system is read-only: save to a writable directory.",
        errno.EACCES: "This process may not write there: save to a directory it may write to.",
        errno.EPERM: "This process may not write there: save to a directory it may write to.",
        errno.EFBIG: "The file is larger than this process or file system allows (see `ulimit -f`).",
        errno.ENOTDIR: "A part of the path is a file, not a directory: save to another path.",
    }.get(exc.errno or 0, "")
    if getattr(errno, "EDQUOT", None) == exc.errno:
        remedy = "The disk quota is used up: free space there or save elsewhere."
    kept = (
        f"The trace that was in {path!r} is unchanged."
        if had_trace
        else "No trace was saved there."
    )
    return TraceFileError(
        f"{call}: could not write {what}: {exc.strerror or exc} ({name or exc.errno}). "
        f"{kept} {remedy}".rstrip()
    )


def _make_dir(path: str, call: str) -> None:
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
        raise _os_error(call, path, exc, f"the directory {path!r}", False) from exc


def save(trace: Any, path: str | os.PathLike, model: Any = None) -> list[str]:
    """Write `trace` to the directory `path` (created if missing), atomically.

    The tensors go to a new `tensors.<token>.safetensors`, flushed to disk; `trace.json` (naming
    that file with its size and token, and each tensor with its SHA-256) is written last, under a temporary name renamed over
    the old one. Then the old trace's tensor file and the leftovers of stopped saves are
    removed. Other files in the directory are left alone.

    Returns:
        What could not be stored portably (also issued as one warning), empty when nothing.

    Raises:
        TraceFileError: `path` is a file or lies under one, or the directory or its files
            cannot be written (read-only, no permission, disk full). The trace that was there
            before is then unchanged, and no partial file is left; the OS error is the cause.
    """
    path = os.fspath(path)
    call = f"Trace.save({path!r})"
    _make_dir(path, call)
    # Every pending facet check runs first, so the file holds final tensors and statuses and a
    # loaded trace has nothing left to compute (it has no model to compute from).
    trace.check()
    enc = _Encoder(_record_classes())
    # Every module call first, so that dicts keyed by id(call) find their keys.
    for rec in trace.modules.values():
        for call_ in rec.calls:
            enc.record(call_, "ModuleCall", f"modules[{call_.address!r}].calls[{call_.index}]")
    root = enc.record(trace, "Trace", "trace")
    token = secrets.token_hex(8)
    tensor_name = f"tensors.{token}.safetensors"
    made: list[str] = []  # the files this save created, removed unless it finished
    committed = False
    had_trace = os.path.isfile(os.path.join(path, JSON_NAME))
    what = f"the directory {path!r}"
    try:
        with _locked(path, exclusive=True) as dir_fd:
            had_trace = os.path.isfile(os.path.join(path, JSON_NAME))
            files, digests = [], {}
            if enc.tensors:
                prefix, order = _layout(enc.tensors, token)
                full = os.path.join(path, tensor_name)
                what = f"the tensor file {full!r}"
                made.append(full)

                def parts(hashing: _Digests) -> Iterator[memoryview | bytes]:
                    yield prefix
                    for (
                        key,
                        t,
                    ) in order:  # a copy made for one tensor is dropped once written and digested
                        view = _bytes(t)
                        hashing.add(key, view)
                        yield view

                with _Digests() as hashing:
                    size = _write_new(full, parts(hashing))
                    digests = hashing.results()
                files.append({"name": tensor_name, "bytes": size, "save": token})
            doc = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "versions": _versions(),
                "model_class": trace.model_class,
                "model": _model_info(model),
                "tensor_files": files,
                "tensors": {
                    key: {
                        "file": 0,
                        "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape),
                        "sha256": digests[key],
                    }
                    for key, t in enc.tensors.items()
                },
                "root": root,
                "objects": enc.objects,
                "notes": [f"dropped on save: {d}" for d in enc.dropped],
            }
            text = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")
            before = _named_before(path)
            part = os.path.join(path, f"{JSON_NAME}.{token}.part")
            what = f"{JSON_NAME} ({part!r})"
            made.append(part)
            _write_new(part, [text])
            os.replace(
                part, os.path.join(path, JSON_NAME)
            )  # the one step from the old trace to the new
            committed = True
            _fsync_dir(dir_fd)
            _clean(path, {JSON_NAME, tensor_name}, before)
    except BaseException as exc:
        if not committed:
            for f in made:
                with contextlib.suppress(OSError):
                    os.remove(f)
        if isinstance(exc, OSError):
            raise _os_error(call, path, exc, what, had_trace) from exc
        raise
    if enc.dropped:
        shown = "; ".join(enc.dropped[:3]) + (
            f"; and {len(enc.dropped) - 3} more" if len(enc.dropped) > 3 else ""
        )
        warnings.warn(
            f"torchlens: Trace.save could not store {len(enc.dropped)} value(s) portably and left "
            f"them out: {shown}. The loaded trace lists them in trace.load_notes.",
            stacklevel=3,
        )
    return enc.dropped


# -- reading -----------------------------------------------------------------------------------

#: safetensors dtype name -> torch dtype (the names `_ST_DTYPES` writes)
_TORCH_DTYPES = {code: dt for dt, code in _ST_DTYPES.items()}
_TORN = (
    "the tensor file and trace.json are not from one save (a save that did not finish, with "
    "another TorchLens or by hand, or a file changed since)"
)


def _tensor_file(root: str, name: Any) -> str:
    """The path of a tensor file named in trace.json, refused unless it lies inside `root`."""
    if not _plain_name(name):
        raise TraceFileError(
            f"torchlens.load: trace.json names the tensor file {name!r}; only a plain *.safetensors file "
            f"name inside the trace directory is accepted, so it was refused."
        )
    full = os.path.join(root, name)
    if os.path.dirname(os.path.realpath(full)) != os.path.realpath(root):
        raise TraceFileError(
            f"torchlens.load: the tensor file {name!r} links outside the trace directory "
            f"{root!r}; refused."
        )
    if not os.path.isfile(full):
        raise TraceFileError(
            f"torchlens.load: the tensor file {name!r} named in trace.json is missing from {root!r}."
        )
    return full


def _read_into(f: Any, view: memoryview, full: str) -> None:
    """Fill `view` from `f`; a short read means the file is truncated."""
    pos = 0
    while pos < len(view):
        n = f.readinto(view[pos : pos + _CHUNK])
        if not n:
            raise TraceFileError(f"torchlens.load: {full} ends early; it is truncated, or {_TORN}.")
        pos += n


def _read_tensor_file(
    full: str, entry: dict, expected: dict[str, tuple[torch.dtype, list[int], str]]
) -> dict:
    """The tensors of one tensor file, each checked against trace.json: the file's size and save
    token, its header (exactly the expected tensors, with their dtypes and shapes, packed end to
    end, all checked before anything is allocated) and each tensor's SHA-256."""

    def bad(why: str) -> TraceFileError:
        return TraceFileError(
            f"torchlens.load: {full} is not a readable safetensors file ({why}); it is malformed "
            f"or truncated. Only safetensors is read, never pickle."
        )

    size = os.path.getsize(full)
    if size != entry["bytes"]:
        cut = "it is truncated, or " if size < entry["bytes"] else ""
        raise TraceFileError(
            f"torchlens.load: {full} is {size} bytes; trace.json recorded {entry['bytes']}: "
            f"{cut}{_TORN}."
        )
    with open(full, "rb", buffering=0) as f:
        head = bytearray(8)
        _read_into(f, memoryview(head), full)
        (n,) = struct.unpack("<Q", bytes(head))
        if n > min(size - 8, _MAX_HEADER):
            raise bad(f"its header would be {n} bytes")
        text = bytearray(n)
        _read_into(f, memoryview(text), full)
        try:
            header = json.loads(bytes(text))
        except (ValueError, RecursionError) as exc:
            raise bad(f"its header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise bad("its header is not a JSON object")
        meta = header.pop("__metadata__", None)
        token = meta.get("save") if isinstance(meta, dict) else None
        if token != entry.get("save"):
            raise TraceFileError(
                f"torchlens.load: {full} was written by the save {token!r}; trace.json names the "
                f"file of the save {entry.get('save')!r}: {_TORN}."
            )
        if set(header) != set(expected):
            extra, missing = (
                sorted(set(header) - set(expected)),
                sorted(set(expected) - set(header)),
            )
            raise TraceFileError(
                f"torchlens.load: {full} holds other tensors than trace.json names (not named "
                f"there: {extra[:5]}; missing: {missing[:5]}): {_TORN}."
            )
        spans = []
        for key, e in header.items():
            dtype, shape, _ = expected[key]
            ok = (
                isinstance(e, dict)
                and isinstance(e.get("shape"), list)
                and isinstance(e.get("data_offsets"), list)
                and len(e["data_offsets"]) == 2
                and all(type(x) is int and x >= 0 for x in e["data_offsets"] + e["shape"])
            )
            if not ok:
                raise bad(f"tensor {key!r} has the header entry {str(e)[:120]}")
            if e.get("dtype") != _ST_DTYPES[dtype] or e["shape"] != shape:
                raise TraceFileError(
                    f"torchlens.load: {full} holds tensor {key!r} as {e.get('dtype')} {e['shape']}; trace.json "
                    f"recorded {_ST_DTYPES[dtype]} ({str(dtype).removeprefix('torch.')}) {shape}: {_TORN}."
                )
            begin, end = e["data_offsets"]
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise bad(f"tensor {key!r}: {shape} {dtype} does not fill bytes {begin} to {end}")
            spans.append((begin, end, key))
        spans.sort()
        at = 0
        for begin, end, key in spans:
            if begin != at:
                raise bad(
                    f"tensor {key!r} starts at byte {begin}, not {at}: the tensors overlap or leave a gap"
                )
            at = end
        if 8 + n + at != size:
            raise bad(f"its tensors end at byte {8 + n + at} of {size}")
        out = {}
        with _Digests() as hashing:
            for _, _, key in spans:  # in file order: one pass over the file
                dtype, shape, _ = expected[key]
                t = torch.empty(shape, dtype=dtype)
                _read_into(f, _bytes(t), full)
                hashing.add(key, _bytes(t))
                out[key] = t
            digests = hashing.results()
    for key, digest in digests.items():
        if digest != expected[key][2]:
            raise TraceFileError(
                f"torchlens.load: the bytes of tensor {key!r} in {full} have the SHA-256 {digest}; "
                f"trace.json recorded {expected[key][2]}: {_TORN}."
            )
    return out


def _read_tensors(root: str, doc: dict) -> dict[str, torch.Tensor]:
    """Every tensor trace.json's table names, read from its files and checked against it."""
    files, table = doc.get("tensor_files"), doc.get("tensors")
    entry_ok = lambda e: (
        isinstance(e, dict)
        and type(e.get("bytes")) is int
        and isinstance(e.get("save"), str)
        and "name" in e
    )
    if not isinstance(files, list) or not all(entry_ok(e) for e in files):
        raise TraceFileError(
            "torchlens.load: trace.json's tensor_files is not a list of {name, bytes, save} "
            "entries; the file is malformed."
        )
    if not isinstance(table, dict):
        raise TraceFileError(
            "torchlens.load: trace.json's tensors table is not a JSON object; the file is malformed."
        )
    by_file: list[dict[str, tuple[torch.dtype, list[int], str]]] = [{} for _ in files]
    for key, e in table.items():
        dtype = (
            getattr(torch, e.get("dtype", ""), None)
            if isinstance(e, dict) and isinstance(e.get("dtype"), str)
            else None
        )
        shape = e.get("shape") if isinstance(e, dict) else None
        if (
            not isinstance(dtype, torch.dtype)
            or dtype not in _ST_DTYPES
            or type(e.get("file")) is not int
            or not 0 <= e["file"] < len(files)
            or not isinstance(shape, list)
            or not _is_shape(tuple(shape))
            or not isinstance(e.get("sha256"), str)
        ):
            raise TraceFileError(
                f"torchlens.load: trace.json's tensors table has the entry {key!r}: {str(e)[:120]}; "
                f"an entry is {{file, dtype, shape, sha256}} (a shape of ints >= 0 whose product is "
                f"below 2**63); the file is malformed."
            )
        by_file[e["file"]][key] = (dtype, shape, e["sha256"])
    tensors: dict[str, torch.Tensor] = {}
    for entry, expected in zip(files, by_file):
        full = _tensor_file(root, entry["name"])
        try:
            tensors.update(_read_tensor_file(full, entry, expected))
        except OSError as exc:
            raise TraceFileError(f"torchlens.load: {full} could not be read: {exc}.") from exc
    return tensors


class _Decoder:
    def __init__(self, objects: list, classes: dict[str, type], tensors: dict[str, torch.Tensor]):
        self.src = objects
        self.classes = classes
        self.tensors = tensors
        self.built: list[Any] = [None] * len(objects)

    def obj(self, n: Any) -> Any:
        if type(n) is not int or not 0 <= n < len(self.src):
            raise TraceFileError(
                f"torchlens.load: trace.json refers to record {n!r}, which it does not hold."
            )
        if self.built[n] is None:
            spec = self.src[n]
            if (
                not isinstance(spec, dict)
                or spec.get("class") not in self.classes
                or spec["class"] not in _FIELDS
            ):
                got = spec.get("class") if isinstance(spec, dict) else spec
                raise TraceFileError(
                    f"torchlens.load: trace.json names the class {str(got)[:80]!r}; a trace file may only name "
                    f"TorchLens records ({', '.join(sorted(self.classes))})."
                )
            name = spec["class"]
            fields = spec.get("fields")
            kinds = _FIELDS[name]
            if not isinstance(fields, dict) or set(fields) != set(kinds):
                have = sorted(map(str, fields)) if isinstance(fields, dict) else []
                odd = [f for f in have if f not in kinds]
                missing = [f for f in kinds if f not in have]
                raise TraceFileError(
                    f"torchlens.load: record {n} (a {name}) has the fields {have[:20]}; a {name} stores exactly "
                    f"{list(kinds)}"
                    + (f" (not stored: {odd[:5]}, refused)" if odd else "")
                    + (f" (missing: {missing})" if missing else "")
                    + "; the file is malformed or was edited."
                )
            cls = self.classes[name]
            inst: Any = object.__new__(cls)
            self.built[n] = inst
            renames: dict[str, str] = getattr(cls, "_persist_renames", {})
            for f, value in fields.items():
                v = self.dec(value)
                if not kinds[f].ok(v):
                    raise TraceFileError(
                        f"torchlens.load: record {n} (a {name}) has {f} = {_show(v)}; a {name}'s {f} must be "
                        f"{kinds[f].words}. The file is malformed or was edited."
                    )
                object.__setattr__(inst, renames[f] if f in renames else f, v)
        return self.built[n]

    def dec(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [self.dec(x) for x in v]
        if not isinstance(v, dict) or len(v) == 0:
            raise TraceFileError(f"torchlens.load: unexpected value {str(v)[:80]!r} in trace.json.")
        if "tensor" in v:
            key = v["tensor"]
            if not isinstance(key, str) or key not in self.tensors:
                raise TraceFileError(
                    f"torchlens.load: trace.json refers to tensor {str(key)[:40]!r}, which its "
                    f"tensors table and tensor files do not hold (truncated or mismatched files?)."
                )
            return self.tensors[key]
        if "obj" in v:
            return self.obj(v["obj"])
        if "ref" in v:
            ref = v["ref"]
            if (
                not isinstance(ref, list)
                or len(ref) != 2
                or not all(type(x) is int and x >= 0 for x in ref)
            ):
                return self._bad(v)
            return Ref(*ref)
        if "tuple" in v:
            return tuple(self.dec(x) for x in self._items(v, "tuple"))
        if "items" in v:
            return {self._key(k): self.dec(x) for k, x in self._pairs(v, "items")}
        if "id_keys" in v:
            return {id(self.obj(k)): self.dec(x) for k, x in self._pairs(v, "id_keys")}
        if "set" in v:
            return frozenset(self._key(x) for x in self._items(v, "set"))
        if "dtype" in v:
            dt = getattr(torch, v["dtype"], None) if isinstance(v["dtype"], str) else None
            if not isinstance(dt, torch.dtype):
                raise TraceFileError(
                    f"torchlens.load: unknown dtype {str(v['dtype'])[:40]!r} in trace.json."
                )
            return dt
        if "size" in v:
            size = tuple(v["size"]) if isinstance(v["size"], list) else None
            return torch.Size(size) if size is not None and _is_shape(size) else self._bad(v)
        if "device_obj" in v:
            try:
                return torch.device(str(v["device_obj"]))
            except (RuntimeError, ValueError, TypeError):
                return self._bad(v)
        if "float" in v:
            return float(v["float"]) if v["float"] in ("nan", "inf", "-inf") else self._bad(v)
        if "slice" in v:
            return slice(*(self.dec(x) for x in self._items(v, "slice")))
        if "ellipsis" in v:
            return Ellipsis
        if "dropped" in v:
            return None
        return self._bad(v)

    def _items(self, v: dict, key: str) -> list:
        return v[key] if isinstance(v[key], list) else self._bad(v)

    def _pairs(self, v: dict, key: str) -> list:
        items = self._items(v, key)
        return items if all(isinstance(p, list) and len(p) == 2 for p in items) else self._bad(v)

    def _key(self, k: Any) -> Any:
        k = self.dec(k)
        return tuple(k) if isinstance(k, list) else k

    @staticmethod
    def _bad(v: Any):
        raise TraceFileError(f"torchlens.load: unexpected value {str(v)[:80]!r} in trace.json.")


def _show(v: Any) -> str:
    return f"{str(v)[:60]} (type {type(v).__name__})"


def _check_held(trace: Any, keys: dict[int, str]) -> None:
    """Every tensor a record holds has the shape and dtype the record says, and every op index
    a record holds names an op of the trace."""
    ops = trace.ops

    def held(t: torch.Tensor, shape: Any, dtype: Any, whose: str) -> None:
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise TraceFileError(
                f"torchlens.load: {whose} is recorded as {list(shape)} {str(dtype).removeprefix('torch.')}, but "
                f"the tensor trace.json gives it ({keys.get(id(t))}) is {list(t.shape)} "
                f"{str(t.dtype).removeprefix('torch.')}; the file is malformed or was edited."
            )

    def in_range(i: Any, whose: str, end: int) -> None:
        if i is not None and type(i) is int and not 0 <= i < end:
            raise TraceFileError(
                f"torchlens.load: {whose} names op {i}; the trace has {len(ops)} ops (0 to "
                f"{len(ops) - 1}); the file is malformed or was edited."
            )

    for i, op in enumerate(ops):
        whose = f"op #{i} ({op.name})"
        if op.index != i:
            raise TraceFileError(
                f"torchlens.load: {whose} has index {op.index}; the file is malformed or was edited."
            )
        if not len(op.tensors) == len(op.shapes) == len(op.dtypes):
            raise TraceFileError(
                f"torchlens.load: {whose} has {len(op.shapes)} shapes, {len(op.dtypes)} dtypes and "
                f"{len(op.tensors)} tensor slots; the file is malformed or was edited."
            )
        for slot, (t, shape, dtype) in enumerate(zip(op.tensors, op.shapes, op.dtypes)):
            if t is not None:
                held(t, shape, dtype, f"output {slot} of {whose}")
        for src in op.inputs:
            if type(src).__name__ == "Ref":
                in_range(src.op, f"an input of {whose}", i)
    for rec in trace.modules.values():
        for call in rec.calls:
            whose = f"call {call.index} of {call.address or '<root>'!r}"
            in_range(call.first_op, whose, len(ops) + 1)
            for ref in (call.input_ref, call.output_ref):
                if type(ref).__name__ == "Ref":
                    in_range(ref.op, whose, len(ops))
            for what, fmap in (
                ("facet", call.facets),
                ("gradient of facet", getattr(call, "grads", None)),
            ):
                for name, site in fmap._sites.items() if fmap is not None else ():
                    in_range(site.op, f"{what} {name!r} of {whose}", len(ops))
                    t = site.__dict__.get("tensor")
                    if t is not None:
                        held(t, site.shape, site.dtype, f"{what} {name!r} of {whose}")


def _read_doc(doc_path: str) -> dict:
    try:
        with open(doc_path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TraceFileError(f"torchlens.load: {doc_path} could not be read: {exc}.") from exc
    try:
        doc = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise TraceFileError(
            f"torchlens.load: {doc_path} nests its values too deeply to be read (a trace.json "
            f"TorchLens writes nests a few levels); the file is malformed."
        ) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise TraceFileError(
            f"torchlens.load: {doc_path} is not valid JSON ({exc}); the file is malformed "
            f"or truncated."
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TraceFileError(
            f'torchlens.load: {doc_path} is not a TorchLens trace (no "format": {FORMAT!r}).'
        )
    return doc


def load(path: str | os.PathLike) -> Trace:
    """Read a trace written by [`Trace.save`][torchlens.Trace.save].

    Only JSON and safetensors are read; nothing is unpickled, so loading a trace cannot run
    code. The loaded [`Trace`][torchlens.Trace] holds CPU tensors and no model; `mechinterp`'s
    `resolve_alias`, `alias_report` and `compare` work on it.

    Loading checks that `trace.json` and its tensor file are from one save: the file's size and
    save token must be the ones `trace.json` recorded, its header must list exactly the tensors
    of `trace.json`'s table with their dtypes and shapes, each tensor's bytes must have the
    SHA-256 the table recorded, and every op output and facet tensor must have the shape and
    dtype of its record. Each record must have exactly the fields its class
    stores, each of its type.

    Args:
        path: the directory `Trace.save` wrote.

    Returns:
        The trace. `trace.saved_with` holds the versions that wrote it, `trace.model_info` the
        model's class and config (when `save` was given the model), and `trace.load_notes` what
        could not be stored.

    Raises:
        TraceFileError: `path` is not a trace directory; a file is malformed, truncated, or names
            something outside the directory or outside TorchLens's record types; `trace.json` and
            the tensor file are not from one save, or a tensor's shape or dtype is not its
            record's; or the file format version is not the one this TorchLens reads (the message
            lists the versions that differ).

    Examples:
        >>> import tempfile, torch, torchlens
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
        >>> t = torchlens.trace(model, torch.ones(2, 3))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     dropped = t.save(d)
        ...     back = torchlens.load(d)
        >>> dropped
        []
        >>> torch.equal(back.modules["0"].facets["output"], t.modules["0"].facets["output"])
        True
    """
    root = os.fspath(path)
    doc_path = os.path.join(root, JSON_NAME)
    if not os.path.isdir(root) or not os.path.isfile(doc_path):
        what = (
            "a file"
            if os.path.isfile(root)
            else "missing"
            if not os.path.exists(root)
            else "a directory without trace.json"
        )
        raise TraceFileError(
            f"torchlens.load({root!r}): that path is {what}; a saved trace is a directory "
            f"holding {JSON_NAME} and the tensor file it names, as written by Trace.save."
        )
    with _locked(root, exclusive=False):  # a save into it waits until the files are read
        doc = _read_doc(doc_path)
        if doc.get("format_version") != FORMAT_VERSION:
            theirs = v if isinstance(v := doc.get("versions"), dict) else {}
            ours = _versions()
            diffs = [
                f"{k} {theirs.get(k)} there, {ours.get(k)} here"
                for k in sorted(set(theirs) | set(ours), key=str)
                if theirs.get(k) != ours.get(k)
            ]
            raise TraceFileError(
                f"torchlens.load: {root!r} is trace format version {repr(doc.get('format_version'))[:40]}; this "
                f"TorchLens reads version {FORMAT_VERSION}. Versions that differ: {'; '.join(diffs) or 'none recorded'}. "
                f"Load it with the TorchLens that wrote it, or save it again with this one."
            )
        versions, notes, objects = doc.get("versions", {}), doc.get("notes", []), doc.get("objects")
        if (
            not isinstance(versions, dict)
            or not all(isinstance(v, str) for v in versions.values())
            or not isinstance(notes, list)
            or not all(isinstance(n, str) for n in notes)
            or not isinstance(doc.get("model"), (dict, type(None)))
            or not isinstance(objects, list)
        ):
            raise TraceFileError(
                f"torchlens.load: {doc_path} is malformed (versions, notes, model or objects is not "
                f"of its type: a dict of str, a list of str, a dict or null, a list)."
            )
        tensors = _read_tensors(root, doc)
    try:
        dec = _Decoder(objects, _record_classes(), tensors)
        trace = dec.obj(doc.get("root"))
        if type(trace).__name__ != "Trace":
            raise TraceFileError("torchlens.load: trace.json's root record is not a Trace.")
        _check_held(trace, {id(t): k for k, t in tensors.items()})
    except TraceFileError:
        raise
    except RecursionError:
        raise TraceFileError(
            f"torchlens.load: {doc_path} nests its records too deeply to be read; the file is "
            f"malformed."
        ) from None
    except (
        KeyError,
        TypeError,
        ValueError,
        AttributeError,
        IndexError,
        RuntimeError,
        OverflowError,
    ) as exc:
        raise TraceFileError(
            f"torchlens.load: {doc_path} is malformed ({type(exc).__name__}: {exc})."
        ) from None
    trace.saved_with = versions
    trace.model_info = doc.get("model")
    trace.load_notes = list(notes)
    return trace

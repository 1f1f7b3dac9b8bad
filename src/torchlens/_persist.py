"""Portable traces: [`Trace.save`][torchlens.Trace.save] and [`torchlens.load`][torchlens.load].

A saved trace is a directory holding two files:

- `trace.json`: the module tree, the module calls, the op records, the facet sites, dtypes and
  shapes, the `save=` selection, the model's class and config, and the versions that wrote it.
- `tensors.safetensors` (or the files `trace.json` names, all inside the directory): every
  tensor the trace holds, in the safetensors format.

Saving runs every pending facet check first ([`Trace.check`][torchlens.Trace.check]), so the file
holds each facet's final tensor and status and a loaded trace has no pending check.

Loading reads only JSON and safetensors, so a trace file cannot run code: no pickle is ever
opened, JSON names classes only from a fixed list of TorchLens record types, and tensor files
must lie inside the trace directory. A loaded trace has no model; `mechinterp.resolve_alias`,
`alias_report` and `compare` work on it as on the trace it was saved from.

What cannot be stored portably (a `save=` predicate, a model's KV cache object in the output,
complex tensors) is dropped with a warning on save and listed in `trace.load_notes` after load.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from torchlens._core.errors import TorchLensError
from torchlens._core.holdings import storage_ptr
from torchlens._core.persisted import PERSISTED
from torchlens._core.records import Ref
from torchlens._core.version import __version__

if TYPE_CHECKING:
    from torchlens._trace import Trace

__all__ = ["TraceFileError", "save", "load", "FORMAT", "FORMAT_VERSION"]

FORMAT = "torchlens-trace"
FORMAT_VERSION = 1
JSON_NAME = "trace.json"
TENSOR_NAME = "tensors.safetensors"


class TraceFileError(TorchLensError, ValueError):
    """A trace directory could not be written or read: not a trace, malformed, truncated, unsafe,
    or written in a format version this TorchLens does not read."""


def _record_classes() -> dict[str, type]:
    """The only classes a trace file may name: TorchLens's own record types (`PERSISTED`)."""
    return dict(PERSISTED)


def _versions() -> dict[str, str]:
    out = {"torchlens": __version__, "torch": torch.__version__, "python": platform.python_version()}
    try:
        import safetensors

        out["safetensors"] = safetensors.__version__
    except ImportError:
        pass
    if "transformers" in sys.modules:
        out["transformers"] = sys.modules["transformers"].__version__
    return out


# -- writing -----------------------------------------------------------------------------------


class _Encoder:
    def __init__(self, classes: dict[str, type]):
        self.classes = {c: n for n, c in classes.items()}
        self.objects: list[Any] = []  # encoded records, by object number
        self.memo: dict[int, int] = {}  # id(record) -> object number
        self.keep: list[Any] = []  # keeps memoized objects alive, so ids stay unique
        self.tensors: dict[str, torch.Tensor] = {}
        self.tensor_keys: dict[int, str] = {}
        self.storages: set[int] = set()
        self.dropped: list[str] = []

    def tensor(self, t: torch.Tensor, where: str) -> Any:
        key = self.tensor_keys.get(id(t))
        if key is not None:
            return {"tensor": key}
        if t.is_meta or t.is_complex() or t.layout != torch.strided:
            self.dropped.append(f"{where} (a {'meta' if t.is_meta else str(t.dtype)} tensor)")
            return {"dropped": f"tensor {t.dtype} {list(t.shape)}"}
        if storage_ptr(t) is None:  # a wrapper subclass: its data is in the tensors it wraps
            self.dropped.append(f"{where} (a {type(t).__name__}, a tensor subclass with no storage of its own)")
            return {"dropped": f"tensor {t.dtype} {list(t.shape)}"}
        key = f"t{len(self.tensors)}"
        c = t.detach().to("cpu").contiguous()
        if c.untyped_storage().data_ptr() in self.storages:
            c = c.clone()  # safetensors refuses tensors that share memory
        self.storages.add(c.untyped_storage().data_ptr())
        self.tensors[key] = c
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
            return {"slice": [self.enc(v.start, where), self.enc(v.stop, where), self.enc(v.step, where)]}
        if v is Ellipsis:
            return {"ellipsis": True}
        if isinstance(v, tuple) and hasattr(v, "_fields") and type(v).__name__ == "Ref":
            return {"ref": [v.op, v.slot]}
        name = self.classes.get(type(v))
        if name is not None:
            return {"obj": self.record(v, name, where)}
        if isinstance(v, tuple):
            return {"tuple": [self.enc(x, f"{where}[{i}]") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [self.enc(x, f"{where}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, (set, frozenset)):
            return {"set": sorted((self.enc(x, where) for x in v), key=repr)}
        if isinstance(v, Mapping) and type(v).__module__.split(".")[0] in ("builtins", "collections", "transformers"):
            items = list(v.items())
            if items and all(type(k) is int and k in self.memo for k, _ in items):  # keyed by id(record)
                return {"id_keys": [[self.memo[k], self.enc(x, f"{where}[...]")] for k, x in items]}
            out = {"items": [[self.enc(k, where), self.enc(x, f"{where}[{k!r}]")] for k, x in items]}
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
        for f, value in _fields(obj):
            if f == "predicate" and value is not None:
                self.dropped.append(f"{where}.predicate (a save= callable)")
                value = None
            fields[f] = self.enc(value, f"{where}.{f}")
        self.objects[n] = {"class": name, "fields": fields}
        return n


def _fields(obj: Any) -> list[tuple[str, Any]]:
    if hasattr(type(obj), "_PERSISTED"):  # a record that names what it stores (FacetSite, FacetMap)
        return obj._persist_fields()
    if dataclasses.is_dataclass(obj):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ())]
    if slots:
        return [(s, getattr(obj, s)) for s in slots if hasattr(obj, s)]
    return list(vars(obj).items())


def _model_info(model: Any) -> dict | None:
    if model is None:
        return None
    info: dict[str, Any] = {"class": f"{type(model).__module__}.{type(model).__qualname__}"}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        info["config"] = json.loads(json.dumps(config.to_dict(), default=str))
    return info


def save(trace: Any, path: str | os.PathLike, model: Any = None) -> list[str]:
    """Write `trace` to the directory `path` (created if missing; its trace files are replaced).

    Returns:
        What could not be stored portably (also issued as one warning), empty when nothing.
    """
    from safetensors.torch import save_file

    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise TraceFileError(f"Trace.save({path!r}): that path is a file; a trace is saved as a directory.")
    os.makedirs(path, exist_ok=True)
    # Every pending facet check runs first, so the file holds final tensors and statuses and a
    # loaded trace has nothing left to compute (it has no model to compute from).
    trace.check()
    enc = _Encoder(_record_classes())
    # Every module call first, so that dicts keyed by id(call) find their keys.
    for rec in trace.modules.values():
        for call in rec.calls:
            enc.record(call, "ModuleCall", f"modules[{call.address!r}].calls[{call.index}]")
    root = enc.record(trace, "Trace", "trace")
    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "versions": _versions(),
        "model_class": trace.model_class,
        "model": _model_info(model),
        "tensor_files": [TENSOR_NAME],
        "root": root,
        "objects": enc.objects,
        "notes": [f"dropped on save: {d}" for d in enc.dropped],
    }
    tmp = os.path.join(path, TENSOR_NAME + ".tmp")
    save_file(enc.tensors, tmp, metadata={"format": FORMAT})
    os.replace(tmp, os.path.join(path, TENSOR_NAME))
    text = json.dumps(doc, separators=(",", ":"), allow_nan=False)
    with open(os.path.join(path, JSON_NAME + ".tmp"), "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(os.path.join(path, JSON_NAME + ".tmp"), os.path.join(path, JSON_NAME))
    if enc.dropped:
        shown = "; ".join(enc.dropped[:3]) + (f"; and {len(enc.dropped) - 3} more" if len(enc.dropped) > 3 else "")
        warnings.warn(f"torchlens: Trace.save could not store {len(enc.dropped)} value(s) portably and left "
                      f"them out: {shown}. The loaded trace lists them in trace.load_notes.", stacklevel=3)
    return enc.dropped


# -- reading -----------------------------------------------------------------------------------


def _tensor_file(root: str, name: Any) -> str:
    """The path of a tensor file named in trace.json, refused unless it lies inside `root`."""
    if not isinstance(name, str) or not name or os.path.isabs(name) or os.sep in name or "/" in name \
            or name in (".", "..") or not name.endswith(".safetensors"):
        raise TraceFileError(
            f"torchlens.load: trace.json names the tensor file {name!r}; only a plain *.safetensors file "
            f"name inside the trace directory is accepted, so it was refused.")
    full = os.path.join(root, name)
    if os.path.dirname(os.path.realpath(full)) != os.path.realpath(root):
        raise TraceFileError(f"torchlens.load: the tensor file {name!r} links outside the trace directory "
                             f"{root!r}; refused.")
    if not os.path.isfile(full):
        raise TraceFileError(f"torchlens.load: the tensor file {name!r} named in trace.json is missing from {root!r}.")
    return full


class _Decoder:
    def __init__(self, objects: list, classes: dict[str, type], tensors: dict[str, torch.Tensor]):
        self.src = objects
        self.classes = classes
        self.tensors = tensors
        self.built: list[Any] = [None] * len(objects)
        self.notes: list[str] = []

    def obj(self, n: Any) -> Any:
        if not isinstance(n, int) or not 0 <= n < len(self.src):
            raise TraceFileError(f"torchlens.load: trace.json refers to record {n!r}, which it does not hold.")
        if self.built[n] is None:
            spec = self.src[n]
            if not isinstance(spec, dict) or spec.get("class") not in self.classes:
                got = spec.get("class") if isinstance(spec, dict) else spec
                raise TraceFileError(
                    f"torchlens.load: trace.json names the class {got!r}; a trace file may only name "
                    f"TorchLens records ({', '.join(sorted(self.classes))}).")
            cls = self.classes[spec["class"]]
            self.built[n] = object.__new__(cls)
            inst = self.built[n]
            renames = getattr(cls, "_persist_renames", {})
            known = getattr(cls, "_PERSISTED", None)  # a record that names what it stores accepts only that
            for f, value in spec["fields"].items():
                if not isinstance(f, str) or f.startswith("__") or (known is not None and f not in known):
                    raise TraceFileError(f"torchlens.load: record {n} has the field name {f!r}; refused.")
                object.__setattr__(inst, renames.get(f, f), self.dec(value))
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
            if key not in self.tensors:
                raise TraceFileError(f"torchlens.load: trace.json refers to tensor {key!r}, which the tensor "
                                     f"files do not hold (truncated or mismatched files?).")
            return self.tensors[key]
        if "obj" in v:
            return self.obj(v["obj"])
        if "ref" in v:
            return Ref(*v["ref"])
        if "tuple" in v:
            return tuple(self.dec(x) for x in v["tuple"])
        if "items" in v:
            return {self._key(k): self.dec(x) for k, x in v["items"]}
        if "id_keys" in v:
            return {id(self.obj(k)): self.dec(x) for k, x in v["id_keys"]}
        if "set" in v:
            return frozenset(self._key(x) for x in v["set"])
        if "dtype" in v:
            dt = getattr(torch, str(v["dtype"]), None)
            if not isinstance(dt, torch.dtype):
                raise TraceFileError(f"torchlens.load: unknown dtype {v['dtype']!r} in trace.json.")
            return dt
        if "size" in v:
            return torch.Size(int(x) for x in v["size"])
        if "device_obj" in v:
            return torch.device(str(v["device_obj"]))
        if "float" in v:
            return float(v["float"]) if v["float"] in ("nan", "inf", "-inf") else self._bad(v)
        if "slice" in v:
            return slice(*(self.dec(x) for x in v["slice"]))
        if "ellipsis" in v:
            return Ellipsis
        if "dropped" in v:
            return None
        return self._bad(v)

    def _key(self, k: Any) -> Any:
        k = self.dec(k)
        return tuple(k) if isinstance(k, list) else k

    @staticmethod
    def _bad(v: Any):
        raise TraceFileError(f"torchlens.load: unexpected value {str(v)[:80]!r} in trace.json.")


def load(path: str | os.PathLike) -> Trace:
    """Read a trace written by [`Trace.save`][torchlens.Trace.save].

    Only JSON and safetensors are read; nothing is unpickled, so loading a trace cannot run
    code. The loaded [`Trace`][torchlens.Trace] holds CPU tensors and no model; `mechinterp`'s
    `resolve_alias`, `alias_report` and `compare` work on it.

    Args:
        path: the directory `Trace.save` wrote.

    Returns:
        The trace. `trace.saved_with` holds the versions that wrote it, `trace.model_info` the
        model's class and config (when `save` was given the model), and `trace.load_notes` what
        could not be stored.

    Raises:
        TraceFileError: `path` is not a trace directory; a file is malformed, truncated, or names
            something outside the directory or outside TorchLens's record types; or the file
            format version is not the one this TorchLens reads (the message lists the versions
            that differ).

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
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = os.fspath(path)
    doc_path = os.path.join(root, JSON_NAME)
    if not os.path.isdir(root) or not os.path.isfile(doc_path):
        what = "a file" if os.path.isfile(root) else "missing" if not os.path.exists(root) else "a directory without trace.json"
        raise TraceFileError(f"torchlens.load({root!r}): that path is {what}; a saved trace is a directory "
                             f"holding {JSON_NAME} and {TENSOR_NAME}, as written by Trace.save.")
    try:
        with open(doc_path, encoding="utf-8") as f:
            doc = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFileError(f"torchlens.load: {doc_path} is not valid JSON ({exc}); the file is malformed "
                             f"or truncated.") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TraceFileError(f"torchlens.load: {doc_path} is not a TorchLens trace (no \"format\": {FORMAT!r}).")
    if doc.get("format_version") != FORMAT_VERSION:
        theirs = doc.get("versions") if isinstance(doc.get("versions"), dict) else {}
        ours = _versions()
        diffs = [f"{k} {theirs.get(k)} there, {ours.get(k)} here" for k in sorted(set(theirs) | set(ours))
                 if theirs.get(k) != ours.get(k)]
        raise TraceFileError(
            f"torchlens.load: {root!r} is trace format version {doc.get('format_version')!r}; this TorchLens "
            f"reads version {FORMAT_VERSION}. Versions that differ: {'; '.join(diffs) or 'none recorded'}. "
            f"Load it with the TorchLens that wrote it, or save it again with this one.")
    try:
        files = doc["tensor_files"]
        if not isinstance(files, list):
            raise TraceFileError("torchlens.load: trace.json's tensor_files is not a list.")
        tensors: dict[str, torch.Tensor] = {}
        for name in files:
            full = _tensor_file(root, name)
            try:
                tensors.update(load_file(full))
            except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                raise TraceFileError(f"torchlens.load: {full} is not a readable safetensors file ({exc}); it is "
                                     f"malformed or truncated. Only safetensors is read, never pickle.") from None
        dec = _Decoder(doc["objects"], _record_classes(), tensors)
        trace = dec.obj(doc["root"])
        if type(trace).__name__ != "Trace":
            raise TraceFileError("torchlens.load: trace.json's root record is not a Trace.")
    except TraceFileError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise TraceFileError(f"torchlens.load: {doc_path} is malformed ({type(exc).__name__}: {exc}).") from None
    trace.saved_with = doc.get("versions", {})
    trace.model_info = doc.get("model")
    trace.load_notes = list(doc.get("notes", []))
    return trace

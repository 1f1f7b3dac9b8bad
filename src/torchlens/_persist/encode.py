"""Encoding a trace's records as trace.json's objects: each record once, by number, with only the
fields it stores; tensors set aside for the tensor file; what cannot be stored portably noted."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from torchlens._core.holdings import storage_ptr
from torchlens._persist.schema import FIELDS, SET_BY_LOAD
from torchlens._persist.tensor_files import ST_DTYPES


class Encoder:
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
        if t.is_meta or t.layout != torch.strided or t.dtype not in ST_DTYPES:
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
            set(FIELDS[name])
            | set(SET_BY_LOAD.get(name, ()))
            | set(getattr(type(obj), "_persist_renames", {}).values())
        )
        for attr in vars(obj) if hasattr(obj, "__dict__") else ():
            if not attr.startswith("_") and attr not in stored:
                self.dropped.append(f"{where}.{attr} (not a field a {name} stores)")
        self.objects[n] = {"class": name, "fields": fields}
        return n


def _fields(obj: Any, name: str) -> list[tuple[str, Any]]:
    """The (field, value) pairs a record stores: the fields `FIELDS` lists for its class."""
    if hasattr(
        type(obj), "_persist_fields"
    ):  # a record that says how it stores them (FacetSite, FacetMap)
        return obj._persist_fields()
    return [(f, getattr(obj, f)) for f in FIELDS[name]]

"""Decoding trace.json's objects back into records, each field checked against the schema, and the
checks of the rebuilt trace: every held tensor has its record's shape and dtype, every op index
names an op."""

from __future__ import annotations

from typing import Any

import torch

from torchlens._core.records import Ref
from torchlens._persist.format import TraceFileError
from torchlens._persist.schema import FIELDS, is_shape


class Decoder:
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
                or spec["class"] not in FIELDS
            ):
                got = spec.get("class") if isinstance(spec, dict) else spec
                raise TraceFileError(
                    f"torchlens.load: trace.json names the class {str(got)[:80]!r}; a trace file may only name "
                    f"TorchLens records ({', '.join(sorted(self.classes))})."
                )
            name = spec["class"]
            fields = spec.get("fields")
            kinds = FIELDS[name]
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
            # a slotted record with private fields (`OpRecord`, `FacetSite`) makes its blank
            # instance itself: those fields are not stored
            inst: Any = cls._blank() if hasattr(cls, "_blank") else object.__new__(cls)
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
            return torch.Size(size) if size is not None and is_shape(size) else self._bad(v)
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


def check_held(trace: Any, keys: dict[int, str]) -> None:
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
                    t = site._value
                    if t is not None:
                        held(t, site.shape, site.dtype, f"{what} {name!r} of {whose}")

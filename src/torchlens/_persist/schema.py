"""The schema of a trace file's records: the only classes it may name, the fields each one
stores and the type each field must have when it is loaded."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from torchlens._core.persisted import PERSISTED

_LIMIT = 1 << 63  # a tensor's element count (and each size) is an int64 in torch


def record_classes() -> dict[str, type]:
    """The only classes a trace file may name: TorchLens's own record types (`PERSISTED`)."""
    return dict(PERSISTED)


class _Kind:
    """The type a stored field must have on load: `ok(value)` tells, `words` says it."""

    __slots__ = ("words", "ok")

    def __init__(self, words: str, ok: Callable[[Any], bool]):
        self.words = words
        self.ok = ok


def is_shape(v: Any) -> bool:
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
) -> _Kind:  # the decoder builds records only of the classes `record_classes` names
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
_SHAPE = _Kind("a shape (ints >= 0 whose product is below 2**63)", is_shape)
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
FIELDS: dict[str, dict[str, _Kind]] = {
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
SET_BY_LOAD = {"Trace": ("saved_with", "model_info", "load_notes")}

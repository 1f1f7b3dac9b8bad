"""The records a trace is made of: ops (`OpRecord`, `Ref`) and module calls (`ModuleCall`,
`ModuleRecord`, `ModuleMap`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from torchlens._core.errors import AmbiguousModuleCall, ModuleNotFoundInTrace, NoGradients
from torchlens._core.persisted import persisted
from torchlens._core.sites import FacetMap

__all__ = ["Dropped", "ModuleCall", "ModuleMap", "ModuleRecord", "OpRecord", "Ref", "group_calls"]

#: Held while a deferred `ModuleMap` makes its records.
_GROUP_LOCK = threading.Lock()


class Ref(NamedTuple):
    """Where a tensor came from: output `slot` of op number `op`."""

    op: int
    slot: int = 0


class Dropped(NamedTuple):
    """In place of a module input/output alias the end-of-trace version check dropped: the
    facets read from it are refused with `reason`, not reported as unsaved."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    reason: str


@persisted
class OpRecord:
    """One executed torch operation.

    Attributes:
        index (int): position in execution order (0-based).
        name (str): the torch function's name, e.g. `"linear"`, `"__add__"`, `"softmax"`; or
            `"written_in_place"` for the entry TorchLens adds where a tensor is used after an
            in-place write no recorded op returned (`x[i] = v`, a write through a view, a hook
            editing a module's output): its output is the tensor as it was used, its input the
            op that produced it before the write. `"accelerate_hook"` is the entry for a tensor an
            accelerate hook (`module._hf_hook`, e.g. a `ModelHook` that ablates) returned in place
            of one with other values; its input is the tensor it replaced.
        module (str): address of the innermost module that was running (`""` for the root).
        call (int): which call of that module (0 for the first).
        inputs (tuple[Ref | str | None, ...]): for each tensor argument, in order, a
            [`Ref`][torchlens.Ref] to the op that produced it, the parameter's qualified
            name (a `str`), or None for any other tensor from outside the forward: a model
            input, a buffer (BatchNorm's running statistics, a rotary table), a tensor the model
            keeps as a plain attribute or in a cache from an earlier call.
        shapes (tuple[torch.Size, ...]): the shape of each tensor output.
        dtypes (tuple[torch.dtype, ...]): the dtype of each tensor output.
        device (torch.device): the device of the first output.
        tensors (tuple[torch.Tensor | None, ...]): one entry per tensor output when saved, else
            None: the output detached, as the op returned it; a later in-place write during the
            forward clones it first, and a tensor still sharing memory with something the caller
            holds (inputs, weights, the output) is copied when `trace` returns.
            With autograd on, an output whose memory the autograd graph shares is not copied
            when `trace` returns but guarded: on its first read it is copied if it still holds
            what the op returned, and is None (with a warning) if it was written since (through
            the graph's saved tensor, `grad_fn._saved_self`).
        mutated (bool): True when the op changed one of its inputs in place.
    """

    __slots__ = (
        "index",
        "name",
        "module",
        "call",
        "inputs",
        "shapes",
        "dtypes",
        "device",
        "_tensors",
        "mutated",
        "extra",
        "_guard",
        "__weakref__",  # a `_capture.snapshot.Guarded` group refers back to its ops weakly
    )

    def __init__(
        self,
        index,
        name,
        module,
        call,
        inputs,
        shapes,
        dtypes,
        device,
        tensors,
        mutated=False,
        extra=None,
    ):
        self.index = index
        self.name = name
        self.module = module
        self.call = call
        self.inputs = inputs
        self.shapes = shapes
        self.dtypes = dtypes
        self.device = device
        self._tensors = tensors
        self.mutated = mutated
        self.extra = extra
        #: the `_capture.snapshot.Guarded` groups of outputs on memory only the autograd graph
        #: shares (copied on the first read), or None
        self._guard = None

    @classmethod
    def _blank(cls) -> OpRecord:
        """A record with no field set but the guard (none): what `torchlens.load` fills in with
        the stored fields."""
        op = object.__new__(cls)
        op._guard = None
        return op

    @property
    def tensors(self) -> tuple:
        """One entry per tensor output: the saved output, or None (see the class docstring)."""
        guard = self._guard
        if guard is not None:
            for group in guard:  # copied if unwritten, else dropped with a warning
                group.resolve()
            self._guard = None
        return self._tensors

    @tensors.setter
    def tensors(self, value: tuple) -> None:
        self._tensors = value

    #: The fields a saved trace stores (`tensors` through its property: a guarded one resolved).
    _PERSISTED = (
        "index",
        "name",
        "module",
        "call",
        "inputs",
        "shapes",
        "dtypes",
        "device",
        "tensors",
        "mutated",
        "extra",
    )

    def _persist_fields(self) -> list[tuple[str, Any]]:
        return [(f, getattr(self, f)) for f in self._PERSISTED]

    def __getstate__(self) -> dict[str, Any]:
        """For pickling and copying: the guarded outputs resolved, the guard itself not kept (a
        copy shares no memory with the autograd graph)."""
        state = {k: getattr(self, k) for k in self._PERSISTED}
        state["_tensors"] = state.pop("tensors")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._guard = None
        for k, v in state.items():
            setattr(self, k, v)

    @property
    def shape(self) -> torch.Size:
        """Shape of the first output."""
        return self.shapes[0]

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the first output."""
        return self.dtypes[0]

    @property
    def tensor(self) -> torch.Tensor | None:
        """The first output, when this trace saved it."""
        return self.tensors[0]

    def __repr__(self) -> str:
        where = self.module or "<root>"
        shape = "x".join(map(str, self.shape)) or "scalar"
        return f"OpRecord(#{self.index} {self.name} in {where}[{self.call}] -> {shape} {str(self.dtype).replace('torch.', '')})"


@persisted
@dataclass
class ModuleCall:
    """One call of one module during the forward pass.

    Attributes:
        address: the module's address, e.g. `"transformer.h.1"` (`""` for the root).
        index: 0 for the module's first call, 1 for the second, ...
        role: the module's role (`"block"`, `"attention"`, `"mlp"`, `"norm"`, `"embedding"`,
            `"unembed"`, `"root"` or `"other"`).
        class_name: the module's class, e.g. `"GPT2Block"`.
        first_op: index of this call's first op: the call's ops are
            `trace.ops[first_op:end_op]` (children's ops included).
        end_op: index one past this call's last op.
        facets: this call's [`FacetMap`][torchlens.FacetMap].
        input_ref: where the call's input came from: a [`Ref`][torchlens.Ref] to the op that
            produced it, a parameter's name (a `str`), or None for a tensor from outside the
            forward (a model input) or a call without a tensor input.
        output_ref: the same for the call's output (its first tensor, depth first).
        grads: the gradients of this call's facets (a `GradMap`), for a trace taken with
            `grads=`; None otherwise.
    """

    address: str
    index: int
    role: str
    class_name: str
    first_op: int
    end_op: int = -1
    facets: FacetMap | None = None
    parent: ModuleCall | None = field(default=None, repr=False)
    retained: bool = field(default=False, repr=False)
    input_ref: Ref | str | None = field(default=None, repr=False)
    output_ref: Ref | str | None = field(default=None, repr=False)
    # Aliases of the input and output tensors, kept during capture where the producing op's
    # output is not; dropped when the trace is finished.
    _in: Any = field(default=None, repr=False)
    _out: Any = field(default=None, repr=False)
    grads: FacetMap | None = field(default=None, repr=False)


@persisted
@dataclass
class ModuleRecord:
    """Everything the trace holds about one module address.

    Attributes:
        address: the module's address.
        class_name: the module's class, e.g. `"GPT2Block"`.
        role: see [`ModuleCall`][torchlens.ModuleCall].
        calls: one [`ModuleCall`][torchlens.ModuleCall] per time the module ran; empty if
            it never ran in this forward.
        aliases: other addresses the same module object is registered under (shared modules).
    """

    address: str
    class_name: str
    role: str
    calls: list[ModuleCall] = field(default_factory=list)
    aliases: tuple[str, ...] = ()

    @property
    def facets(self) -> FacetMap:
        """The facets of the module's only call.

        A module that never ran in this forward gets an empty map (`ran` is False), and asking it
        for a facet raises `FacetNotFound` saying so.

        Raises:
            AmbiguousModuleCall: the module ran several times; read `calls[i].facets`.
        """
        if len(self.calls) == 1:
            return self.calls[0].facets  # type: ignore[return-value]
        if not self.calls:
            return FacetMap(self.address, self.role, {}, ran=False)
        raise AmbiguousModuleCall(self.address, len(self.calls))

    @property
    def grads(self) -> FacetMap:
        """The gradients of the facets of the module's only call (a `GradMap`: same keys and
        call rules as `facets`), for a trace taken with `grads=`.

        Raises:
            AmbiguousModuleCall: the module ran several times; read `calls[i].grads`.
            NoGradients: the trace was taken without `grads=`.
        """
        if len(self.calls) == 1:
            g = self.calls[0].grads
            if g is None:
                raise NoGradients(f"trace.modules[{self.address!r}].grads")
            return g
        if not self.calls:
            return FacetMap(self.address, self.role, {}, ran=False)
        raise AmbiguousModuleCall(self.address, len(self.calls), "grads")

    def __repr__(self) -> str:
        return f"ModuleRecord({self.address!r}, {self.class_name}, role={self.role}, calls={len(self.calls)})"


@persisted
class ModuleMap(Mapping):
    """Module records by address. A missed lookup raises with close matches."""

    #: The fields a saved trace stores (`_records` makes a deferred map's records first).
    _PERSISTED: tuple[str, ...] = ("_records", "_aliases")
    #: The records by address once made; None while a `_deferred` map has not been read.
    _made: dict[str, ModuleRecord] | None = None
    #: What a `_deferred` map makes its records from until then: `(layout, calls)`.
    _source: tuple[tuple[tuple[str, str, str], ...], list[ModuleCall]] | None = None

    def __init__(self, records: dict[str, ModuleRecord], aliases: dict[str, str]):
        self._made = records
        self._aliases = aliases

    @classmethod
    def _deferred(
        cls,
        layout: tuple[tuple[str, str, str], ...],
        aliases: dict[str, str],
        calls: list[ModuleCall],
    ) -> ModuleMap:
        """A map whose records are made on its first read (`group_calls`): a trace that nobody
        reads (most steps of a generation) keeps its calls, not one `ModuleRecord` and one list of
        calls per module besides, objects the garbage collector would scan while the trace lives.
        It holds no module of the model (the trace does not keep the model alive).

        Args:
            layout: `(address, class name, role)` of every module, canonical addresses only, in
                the order the records list them (tuples of strings, which the collector stops
                scanning once it has seen them).
            aliases: other addresses of shared modules -> canonical address.
            calls: every call of the forward; each has its `FacetMap` already.
        """
        m = cls.__new__(cls)
        m._aliases = aliases
        m._source = (layout, calls)
        return m

    @property
    def _records(self) -> dict[str, ModuleRecord]:
        made = self._made
        if made is None:
            with _GROUP_LOCK:  # two threads reading at once get the same records
                made = self._made
                if made is None:
                    assert self._source is not None  # a map has records or what they are made from
                    layout, calls = self._source
                    made = self._made = group_calls(layout, self._aliases, calls)
                    self._source = None
        return made

    @_records.setter
    def _records(self, value: dict[str, ModuleRecord]) -> None:  # `torchlens.load` sets them
        self._made, self._source = value, None

    def _every_call(self) -> list[ModuleCall]:
        """Every module call of the trace, without making the records of a map not read yet (in
        the order the calls started there; by address, as the records list them, otherwise)."""
        if self._made is None and self._source is not None:
            return list(self._source[1])
        return [c for rec in self._records.values() for c in rec.calls]

    def __getstate__(self) -> dict[str, Any]:
        """For pickling and copying: the records, made first (a copy holds them, not what an
        unread map would make them from)."""
        return {"_made": self._records, "_aliases": self._aliases}

    def __getitem__(self, address: str) -> ModuleRecord:
        if not isinstance(address, str):
            raise ModuleNotFoundInTrace(address, self._records)  # it says addresses are strings
        rec = self._records.get(address)
        if rec is None and address in self._aliases:
            rec = self._records[self._aliases[address]]
        if rec is None:
            if address in ("self", "<root>", "root"):
                return self._records[""]
            raise ModuleNotFoundInTrace(address, self._records)
        return rec

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, address: object) -> bool:
        return address in self._records or address in self._aliases

    def __repr__(self) -> str:
        return f"ModuleMap({len(self)} modules)"


def group_calls(
    layout: tuple[tuple[str, str, str], ...], aliases: dict[str, str], calls: list[ModuleCall]
) -> dict[str, ModuleRecord]:
    """One `ModuleRecord` per canonical address, in the order of `layout`, holding its calls (in
    the order they started): what `ModuleMap` lists.

    Args:
        layout: `(address, class name, role)` of every module (`ModuleMap._deferred`).
        aliases: other addresses of shared modules -> canonical address.
        calls: every call of the forward.
    """
    alias_of: dict[str, list[str]] = {}
    for a, canonical in aliases.items():
        alias_of.setdefault(canonical, []).append(a)
    records = {
        addr: ModuleRecord(addr, cls, role, [], tuple(alias_of.get(addr, ())))
        for addr, cls, role in layout
    }
    for call in calls:
        records[call.address].calls.append(call)
    return records

"""The records a trace is made of: ops, module calls, facets, and the `Trace` itself."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ._errors import AmbiguousModuleCall, FacetNotFound, FacetNotSaved, LookupFailed, ModuleNotFoundInTrace

__all__ = ["Ref", "OpRecord", "FacetSite", "FacetMap", "ModuleCall", "ModuleRecord", "ModuleMap", "Trace"]


class Ref(NamedTuple):
    """Where a tensor came from: output `slot` of op number `op`."""

    op: int
    slot: int = 0


class OpRecord:
    """One executed torch operation.

    Attributes:
        index (int): position in execution order (0-based).
        name (str): the torch function's name, e.g. `"linear"`, `"__add__"`, `"softmax"`; or
            `"written_in_place"` for the entry TorchLens adds where a tensor is used after an
            in-place write no recorded op returned (`x[i] = v`, a write through a view, a hook
            editing a module's output): its output is the tensor as it was used, its input the
            op that produced it before the write.
        module (str): address of the innermost module that was running (`""` for the root).
        call (int): which call of that module (0 for the first).
        inputs (tuple[Ref | str | None, ...]): for each tensor argument, in order, a
            [`Ref`][torchlens.Ref] to the op that produced it, the parameter's qualified
            name (a `str`), or None for a tensor from outside the forward (a model input).
        shapes (tuple[torch.Size, ...]): the shape of each tensor output.
        dtypes (tuple[torch.dtype, ...]): the dtype of each tensor output.
        device (torch.device): the device of the first output.
        tensors (tuple[torch.Tensor | None, ...]): one entry per tensor output when saved, else
            None: the output detached, as the op returned it; a later in-place write during the
            forward clones it first, and a tensor still sharing memory with something the caller
            holds (inputs, weights, the output) is copied when `trace` returns.
        mutated (bool): True when the op changed one of its inputs in place.
    """

    __slots__ = ("index", "name", "module", "call", "inputs", "shapes", "dtypes", "device", "tensors", "mutated", "extra")

    def __init__(self, index, name, module, call, inputs, shapes, dtypes, device, tensors, mutated=False, extra=None):
        self.index = index
        self.name = name
        self.module = module
        self.call = call
        self.inputs = inputs
        self.shapes = shapes
        self.dtypes = dtypes
        self.device = device
        self.tensors = tensors
        self.mutated = mutated
        self.extra = extra

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


@dataclass
class FacetSite:
    """What TorchLens knows about one facet of one module call.

    Attributes:
        name: the facet name (`"resid_post"`, `"pattern"`, ...).
        kind: `"real"` (the output of an op the model ran), `"computed"` (derived from recorded
            tensors and the module's weights, read-only), or `"reconstructed"` (rebuilt from a
            fused kernel's recorded inputs and checked against the kernel output, read-only).
            The kind is how TorchLens got the tensor; a name that resolves here (see
            `torchlens.mechinterp`) gets the status `real` for a real facet and
            `reconstructed_read_only` for a computed or reconstructed one.
        shape: the tensor's shape, known even when it was not saved.
        dtype: the tensor's dtype, known even when it was not saved.
        tensor: the tensor, or None when this trace's `save=` did not keep it.
        op: index of the op whose output this is, for real facets.
        check_error: for a checked facet, the largest absolute difference in its check against a
            relation the model fixes (the rebuilt vs the recorded kernel output; normalized *
            gain + bias vs the norm output; the sum over heads of result + bias vs the output
            projection; pattern @ v vs z; the residual sums around resid_mid). A facet whose
            check fails is not served: it is listed in `FacetMap.refused` with the reason.
        note: how the facet was found or computed, in one line.
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    tensor: torch.Tensor | None = None
    op: int | None = None
    check_error: float | None = None
    note: str = ""

    @property
    def saved(self) -> bool:
        """Whether the tensor is held by the trace."""
        return self.tensor is not None

    @property
    def read_only(self) -> bool:
        """True for computed and reconstructed facets: no op in the model produced this tensor."""
        return self.kind != "real"

    def __repr__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        how = self.kind
        if self.op is not None:
            how += f", op #{self.op}"
        if self.check_error is not None:
            how += f", check error {self.check_error:.2g}"
        return f"FacetSite({self.name}: {list(self.shape)} {dtype}, {how}, {'saved' if self.saved else 'not saved'})"


def _forward_order(names) -> list[str]:
    """Facet names in forward order: `input`, then the order `FACETS` lists them in (the order
    a forward computes them: `resid_pre`, `resid_mid`, `resid_post`; `q`, `k`, `v`, ...), then
    names `FACETS` does not list, then `output`."""
    from ._facet_spec import FACETS

    rank: dict[str, int] = {}
    for facets in FACETS.values():
        for name in facets:
            rank.setdefault(name, len(rank))
    last = len(rank)
    rank.update(input=-1, output=last + 1)
    return sorted(names, key=lambda name: rank.get(name, last))


class FacetMap(Mapping):
    """The facets of one module call: a read-only mapping from facet name to tensor.

    Iteration, `len` and `in` cover the facets whose tensor this trace saved. `sites` lists every
    facet the module has, saved or not, with its kind and shape. Asking for a facet that exists
    but was not saved raises [`FacetNotSaved`][torchlens.FacetNotSaved]; asking for one that
    does not exist raises [`FacetNotFound`][torchlens.FacetNotFound] with close matches.
    """

    def __init__(self, address: str, role: str, sites: dict[str, FacetSite], ran: bool = True):
        self.address = address
        self.role = role
        #: facet name -> why it is not served: its check against a relation the model fixes failed
        #: or could not run (sites of kind "refused" are kept here, not in `sites`).
        self.refused = {n: s.note for n, s in sites.items() if s.kind == "refused"}
        served = {n: s for n, s in sites.items() if s.kind != "refused"} if self.refused else sites
        self.sites = {n: served[n] for n in _forward_order(served)}
        self.ran = ran  # False for the empty map of a module that did not run in the forward

    def _not_found(self, name: Any) -> FacetNotFound:
        if not isinstance(name, str):
            return FacetNotFound(
                self.address, repr(name), self.sites, self.role,
                f"facets are looked up by name (a str), not by {type(name).__name__}; "
                f"its facets are: {', '.join(self.sites) or '(none)'}",
            )
        if name in self.refused:
            return FacetNotFound(self.address, name, self.sites, self.role, f"it is not served: {self.refused[name]}")
        reason = "" if self.ran else "it did not run in this forward pass, so it has no facets"
        return FacetNotFound(self.address, name, self.sites, self.role, reason)

    def __getitem__(self, name: str) -> torch.Tensor:
        site = self.sites.get(name) if isinstance(name, str) else None
        if site is None:
            raise self._not_found(name)
        if site.tensor is None:
            raise FacetNotSaved(self.address, name)
        return site.tensor

    def __iter__(self) -> Iterator[str]:
        return (n for n, s in self.sites.items() if s.tensor is not None)

    def __len__(self) -> int:
        return sum(s.tensor is not None for s in self.sites.values())

    def __contains__(self, name: object) -> bool:
        site = self.sites.get(name) if isinstance(name, str) else None
        return site is not None and site.tensor is not None

    def site(self, name: str) -> FacetSite:
        """The [`FacetSite`][torchlens.FacetSite] of `name`, saved or not."""
        site = self.sites.get(name) if isinstance(name, str) else None
        if site is None:
            raise self._not_found(name)
        return site

    def __repr__(self) -> str:
        items = []
        for n, s in self.sites.items():
            flag = "" if s.kind == "real" else f" {s.kind}"
            flag += "" if s.saved else " not saved"
            items.append(f"{n}{list(s.shape)}{flag}")
        return f"FacetMap({self.address!r}: {', '.join(items)})"


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
    input_ref: Any = field(default=None, repr=False)
    output_ref: Any = field(default=None, repr=False)
    # Aliases of the input and output tensors, kept during capture where the producing op's
    # output is not; dropped when the trace is finished.
    _in: Any = field(default=None, repr=False)
    _out: Any = field(default=None, repr=False)


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
        """The facets of the module's only call (raises if it ran zero or several times)."""
        if len(self.calls) == 1:
            return self.calls[0].facets  # type: ignore[return-value]
        if not self.calls:
            return FacetMap(self.address, self.role, {}, ran=False)
        raise AmbiguousModuleCall(self.address, len(self.calls))

    def __repr__(self) -> str:
        return f"ModuleRecord({self.address!r}, {self.class_name}, role={self.role}, calls={len(self.calls)})"


class ModuleMap(Mapping):
    """Module records by address. A missed lookup raises with close matches."""

    def __init__(self, records: dict[str, ModuleRecord], aliases: dict[str, str]):
        self._records = records
        self._aliases = aliases

    def __getitem__(self, address: str) -> ModuleRecord:
        if not isinstance(address, str):
            raise ModuleNotFoundInTrace(repr(address), self._records)
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


class Trace:
    """One captured forward pass.

    Attributes:
        ops: every executed torch operation, in order ([`OpRecord`][torchlens.OpRecord]).
        modules: module records by address ([`ModuleMap`][torchlens.ModuleMap]); `""` is the
            root.
        output: what the model returned.
        blocks: the block address of each layer of the language-model stack, in run order (a block
            run several times appears once per call); a layer index is a position in this list.
        model_class: the root module's class name.
        save_spec: the normalized `save=` selection the trace was taken with.
        structure: the model's stacks, layers and sublayers as TorchLens found them
            (`structure.stacks`, `structure.kind`; see `torchlens._structure`).
        edits: for a trace taken with `edit=`, one record per key: the site, the calls edited, how
            the edit was placed and how often it ran; empty otherwise (not kept by `save`/`load`).
    """

    def __init__(self, ops, modules, output, blocks, model_class, save, structure=None):
        self.ops: list[OpRecord] = ops
        self.modules: ModuleMap = modules
        self.output = output
        self.blocks: list[str] = blocks
        self.model_class: str = model_class
        self.save_spec = save
        self.structure = structure
        self.edits: tuple = ()

    def save(self, path: str | os.PathLike, model: Any = None) -> list[str]:
        """Write this trace to the directory `path`, for [`torchlens.load`][torchlens.load].

        Tensors go to a safetensors file, everything else (module tree, op records, facets,
        dtypes, versions) to `trace.json`; nothing is pickled.

        Args:
            path: a directory (created if missing; a trace already there is replaced).
            model: optionally the traced model, to record its class and (Hugging Face) config.

        Returns:
            What could not be stored portably (a `save=` predicate, a KV-cache object in the
            output); also issued as one warning. Empty when everything was stored.

        Raises:
            TraceFileError: `path` is an existing file.
        """
        from ._persist import save

        return save(self, path, model)

    def __getitem__(self, name: str) -> torch.Tensor:
        """The tensor at a site: `trace["address:facet"]`, or any name another library uses.

        `trace["transformer.h.1:resid_post"]` is `trace.modules["transformer.h.1"].facets["resid_post"]`
        (write the root as `"<root>:logits"`). A name without a colon is resolved with
        [`resolve_alias`][torchlens.mechinterp.resolve_alias] in every naming generation, so
        `trace["blocks.1.hook_resid_post"]` and `trace["layers_output[1]"]` read the same tensor.

        Raises:
            LookupFailed: the lookup's own error: no such module, facet or name
                (`ModuleNotFoundInTrace`, `FacetNotFound`, `UnknownAlias`, ...), a facet `save=`
                did not keep (`FacetNotSaved`), or a name with no site in this trace (`AliasError`).
        """
        if not isinstance(name, str):
            raise LookupFailed(
                f"trace[...] takes a name (a str): 'address:facet' or another library's hook name, "
                f"not {type(name).__name__} {name!r}; the ops are trace.ops[i]."
            )
        if ":" in name:
            address, facet = name.rsplit(":", 1)
            return self.modules[address.strip()].facets[facet.strip()]
        from .mechinterp._resolver import AliasError, resolve_alias

        r = resolve_alias(self, name)
        if r.module_address is None or r.facet is None or r.status in ("structurally_absent", "ambiguous"):
            remedy = f" {r.remedy[0].upper()}{r.remedy[1:]}." if r.remedy else ""
            raise AliasError(f"{name!r} has no site to read in this trace ({r.status}): {r.reason}{remedy}")
        return r.tensor  # the call the name's layer ran (a block run twice is two layers)

    def by_role(self, role: str) -> list[str]:
        """Addresses of the modules with `role` that ran, in the order they first ran."""
        recs = [r for r in self.modules.values() if r.role == role and r.calls]
        return [r.address for r in sorted(recs, key=lambda r: r.calls[0].first_op)]

    def __repr__(self) -> str:
        saved = sum(t is not None for op in self.ops for t in op.tensors)
        return (
            f"Trace({self.model_class}: {len(self.ops)} ops, {len(self.modules)} modules, "
            f"{len(self.blocks)} blocks, {saved} tensors saved)"
        )

    def summary(self, max_rows: int | None = None) -> str:
        """A plain-text table of the modules that ran: address, role, calls, facets with shapes."""
        rows = [("module", "role", "calls", "facets")]
        for rec in self.modules.values():
            if not rec.calls:
                continue
            fac = rec.calls[0].facets
            facets = ", ".join(
                f"{n}{list(s.shape)}" + ("" if s.saved else "*") for n, s in (fac.sites.items() if fac else [])
            )
            rows.append((rec.address or "<root>", rec.role, str(len(rec.calls)), facets))
        if max_rows is not None:
            rows = rows[: max_rows + 1]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
        lines.append("(* = exists but not saved)")
        return "\n".join(lines)

    def _repr_html_(self, max_rows: int = 60) -> str:
        """The modules that ran as an HTML table (what `summary()` prints), for notebooks.

        Facets are listed with their shapes; a facet this trace did not save is grey and starred,
        and a computed or reconstructed (read-only) facet is in italics. Past `max_rows` modules
        the table says how many it left out.
        """
        from ._html import code, esc, table

        ran = [rec for rec in self.modules.values() if rec.calls]
        rows = []
        for rec in ran[:max_rows]:
            facets = rec.calls[0].facets
            cells = []
            for name, site in (facets.sites.items() if facets else []):
                style = "white-space:nowrap;" + ("" if site.saved else "color:#8c959f;") + (
                    "font-style:italic;" if site.read_only else "")
                note = site.kind + ("" if site.saved else ", not saved") + (f": {site.note}" if site.note else "")
                cells.append(code(f"{name}{list(site.shape)}" + ("" if site.saved else "*"), style, note))
            depth = rec.address.count(".") + 1 if rec.address else 0
            address = code(rec.address or "<root>", f"margin-left:{depth * 0.8:.1f}em" if depth else "")
            rows.append([address, esc(rec.role), esc(len(rec.calls)), " ".join(cells)])
        notes = []
        if len(ran) > max_rows:
            notes.append(f"{len(ran) - max_rows} more modules ran; trace.summary() lists them all.")
        if any(not s.saved for rec in ran for c in rec.calls[:1] if c.facets for s in c.facets.sites.values()):
            notes.append("* exists but not saved.")
        notes.append("Italic: computed or reconstructed, read-only.")
        return table(["module", "role", "calls", "facets"], rows, caption=repr(self), note=" ".join(notes))

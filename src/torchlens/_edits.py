"""The `edit=` argument of `trace`: which sites to replace, and where in the forward that happens.

An edit is placed where the model computes the site, never on a copy afterwards:

- a module's `input` (and a block's `resid_pre`, an embedding's `indices`) is replaced by the
  module's forward pre-hook, which returns the edited arguments;
- a module's `output` (and a block's `resid_post`) is replaced by its forward hook, which
  returns the output with its first tensor replaced (tuple, list and dict structure kept);
- any other real facet (attention `q k v rot_q rot_k scores pattern z`, MLP `pre act post
  down_out`, `resid_mid`, a norm's written-out `normalized`, `logits`) is the output of one op;
  the torch function mode replaces that op's output as the op returns it.

Which op produces a facet is only known from the data flow of a forward, so an edited trace first
runs one locating pass with `save="none"` (metadata only): it resolves every key (any naming
generation's alias, `"address:facet"`, or an `(address, facet[, call])` tuple) to its module
calls, and op-level facets to the op's position in the forward. The edited forward then checks
that the op it replaces at that position has the same name and module call as in the locating
pass, so an edit is never placed on another op.

A site that no single op produces cannot be edited: a pattern rebuilt from a fused attention
kernel, a facet computed from recorded tensors (`result`, a fused norm's `normalized`), a
slice of a fused projection. Those raise [`NotEditable`][torchlens.NotEditable] with the
remedy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from torchlens._core.errors import EditSpecError, NotEditable, TorchLensError, cannot_take
from torchlens._core.facet_spec import HOOK_SIDES, REMEDIES
from torchlens._core.persisted import persisted
from torchlens._core.records import Ref
from torchlens._naming.resolver import GENERATIONS, resolve_alias

__all__ = ["EditPlan", "EditRecord", "check_inputs", "plan_edits", "resolve_key"]

#: Facets served by a module's hooks (facet -> 'in'/'out') and what to edit instead of a facet no
#: single op produces: both from the facet rows (`torchlens._core.facet_spec`).
_HOOK_FACETS, _REMEDIES = HOOK_SIDES, REMEDIES


@persisted
@dataclass
class EditRecord:
    """One edit of an edited trace, as `trace.edits` lists it.

    Attributes:
        key: the key as given in `edit=`.
        module_address: the module holding the site.
        facet: the facet replaced.
        calls: the module calls edited (all its calls unless the key named one).
        how: `"fn"` (the value was a callable) or `"tensor"` (replaced by the given tensor).
        where: how the edit was placed: `"pre-hook"`, `"forward hook"`, or `"op #N <name>"`.
        applied: how many times the edit ran in the edited forward (one per call).
    """

    key: str | tuple
    module_address: str
    facet: str
    calls: tuple[int, ...]
    how: str
    where: str
    applied: int = 0

    def __repr__(self) -> str:
        site = f"{self.module_address or '<root>'}:{self.facet}"
        return (
            f"EditRecord({self.key!r} -> {site} calls={list(self.calls)} by {self.how} at {self.where}, "
            f"applied {self.applied}x)"
        )


@dataclass
class _Edit:
    """One site of one module call to replace: its value and the layout maps of the facet."""

    record: EditRecord
    value: Any  # a callable or a tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    to_facet: Callable[[Tensor], Tensor] = lambda t: t
    from_facet: Callable[[Tensor], Tensor] = lambda t: t
    op_name: str = ""
    op_module: str = ""
    op_call: int = 0

    def apply(self, t: Tensor) -> Tensor:
        """The replacement of `t` (the tensor the model computed), in the model's layout."""
        site = f"{self.record.module_address or '<root>'}:{self.record.facet}"
        if callable(self.value):
            arg = self.to_facet(t).clone()
            try:
                new = self.value(arg)
            except BaseException as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(
                        f"torchlens: raised by the edit= function for {self.record.key!r} ({site})"
                    )
                raise
            if isinstance(new, Tensor) and new is not arg:
                new = (
                    new.clone()
                )  # it may be a tensor the caller holds: the model may write into it
            if not isinstance(new, Tensor):
                raise EditSpecError(
                    f"edit of {site}: the function returned {type(new).__name__}, not a tensor. Return the "
                    f"edited tensor (e.g. lambda x: x * 0); an edit made in place on its argument is not kept."
                )
            what = "the function's result"
        else:
            _check_given(site, self.value, self.shape, self.dtype)
            new = self.value.to(
                t.device, copy=True
            )  # the model may write into it; the caller's stays as it was
            what = "the tensor given"
        _check_given(site, new, self.shape, self.dtype, what)
        if new.device != t.device:
            raise EditSpecError(
                f"edit of {site}: {what} is on {new.device}, the site on {t.device}; return it on "
                f"the site's device (.to(x.device))."
            )
        self.record.applied += 1
        out = self.from_facet(new)
        return out.contiguous() if t.is_contiguous() else out


def _check_given(
    site_name: str,
    value: Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    what: str = "the tensor given",
) -> None:
    """Refuse an edit's tensor (given, or a function's result) on the meta device, or whose shape
    or dtype is not the site's: from the locating pass for a tensor given (before the edited
    forward runs), and as each edit is applied."""
    if value.is_meta:
        raise EditSpecError(
            f"edit of {site_name}: {what} is on the meta device, which holds no values; give a "
            f"tensor with the values to put there."
        )
    if tuple(value.shape) != tuple(shape):
        raise EditSpecError(
            f"edit of {site_name}: {what} has shape {list(value.shape)}, but the site is "
            f"{list(shape)} (TorchLens layout; see torchlens.FACETS). Give a tensor of that shape."
        )
    if value.dtype != dtype:
        raise EditSpecError(
            f"edit of {site_name}: {what} is {value.dtype}, the site is {dtype}; convert it "
            f"with .to({dtype})."
        )


@dataclass
class EditPlan:
    """Where each edit goes in the edited forward (built by `plan_edits` from a locating trace).

    Attributes:
        hook_in: (module address, call index) -> edits of that call's input.
        hook_out: (module address, call index) -> edits of that call's output.
        ops: op position in the forward -> the edit of that op's output.
        records: one `EditRecord` per key, for `trace.edits`.
    """

    hook_in: dict[tuple[str, int], list[_Edit]] = field(default_factory=dict)
    hook_out: dict[tuple[str, int], list[_Edit]] = field(default_factory=dict)
    ops: dict[int, _Edit] = field(default_factory=dict)
    records: list[EditRecord] = field(default_factory=list)

    def move_calls(self, calls: Callable[[str, int], int | None]) -> None:
        """Renumber the module calls this plan names, for a plan located on one forward and applied
        to part of another capture: call `i` of `address` becomes `calls(address, i)`, and the
        sites of a call it maps to None are dropped (with a record left without calls)."""

        def moved(table: dict[tuple[str, int], list[_Edit]]) -> dict[tuple[str, int], list[_Edit]]:
            out = {}
            for (address, i), edits in table.items():
                n = calls(address, i)
                if n is not None:
                    out[address, n] = edits
            return out

        self.hook_in, self.hook_out = moved(self.hook_in), moved(self.hook_out)
        ops = {}
        for position, edit in self.ops.items():
            n = calls(edit.op_module, edit.op_call)
            if n is not None:
                edit.op_call = n
                ops[position] = edit
        self.ops = ops
        for r in self.records:
            r.calls = tuple(n for i in r.calls if (n := calls(r.module_address, i)) is not None)
        self.records = [r for r in self.records if r.calls]

    def merge_hooks(self, part: EditPlan) -> None:
        """Add `part`'s hook edits and records to this plan (its op edits go in with `merge_ops`,
        once their shift is known)."""
        for mine, theirs in ((self.hook_in, part.hook_in), (self.hook_out, part.hook_out)):
            for where, edits in theirs.items():
                mine.setdefault(where, []).extend(edits)
        self.records.extend(part.records)

    def merge_ops(self, part: EditPlan, shift: int) -> None:
        """Add `part`'s op edits to this plan, each op position moved by `shift` (after
        `merge_hooks` of the same part)."""
        for position, edit in part.ops.items():
            if position + shift in self.ops:
                raise EditSpecError(
                    f"edit= keys {self.ops[position + shift].record.key!r} and {edit.record.key!r} replace the "
                    f"same op #{position + shift}; give one edit per op."
                )
            self.ops[position + shift] = edit

    def check_placed(self, trace: Any) -> None:
        """Raise unless every op this plan replaced is the op `trace` (the edited forward's own
        trace) finds the edited site at: the locating pass and the edited forward agree on where
        each edited site is."""
        edited = [i for i, op in enumerate(trace.ops) if op.name == "edited"]
        for r in self.records:
            planned = sorted(p for p, e in self.ops.items() if e.record is r)
            if not planned:
                continue
            found = []
            for c in r.calls:
                site = trace.modules[r.module_address].calls[c].facets.sites.get(r.facet)
                index = getattr(site, "op", None)
                found.append(
                    None
                    if index is None or getattr(site, "kind", None) != "real"
                    else index - sum(1 for i in edited if i < index)
                )
            if None in found or sorted(p for p in found if p is not None) != planned:
                raise EditSpecError(
                    f"the edit {r.key!r} of {r.module_address or '<root>'}:{r.facet} replaced the op(s) at "
                    f"position(s) {planned}, but the edited forward's trace finds that site at {found}: the "
                    f"locating pass and the edited forward disagree on where the site is (an earlier edit "
                    f"changed the forward's path), so the edit replaced another tensor and this forward is "
                    f"not served. Edit the later site in a trace of its own, or edit a site whose path "
                    f"does not depend on the earlier edit."
                )

    def check_applied(self) -> None:
        """Raise if a planned edit did not run in the edited forward (the forward took another path)."""
        for r in self.records:
            if r.applied != len(r.calls):
                raise EditSpecError(
                    f"the edit {r.key!r} of {r.module_address or '<root>'}:{r.facet} ran {r.applied} times in the "
                    f"edited forward, but the locating pass found {len(r.calls)} call(s) to edit: the forward took "
                    f"another path after an edit."
                )


def resolve_key(trace: Any, key: Any) -> tuple[str, str, int | None]:
    """(module address, facet, call or None) an `edit=` key names in `trace`.

    Raises:
        EditSpecError: the key names no single site (a bare module address, a structurally
            absent or ambiguous alias, a key of another type).
        LookupFailed: the lookup's own error for an unknown module or alias (close matches).
    """
    if isinstance(key, tuple):
        if not (
            2 <= len(key) <= 3
            and isinstance(key[0], str)
            and isinstance(key[1], str)
            and (len(key) == 2 or (isinstance(key[2], int) and not isinstance(key[2], bool)))
        ):
            raise EditSpecError(
                f"edit= key {key!r}: a tuple key is (module_address, facet) or (module_address, facet, call), "
                f"e.g. ('transformer.h.0', 'resid_post') or ('transformer.h.0', 'resid_post', 1)."
            )
        address = trace.modules[key[0]].address  # ModuleNotFoundInTrace with close matches
        return address, key[1], key[2] if len(key) == 3 else None
    if not isinstance(key, str):
        raise EditSpecError(
            f"edit= key {key!r} ({type(key).__name__}): a key is a hook name of any naming generation "
            f"('blocks.0.hook_resid_post'), 'address:facet' ('transformer.h.0:resid_post'), or a tuple "
            f"(module_address, facet[, call])."
        )
    if ":" in key:
        address, facet = (s.strip() for s in key.rsplit(":", 1))
        address = "" if address in ("<root>", "root", "self") else address
        return trace.modules[address].address, facet, None
    if key in trace.modules and key:  # a bare module address: say how to name one of its facets
        rec = trace.modules[key]
        facets = list(rec.calls[0].facets.sites) if rec.calls else []
        raise EditSpecError(
            f"edit= key {key!r} is a module address, not a site: name a facet of it, e.g. "
            f"({key!r}, 'output') or '{key}:output'. Its facets: {', '.join(facets) or '(it did not run)'}."
        )
    r = resolve_alias(trace, key)  # UnknownAlias etc. with close matches
    if (
        r.status in ("structurally_absent", "ambiguous")
        or r.module_address is None
        or r.facet is None
    ):
        remedy = f" {r.remedy}." if r.remedy else ""
        if r.status == "ambiguous":  # edit= takes no generation=: name the site itself
            sites = []
            for generation in GENERATIONS:
                try:
                    g = resolve_alias(trace, key, generation=generation)
                except TorchLensError:
                    continue
                if g.module_address is not None and g.facet is not None:
                    call = f", {g.call}" if g.call is not None else ""
                    sites.append(f"{generation}: ({g.module_address!r}, {g.facet!r}{call})")
            remedy = f" Name the site itself as the key: {'; '.join(sites)}." if sites else ""
        raise EditSpecError(
            f"edit= key {key!r} names no single site in this model ({r.status}): {r.reason}{remedy}"
        )
    return r.module_address, r.facet, r.call


def _is_hooks_tensor(call: Any, side: str, site: Any) -> bool:
    """Whether `site` of `call` is the tensor its forward pre-hook (`side` "in") or forward hook
    ("out") sees: an io facet's site is, except an embedding's `indices` where the index tensor is
    computed elsewhere than the hook sees (by the module from its input, BART's learned positions;
    by its parent and passed as another argument, Pegasus's)."""
    ref = call.input_ref if side == "in" else call.output_ref
    return site.op is None or (type(ref) is Ref and ref.op == site.op)


def _site_name(address: str, facet: str, call: int, n_calls: int) -> str:
    where = address or "<root>"
    return f"{where}:{facet}" + (f" (call {call})" if n_calls > 1 else "")


def _op_edit(trace: Any, address: str, facet: str, call: int, n_calls: int, site: Any) -> dict:
    """The op position and layout maps of a real, op-produced facet; NotEditable otherwise."""
    name = _site_name(address, facet, call, n_calls)
    if site.kind != "real" or site.op is None:
        why = (
            "it is rebuilt from a fused attention kernel's inputs (no op of the forward produced it)"
            if site.kind == "reconstructed"
            else "it is computed from recorded tensors after the forward "
            "(no op of the forward produced it)"
        )
        remedy = _REMEDIES.get(
            facet, "edit a real site it is computed from (the module's input or output)"
        )
        raise NotEditable(f"{name} cannot be edited: {why}. Remedy: {remedy}.")
    op = trace.ops[site.op]
    if (
        op.name in ("input", "written_in_place", "accelerate_hook")
        or op.mutated
        or len(op.shapes) != 1
    ):
        why = (
            "it enters the forward from outside"
            if op.name == "input"
            else "an accelerate hook returned it (the model ran no op there)"
            if op.name == "accelerate_hook"
            else "the op writes a tensor in place"
            if op.mutated or op.name == "written_in_place"
            else f"its op ({op.name}) returns several tensors"
        )
        raise NotEditable(
            f"{name} cannot be edited at its op #{op.index} ({op.name}): {why}. Remedy: edit the input or output "
            f"of the module that computes it, or the tensors you pass to the model."
        )
    op_shape, shape = tuple(op.shape), tuple(site.shape)
    if facet in ("rot_q", "rot_k"):  # the kernel input, head-major; the facet is token-major
        if (
            len(op_shape) != 4
            or op_shape[1] != shape[2]
            or (op_shape[0], op_shape[2], op_shape[1], op_shape[3]) != shape
        ):
            raise NotEditable(
                f"{name} cannot be edited: the kernel input it is read from has {op_shape[1] if len(op_shape) == 4 else '?'} "
                f"heads (keys repeated per query head), so one key head is several tensors of the forward. "
                f"Remedy: edit {'k' if facet == 'rot_k' else 'q'} (before RoPE), or trace with a model where the "
                f'kernel receives the kv heads once (attn_implementation="sdpa").'
            )
        return dict(to_facet=lambda t: t.transpose(1, 2), from_facet=lambda t: t.transpose(1, 2))
    if op_shape == shape:
        return {}
    if _numel(op_shape) == _numel(shape):  # the facet is the op output viewed per head
        return dict(to_facet=lambda t: t.reshape(shape), from_facet=lambda t: t.reshape(op_shape))
    raise NotEditable(
        f"{name} cannot be edited: it is a slice of op #{op.index} ({op.name}, shape {list(op_shape)}), a fused "
        f"projection that computes several facets at once. Remedy: edit that projection's output (the output of "
        f"the module that computes it) with a function that changes only those columns."
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_edits(trace: Any, edit: Any) -> EditPlan:
    """Resolve every key of `edit=` against a locating trace and say where each edit goes.

    Args:
        trace: a trace of the same forward (taken with `save="none"`: only its structure,
            facet sites and op metadata are read).
        edit: the `edit=` argument: a mapping from key to a callable `fn(value) -> tensor` or a
            tensor.

    Returns:
        The `EditPlan`.

    Raises:
        EditSpecError: `edit` is not a mapping, a key names no site, a value is neither callable
            nor a tensor, or two keys name one site.
        NotEditable: a key names a site no single op of the forward produces.
        LookupFailed: the lookup's own error for an unknown module, facet or alias (close matches).
    """
    if not isinstance(edit, Mapping):
        raise EditSpecError(
            f"edit= takes a dict from site to a function or tensor, e.g. "
            f"edit={{'blocks.0.hook_resid_post': lambda x: x * 0}}, not {type(edit).__name__}."
        )
    if not edit:
        raise EditSpecError("edit= is an empty dict: name at least one site, or leave edit= out.")
    plan = EditPlan()
    seen: dict[tuple[str, int, str], Any] = {}
    #: (side, address, call) -> the key whose hook edit replaces that module input or output
    hooked: dict[tuple[str, str, int], Any] = {}
    for key, value in edit.items():
        if not (callable(value) or isinstance(value, Tensor)):
            raise EditSpecError(
                f"edit= value for {key!r} is {type(value).__name__}: give a function fn(value) -> tensor "
                f"(e.g. lambda x: x * 0) or a tensor of the site's shape."
            )
        why = None if isinstance(value, Tensor) else cannot_take(value, torch.empty(0))
        if why:
            raise EditSpecError(
                f"edit= function for {key!r} is called with one argument, the site's tensor "
                f"(fn(value) -> tensor, e.g. lambda x: x * 0), and this one cannot take it ({why})."
            )
        address, facet, only = resolve_key(trace, key)
        rec = trace.modules[address]
        if not rec.calls:
            raise EditSpecError(
                f"edit= key {key!r}: module {address or '<root>'!r} did not run in this forward."
            )
        calls = list(range(len(rec.calls))) if only is None else [only]
        if only is not None and not 0 <= only < len(rec.calls):
            raise EditSpecError(
                f"edit= key {key!r}: {address or '<root>'} ran {len(rec.calls)} time(s), so call is 0..{len(rec.calls) - 1}."
            )
        how = "fn" if callable(value) else "tensor"
        record = EditRecord(key, address, facet, tuple(calls), how, "")
        wheres = []
        for c in calls:
            facets = rec.calls[c].facets
            if facet not in facets.sites:
                if facet in getattr(facets, "refused", {}):
                    raise NotEditable(
                        f"{_site_name(address, facet, c, len(rec.calls))} cannot be edited: it is not served "
                        f"({facets.refused[facet]}), so TorchLens cannot say which tensor it is."
                    )
                facets.site(facet)  # FacetNotFound with close matches
            site = facets.sites[facet]
            if (address, c, facet) in seen:
                raise EditSpecError(
                    f"edit= keys {seen[address, c, facet]!r} and {key!r} name the same site "
                    f"{_site_name(address, facet, c, len(rec.calls))}; give one edit per site."
                )
            seen[address, c, facet] = key
            base = dict(record=record, value=value, shape=tuple(site.shape), dtype=site.dtype)
            if isinstance(value, Tensor):  # refused now, before the edited forward runs
                name = _site_name(address, facet, c, len(rec.calls))
                _check_given(name, value, tuple(site.shape), site.dtype)
            side = _HOOK_FACETS.get(facet)
            if side is not None and not _is_hooks_tensor(rec.calls[c], side, site):
                side = None  # computed where the hook does not see it: edited at its op
            if side is not None:
                first = hooked.setdefault((side, address, c), key)
                if first != key:  # `output` and `resid_post` of a block: one tensor, two names
                    raise EditSpecError(
                        f"edit= keys {first!r} and {key!r} both replace the "
                        f"{'input' if side == 'in' else 'output'} of {address or '<root>'}"
                        f"{f' (call {c})' if len(rec.calls) > 1 else ''}: they name one tensor; give "
                        f"one edit per tensor."
                    )
                target = plan.hook_in if side == "in" else plan.hook_out
                target.setdefault((address, c), []).append(_Edit(**base))
                wheres.append("pre-hook" if side == "in" else "forward hook")
                continue
            maps = _op_edit(trace, address, facet, c, len(rec.calls), site)
            op = trace.ops[site.op]
            if site.op in plan.ops:
                raise EditSpecError(
                    f"edit= keys {plan.ops[site.op].record.key!r} and {key!r} replace the same op "
                    f"#{site.op} ({op.name}); give one edit per op."
                )
            plan.ops[site.op] = _Edit(
                **base, **maps, op_name=op.name, op_module=op.module, op_call=op.call
            )
            wheres.append(f"op #{site.op} {op.name}")
        record.where = ", ".join(dict.fromkeys(wheres))
        plan.records.append(record)
    return plan


def check_inputs(args: tuple, kwargs: dict) -> None:
    """Refuse inputs a locating pass would change: a KV cache object is extended by every forward."""
    for name, v in list(enumerate(args)) + list(kwargs.items()):
        if (
            v is not None
            and not isinstance(v, (Tensor, int, float, bool, str))
            and hasattr(v, "get_seq_length")
        ):
            raise EditSpecError(
                f"edit= runs the forward twice (a locating pass, then the edited one), and the forward extends the "
                f"cache passed as {name if isinstance(name, str) else f'argument {name}'} ({type(v).__name__}): the "
                f"edited run would see it extended. Pass a copy (copy.deepcopy(cache)) to each call, or no cache."
            )

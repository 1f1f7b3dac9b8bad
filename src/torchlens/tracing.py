"""`torchlens.trace`: run a model once under capture and assemble the `Trace`."""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import families as fam
from .capture import Recorder
from .errors import CaptureError, SaveSpecError, TorchLensError, close_matches
from .facets import ALL_FACETS, FACETS, derive
from .records import FacetMap, ModuleMap, ModuleRecord, Trace

__all__ = ["trace", "SaveSpec"]

#: Facets whose tensors live on a module other than the one that reports them: keep these
#: roles' ops when the facet is selected by name.
_FACET_SOURCE_ROLES = {"logits": ("unembed",), "final_norm_input": ("norm",)}


@dataclass(frozen=True)
class SaveSpec:
    """A normalized `save=` argument: what the finished trace keeps.

    Attributes:
        everything: keep every op output and every facet (`save="all"`).
        addresses: module addresses whose facets and ops (children included) are kept.
        facets: facet names kept on every module that has them.
        predicate: `predicate(address, facet) -> bool`, for any other rule.
    """

    everything: bool = False
    addresses: frozenset[str] = frozenset()
    facets: frozenset[str] = frozenset()
    predicate: Callable[[str, str], bool] | None = field(default=None, compare=False)

    def keep(self, address: str, facet: str) -> bool:
        """Whether the facet `facet` of module `address` is kept."""
        if self.everything or facet in self.facets or self.covers(address):
            return True
        return bool(self.predicate and self.predicate(address, facet))

    def covers(self, address: str) -> bool:
        """Whether `address` is selected or lies inside a selected module."""
        return any(address == a or address.startswith(a + ".") or a == "" for a in self.addresses)

    def describe(self) -> str:
        """The selection in words, for reprs and remedies."""
        if self.everything:
            return "all"
        parts = sorted(self.addresses) + sorted(self.facets) + (["<predicate>"] if self.predicate else [])
        return ", ".join(repr(p) for p in parts) or "none"


def parse_save(save: Any, addresses: Iterable[str]) -> SaveSpec:
    """Turn a `save=` argument into a [`SaveSpec`][torchlens.tracing.SaveSpec], or explain why not."""
    addresses = list(addresses)
    accepted = (
        "save= accepts 'all', 'none', a module address or facet name, a list of those, "
        "or a callable predicate(address, facet) -> bool"
    )
    if save is None or save == "none":
        return SaveSpec()
    if isinstance(save, str):
        if save == "all":
            return SaveSpec(everything=True)
        save = [save]
    if callable(save):
        return SaveSpec(predicate=save)
    if not isinstance(save, (list, tuple, set, frozenset)):
        raise SaveSpecError(f"save={save!r} is a {type(save).__name__}; {accepted}.")
    addr_set = set(addresses)
    picked_addresses, picked_facets = set(), set()
    for item in save:
        if not isinstance(item, str):
            raise SaveSpecError(f"save= list item {item!r} is not a string; {accepted}.")
        if item in ("all", "none"):
            raise SaveSpecError(f"save= list item {item!r}: pass save={item!r} on its own, not inside a list.")
        if item in addr_set:
            picked_addresses.add(item)
        elif item in ALL_FACETS:
            picked_facets.add(item)
        else:
            hits = close_matches(item, list(ALL_FACETS) + addresses)
            hint = f" Did you mean {', '.join(repr(h) for h in hits)}?" if hits else ""
            raise SaveSpecError(
                f"save= item {item!r} is neither a module address of this model nor a facet name.{hint} "
                f"Facet names: {', '.join(sorted(ALL_FACETS))}."
            )
    return SaveSpec(addresses=frozenset(picked_addresses), facets=frozenset(picked_facets))


def _retained_modules(spec: SaveSpec, roles: dict[str, str]) -> set[str]:
    keep = set(spec.addresses)
    for facet in spec.facets:
        wanted = set(_FACET_SOURCE_ROLES.get(facet, ()))
        wanted |= {role for role, table in FACETS.items() if facet in table}
        if "any" in wanted:
            return set(roles)
        keep |= {a for a, r in roles.items() if r in wanted}
    return keep


class _CompiledRunsEagerly:
    """While at least one trace runs, `torch.compile`d code runs its eager Python instead.

    A compiled module or function would otherwise run a graph that TorchLens's hooks and torch
    function mode cannot see into (or fail to compile with them, under `fullgraph=True`). The
    compiler's stance is process-wide, so the first trace to start sets `force_eager` and the
    last to finish restores whatever stance was set before; a counter under a lock keeps
    concurrent and nested traces from restoring it early. Without `torch.compiler.set_stance`
    (torch < 2.6) this does nothing, and `_check_compiled` reports a compiled module whose ops
    the trace missed.
    """

    _lock = threading.Lock()
    _depth = 0
    _token: Any = None

    def __enter__(self) -> _CompiledRunsEagerly:
        self.active = False
        dynamo = sys.modules.get("torch._dynamo")  # never imported: nothing can be compiled
        set_stance = getattr(dynamo, "set_stance", None)
        if set_stance is None:
            return self
        cls = type(self)
        with cls._lock:
            if cls._depth == 0:
                try:
                    cls._token = set_stance("force_eager")  # remembers the stance it replaces
                except RuntimeError:  # trace() called inside a compiled region
                    return self
            cls._depth += 1
            self.active = True
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not self.active:
            return
        cls = type(self)
        with cls._lock:
            cls._depth -= 1
            if cls._depth == 0:
                token, cls._token = cls._token, None
                token.__exit__(None, None, None)  # back to the stance before the first trace


def _compiled_module_class() -> type | None:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def _is_compiled(module: nn.Module) -> bool:
    """A `torch.compile(module)` wrapper, or a module compiled in place with `module.compile()`."""
    wrapper = _compiled_module_class()
    return (wrapper is not None and isinstance(module, wrapper)) or getattr(
        module, "_compiled_call_impl", None
    ) is not None


def _check_compiled(rec: Recorder, modules: dict[str, nn.Module]) -> None:
    """Refuse a trace in which a compiled module produced a tensor while no op of it was seen."""
    for call in rec.calls:
        if (
            call.first_op == call.end_op
            and call._out_ref is None
            and call._out is not None
            and _is_compiled(modules[call.address])
        ):
            raise CaptureError(
                f"module {call.address or '<root>'!r} is compiled with torch.compile and its compiled code "
                "ran without TorchLens seeing a single op of it, so the trace would have a hole there. "
                "TorchLens runs compiled code eagerly during a trace with torch.compiler.set_stance"
                "('force_eager') where torch has it (2.6 and later), which did not happen here. Trace the "
                "eager module instead: replace a torch.compile(module) wrapper by its `_orig_mod` "
                "(model.sub = model.sub._orig_mod), undo module.compile() with "
                "module._compiled_call_impl = None, or call trace() under "
                "torch.compiler.set_stance('force_eager')."
            )


def trace(model: nn.Module, *args: Any, save: Any = "all", **kwargs: Any) -> Trace:
    """Run `model(*args, **kwargs)` once in eager mode and record everything it does.

    Args:
        model: any `torch.nn.Module`. It runs exactly as it would without TorchLens (eval or
            train mode, dtype and device are yours to set).
        *args: positional inputs of the forward.
        save: what the trace keeps. `"all"` (default) keeps every op output and facet;
            `"none"` keeps metadata only (names, shapes, dtypes, data flow); a module address or
            facet name, or a list of them, keeps those facets (and the ops inside the named
            modules); a callable `predicate(address, facet) -> bool` keeps the facets it accepts.
        **kwargs: keyword inputs of the forward.

    Returns:
        The [`Trace`][torchlens.records.Trace]: `trace.ops`, `trace.modules[address].facets`,
        `trace.output`.

    Raises:
        SaveSpecError: `save=` is not accepted, or selects nothing in this forward.
        TorchLensError: `model` is not a module.
        CaptureError: a `torch.compile`d module ran code the capture could not see. TorchLens runs
            compiled modules and functions eagerly while it traces (`torch.compiler.set_stance(
            "force_eager")`, torch 2.6+), so this only happens where torch cannot do that; a
            `torch.compile(model)` wrapper passed as `model` is traced as its `_orig_mod`.
        Exception: whatever the forward raises propagates unchanged, with a note naming the op
            and module where it happened; nothing TorchLens installed is left behind.

    Examples:
        >>> import torch, torchlens
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
        >>> t = torchlens.trace(model, torch.ones(2, 3))
        >>> [op.name for op in t.ops]
        ['input', 'linear', 'relu']
        >>> t.modules["0"].facets["output"].shape
        torch.Size([2, 4])
    """
    if not isinstance(model, nn.Module):
        raise TorchLensError(f"trace() needs a torch.nn.Module as its first argument, got {type(model).__name__}.")
    wrapper = _compiled_module_class()
    if wrapper is not None and isinstance(model, wrapper):  # torch.compile(model): trace the eager model
        model = model._orig_mod
    names: dict[nn.Module, str] = {}
    aliases: dict[str, str] = {}
    for addr, m in model.named_modules(remove_duplicate=False):
        if m in names:
            aliases[addr] = names[m]
        else:
            names[m] = addr
    roles = fam.assign_roles(model, names)
    spec = parse_save(save, list(names.values()) + list(aliases))
    spec = SaveSpec(
        spec.everything, frozenset(aliases.get(a, a) for a in spec.addresses), spec.facets, spec.predicate
    )
    retain_all = spec.everything or spec.predicate is not None
    params: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        params.setdefault(id(p), n)  # a shared (tied) weight keeps its first, canonical name
    rec = Recorder(names, roles, retain_all, _retained_modules(spec, roles), params)
    handles = []
    try:
        for m in names:
            handles.append(m.register_forward_pre_hook(rec.pre_hook, with_kwargs=True))
            handles.append(m.register_forward_hook(rec.post_hook, with_kwargs=True, always_call=True))
        with _CompiledRunsEagerly(), rec:
            output = model(*args, **kwargs)
    except BaseException as exc:
        _annotate(exc, rec)
        raise
    finally:
        for h in handles:
            h.remove()
    with rec.hidden():  # inside an outer trace, deriving the facets is not part of the forward
        return _assemble(rec, model, names, aliases, roles, spec, output)


def _annotate(exc: BaseException, rec: Recorder) -> None:
    if rec.failure is not None and rec.failure[0] is exc:  # the hooks unwound the stack already
        where = " > ".join(rec.failure[1]) or "<outside any module>"
    else:
        where = " > ".join(c.address or "<root>" for c in rec.stack) or "<outside any module>"
    if rec.op_failure is not None and rec.op_failure[0] is exc:
        note = f"torchlens: raised during op #{len(rec.ops)} ({rec.op_failure[1]}) in module {where}"
    elif not rec.ops:
        note = f"torchlens: raised before the first op, in module {where}"
    else:
        note = f"torchlens: raised after op #{len(rec.ops) - 1} ({rec.ops[-1].name}) in module {where}"
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def _assemble(rec, model, names, aliases, roles, spec, output) -> Trace:
    modules = {addr: m for m, addr in names.items()}
    _check_compiled(rec, modules)
    overwritten = rec.check_versions()
    if overwritten:
        labels = ", ".join(f"#{i} {rec.ops[i].name}" for i in overwritten[:5])
        warnings.warn(
            f"torchlens: {len(overwritten)} saved op outputs were written in place by code the capture "
            f"could not see ({labels}); their saved values show the later contents.",
            stacklevel=3,
        )
    keep = None if spec.everything else spec.keep
    with torch.no_grad():
        derive(rec.ops, rec.calls, modules, keep)
    if not spec.everything:
        for op in rec.ops:
            if not spec.covers(op.module) and any(t is not None for t in op.tensors):
                op.tensors = (None,) * len(op.tensors)
    records: dict[str, ModuleRecord] = {}
    alias_of: dict[str, list[str]] = {}
    for a, canonical in aliases.items():
        alias_of.setdefault(canonical, []).append(a)
    for m, addr in names.items():
        records[addr] = ModuleRecord(addr, type(m).__name__, roles[addr], [], tuple(alias_of.get(addr, ())))
    for call in rec.calls:
        call.facets = FacetMap(call.address, call.role, call.__dict__.pop("_sites", {}))
        call._in = call._out = None
        records[call.address].calls.append(call)
    if not spec.everything and (spec.addresses or spec.facets or spec.predicate):
        if not any(len(c.facets) for c in rec.calls):
            raise SaveSpecError(
                f"save={spec.describe()} kept nothing in this forward: no module that ran has those facets. "
                f"Facets that exist here: {', '.join(sorted({n for c in rec.calls for n in c.facets.sites}))}."
            )
    blocks = []
    for call in rec.calls:
        if call.role == "block" and call.address not in blocks:
            blocks.append(call.address)
    return Trace(rec.ops, ModuleMap(records, aliases), output, blocks, type(model).__name__, spec)

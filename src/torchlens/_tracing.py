"""`torchlens.trace`: run a model once under capture and assemble the `Trace`."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ._dispatch import accelerate_hooks
from ._store import apply_store, parse_store
from ._capture import Recorder
from ._structure import find as find_structure
from ._structure import parse_roles, static_roles
from ._compiled import CompiledRunsEagerly, check_compiled, compiled_module_class
from ._errors import SaveSpecError, TorchLensError
from ._facets import derive
from ._records import FacetMap, ModuleMap, ModuleRecord, Trace
from ._snapshot import snapshot
from ._save import SaveSpec, parse_save, retained_modules

__all__ = ["trace"]


def trace(model: nn.Module, *args: Any, save: Any = "all", roles: Any = None, store: Any = None,
          edit: Any = None, **kwargs: Any) -> Trace:
    """Run `model(*args, **kwargs)` once in eager mode and record everything it does.

    Args:
        model: any `torch.nn.Module`. It runs exactly as it would without TorchLens (eval or
            train mode, dtype and device are yours to set).
        *args: positional inputs of the forward.
        save: what the trace keeps. `"all"` (default) keeps every op output and facet;
            `"none"` keeps metadata only (names, shapes, dtypes, data flow); a module address or
            facet name, or a list of them, keeps those facets (and the ops inside the named
            modules); a callable `predicate(address, facet) -> bool` keeps the facets it accepts.
        roles: where TorchLens's structure rules cannot tell, name roles yourself: a dict from a
            module address or glob pattern (`"encoder.blocks.*"`; `*` is one address part) to
            `"block"`, `"attention"`,
            `"cross_attention"`, `"mlp"`, `"norm"`, `"embedding"`, `"unembed"` or `"other"`.
            Named blocks form the layers of their holder's stack; inside a block that has named
            sublayers, only the named ones are taken.
        store: where the saved tensors live once the trace is returned: None (default) leaves
            them where the model computed them; `"cpu"` copies them to host memory; a directory
            path writes them to safetensors files there and serves them as memory-mapped views,
            read back lazily. They are moved after the forward, so the peak memory during
            capture is unchanged; see `torchlens._store`.
        edit: sites to replace as the model computes them: a dict from a key (a hook name of any
            naming generation such as `"blocks.0.hook_resid_post"`, `"address:facet"`, or a tuple
            `(module_address, facet)` / `(module_address, facet, call)`) to a function
            `fn(value) -> tensor` (it receives the site's tensor in TorchLens's layout) or a tensor
            of the site's shape. A site of a module that runs several times is edited on every call
            unless the key names one. The returned trace records the edited forward and lists the
            edits in `trace.edits`. An edited trace first runs one locating pass (`save="none"`)
            to find each site's hook or op; see `torchlens._edits`.
        **kwargs: keyword inputs of the forward.

    Returns:
        The recorded forward pass. Its `ops`, its `modules[address].facets` and its `output`
        (the model's own return value) hold what ran.

    Raises:
        SaveSpecError: `save=` is not accepted, or selects nothing in this forward.
        EditSpecError: `edit=` is not accepted: not a dict, a key naming no site, a value neither
            callable nor a tensor, a replacement of the wrong shape or dtype.
        NotEditable: an `edit=` key names a site no single op of the forward produces (a pattern
            rebuilt from a fused kernel, a computed facet, a slice of a fused projection).
        StoreSpecError: `store=` is not None, "device", "cpu" or a directory path.
        RoleSpecError: `roles=` is not a dict, names an unknown role, or a key matches no module.
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
    plan = None
    if edit is not None:
        plan = _locate(model, args, kwargs, edit, roles)
    wrapper = compiled_module_class()
    if wrapper is not None and isinstance(model, wrapper):  # torch.compile(model): trace the eager model
        model = model._orig_mod
    names: dict[nn.Module, str] = {}
    aliases: dict[str, str] = {}
    for addr, m in model.named_modules(remove_duplicate=False):
        if m in names:
            aliases[addr] = names[m]
        else:
            names[m] = addr
    roles = static_roles(model, names, parse_roles(roles, list(names.values())))
    spec = parse_save(save, list(names.values()) + list(aliases))
    store_to = parse_store(store)
    spec = SaveSpec(
        spec.everything, frozenset(aliases.get(a, a) for a in spec.addresses), spec.facets, spec.predicate
    )
    retain_all = spec.everything or spec.predicate is not None
    params: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        params.setdefault(id(p), n)  # a shared (tied) weight keeps its first, canonical name
    rec = Recorder(names, roles, retain_all, retained_modules(spec, roles), params, plan)
    handles = []
    try:
        for m in names:
            handles.append(m.register_forward_pre_hook(rec.pre_hook, with_kwargs=True))
            handles.append(m.register_forward_hook(rec.post_hook, with_kwargs=True, always_call=True))
        with CompiledRunsEagerly(), accelerate_hooks(names, rec) as dispatch, rec:
            output = model(*args, **kwargs)
    except BaseException as exc:
        _annotate(exc, rec)
        raise
    finally:
        for h in handles:
            h.remove()
    if plan is not None:
        plan.check_applied()
    # Inside an outer trace, deriving the facets is not part of the forward; an accelerate-dispatched
    # model's modules hold the weights the forward used (not meta placeholders) while it runs.
    with rec.hidden(), dispatch.weights():
        overwritten = rec.check_versions()
        result = _assemble(rec, model, names, aliases, roles, spec, output, overwritten)
        snapshot(rec, model, (args, kwargs, output))  # after assembly: only what the trace keeps is copied
        if plan is not None:
            result.edits = tuple(plan.records)
            _note_edited_refusals(result)
        return apply_store(result, store_to)


def _note_edited_refusals(result: Trace) -> None:
    """An edited site whose check the edit broke (editing z breaks pattern @ v = z) is refused;
    its reason says that the edit is why."""
    for r in result.edits:
        calls = result.modules[r.module_address].calls
        for c in r.calls:
            refused = calls[c].facets.refused if c < len(calls) and calls[c].facets is not None else {}
            if r.facet in refused:
                refused[r.facet] += f" (this trace edited it, edit={{{r.key!r}: ...}}, which breaks that relation)"


def _locate(model: nn.Module, args: tuple, kwargs: dict, edit: Any, roles: Any):
    """The locating pass of an edited trace: one `save="none"` trace, RNG state restored after it
    (so dropout in training mode draws the same masks in the edited run), and the edit plan."""
    from ._edits import check_inputs, plan_edits

    check_inputs(args, kwargs)
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        located = trace(model, *args, save="none", roles=roles, **kwargs)
    return plan_edits(located, edit)


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


def _assemble(rec, model, names, aliases, roles, spec, output, overwritten) -> Trace:
    modules = {addr: m for m, addr in names.items()}
    check_compiled(rec, modules)
    if overwritten:
        labels = ", ".join(f"#{i} {rec.ops[i].name}" for i in overwritten[:5])
        warnings.warn(
            f"torchlens: {len(overwritten)} saved op outputs were written in place by code the capture "
            f"could not see ({labels}); they are not kept, since they would show the later contents "
            "(the tensor as the forward used it next is kept, as a written_in_place op).",
            stacklevel=3,
        )
        for i in overwritten:  # a value the model did not produce there is never served
            rec.ops[i].tensors = (None,) * len(rec.ops[i].tensors)
    keep = None if spec.everything else spec.keep
    with torch.no_grad():
        structure = find_structure(rec.ops, rec.calls, modules, roles, model, names)
        all_sites = derive(rec.ops, rec.calls, modules, keep, structure)
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
    for call, sites in zip(rec.calls, all_sites):
        call.facets = FacetMap(call.address, call.role, sites)
        call._in = call._out = None
        records[call.address].calls.append(call)
    if not spec.everything and (spec.addresses or spec.facets or spec.predicate):
        if not any(len(c.facets) for c in rec.calls):
            raise SaveSpecError(
                f"save={spec.describe()} kept nothing in this forward: no module that ran has those facets. "
                f"Facets that exist here: {', '.join(sorted({n for c in rec.calls for n in c.facets.sites}))}."
            )
    blocks = [layer.call.address for layer in structure.layers]
    return Trace(rec.ops, ModuleMap(records, aliases), output, blocks, type(model).__name__, spec, structure)

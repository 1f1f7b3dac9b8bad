"""`torchlens.trace`: run a model once under capture and assemble the `Trace`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from torchlens._analysis.grads import backward, grad_maps, loss_of
from torchlens._analysis.role_rules import parse_roles, static_roles
from torchlens._analysis.selection import parse_save, plan_capture
from torchlens._assemble import assemble, note_cut_gradients, note_edited_refusals
from torchlens._capture.accelerate import accelerate_hooks
from torchlens._capture.collector import paused
from torchlens._capture.compiled import CompiledRunsEagerly, compiled_module_class
from torchlens._capture.output_copies import settle
from torchlens._capture.recorder import Recorder
from torchlens._capture.snapshot import arm_guards, snapshot
from torchlens._capture.stores import DirectoryStore, apply_store, parse_store
from torchlens._capture.undo import writes_undone
from torchlens._core.errors import GradientError, TorchLensError
from torchlens._core.pending import seal_checks
from torchlens._edits import check_inputs, plan_edits
from torchlens._trace import Trace

__all__ = ["trace", "finish", "annotate", "locating_trace", "module_names"]


def trace(
    model: nn.Module,
    *args: Any,
    save: str | Sequence[str] | Callable[[str, str], bool] = "all",
    roles: Mapping[str, str] | None = None,
    store: str | os.PathLike | None = None,
    edit: Mapping[str | tuple, Callable[[Tensor], Tensor] | Tensor] | None = None,
    grads: Callable[[Any], Tensor] | None = None,
    **kwargs: Any,
) -> Trace:
    """Run `model(*args, **kwargs)` once in eager mode and record everything it does.

    Args:
        model: any `torch.nn.Module`. It runs exactly as it would without TorchLens (eval or
            train mode, dtype and device are yours to set).
        *args: positional inputs of the forward.
        save: what the trace keeps. `"all"` (default) keeps every op output and facet;
            `"none"` keeps metadata only (names, shapes, dtypes, data flow); a module address or
            facet name, or a list of them, keeps those facets (and the ops inside the named
            modules); a callable `predicate(address, facet) -> bool` keeps the facets it accepts.
            During capture a selection holds only what it needs: a facet a hook sees
            (`resid_post`, `logits`) is held alone, the ops inside a module are held for a facet
            found from them (`pattern`) or for a named module; see the
            [Facets guide](../guides/facets.md#saving-less).
        roles: where TorchLens's structure rules cannot tell, name roles yourself: a dict from a
            module address or glob pattern (`"encoder.blocks.*"`; `*` is one address part) to
            `"block"`, `"attention"`,
            `"cross_attention"`, `"mlp"`, `"norm"`, `"embedding"`, `"unembed"` or `"other"`.
            Named blocks form the layers of their holder's stack; inside a block that has named
            sublayers, only the named ones are taken.
        store: where the saved tensors live once the trace is returned: None (default) leaves
            them where the model computed them; `"cpu"` copies them to host memory after the
            forward; a directory path writes them to safetensors files there as capture goes
            (each time a top-level block ends) and serves them as memory-mapped views, read back
            lazily, so the peak memory during capture stays near the plain forward's plus one
            layer's saved tensors; see [Large traces](../guides/storage.md).
        edit: sites to replace as the model computes them: a dict from a key (a hook name of any
            naming generation such as `"blocks.0.hook_resid_post"`, `"address:facet"`, or a tuple
            `(module_address, facet)` / `(module_address, facet, call)`) to a function
            `fn(value) -> tensor` (it receives the site's tensor in TorchLens's layout) or a tensor
            of the site's shape. A site of a module that runs several times is edited on every call
            unless the key names one. The returned trace records the edited forward and lists the
            edits in `trace.edits`. An edited trace first runs one locating pass (`save="none"`)
            to find each site's hook or op; what that pass writes into the inputs, the buffers
            (a `BatchNorm`'s running statistics in training mode) and parameters is restored
            before the edited forward, so the model's state afterwards is that of one edited
            forward; see [Interventions](../guides/interventions.md).
        grads: a loss function `loss_fn(output) -> scalar tensor` of the model's return value.
            The forward then runs with autograd on (also when the caller is under
            `torch.no_grad()`), and one backward of the loss gives, for every kept facet,
            d loss / d the tensor the model used there: `trace.modules[address].grads[facet]`,
            with the same keys, call rules and refusals as `facets`. Frozen parameters stay
            frozen: the output of an op that reads one together with the input (an embedding's
            lookup) is where autograd's graph starts, so every activation requires grad as it
            would with the parameters unfrozen, and a tensor computed from frozen parameters
            alone gets its gradient refused, saying so. No parameter's `.grad` is written. See
            [Gradients](../guides/gradients.md).
        **kwargs: keyword inputs of the forward.

    Returns:
        The recorded forward pass. Its `ops`, its `modules[address].facets` and its `output`
        (the model's own return value) hold what ran.

    Raises:
        SaveSpecError: `save=` is not accepted, or selects nothing: before the forward runs
            where the model's modules cannot have what it names, else after it.
        EditSpecError: `edit=` is not accepted: not a dict, a key naming no site, a value neither
            callable nor a tensor, a replacement of the wrong shape or dtype.
        NotEditable: an `edit=` key names a site no single op of the forward produces (a pattern
            rebuilt from a fused kernel, a computed facet, a slice of a fused projection).
        StoreSpecError: `store=` is not None, "device", "cpu" or a directory path.
        RoleSpecError: `roles=` is not a dict, names an unknown role, or a key matches no module.
        TorchLensError: `model` is not a module.
        GradientError: `grads=` is not callable, its loss is not a differentiable scalar, it
            raised, or the call runs under `torch.inference_mode()` (which records no autograd
            graph, so no gradient can be taken).
        CaptureError: a `torch.compile`d module ran code the capture could not see. TorchLens runs
            compiled modules and functions eagerly while it traces (`torch.compiler.set_stance(
            "force_eager")`, torch 2.6+), so this only happens where torch cannot do that; a
            `torch.compile(model)` wrapper passed as `model` is traced as its `_orig_mod`.
        Exception: whatever the forward raises propagates unchanged, with a note naming the op
            and module where it happened; nothing TorchLens installed is left behind.

    Note:
        While a trace runs, `torch.compile`d code runs eagerly in the whole process, not only in
        the tracing thread: torch keeps the compiler stance process-wide (one global, checked on
        torch 2.13), so another thread calling a compiled function meanwhile gets its eager
        Python (same values, no compiled graph, not recorded in this trace). The stance that was
        set before is restored when the last running trace returns or raises.

        Python's cyclic garbage collector is off for the call, in the whole process too (it
        has one switch), and set back to the state the first running trace found when the last
        one returns or raises: reference counting still frees at once every object no reference
        cycle holds, and what a cycle made meanwhile holds is freed by the first collection after
        the call. A trace makes thousands of small objects, most gone before it returns; with the
        collector on, each pass during the call would age them toward the full passes over every
        object of the process.

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
        raise TorchLensError(
            f"trace() needs a torch.nn.Module as its first argument, got {type(model).__name__}."
        )
    loss_name = _check_grads(grads)
    with paused():  # see `_capture.collector`: no collector passes over what the trace makes
        plan = None
        if edit is not None:
            plan = _locate(model, args, kwargs, edit, roles)
        wrapper = compiled_module_class()
        if wrapper is not None and isinstance(
            model, wrapper
        ):  # torch.compile(model): trace the eager model
            inner = model._orig_mod
            assert isinstance(inner, nn.Module)
            model = inner
        names, aliases = module_names(model)
        roles = static_roles(model, names, parse_roles(roles, list(names.values())))
        spec = parse_save(save, names.values(), aliases)
        store_to = parse_store(store)
        capture = plan_capture(spec, roles, {addr: m for m, addr in names.items()})
        # `named_parameters` in one pass over the modules already listed: a shared (tied) weight
        # keeps its first, canonical name. Each stays alive until `trace` returns, so its id names
        # no other tensor meanwhile (accelerate replaces a meta placeholder by the loaded weight,
        # freeing the placeholder, and a buffer it loads next may take its address).
        params, held = parameter_names(names)
        # A directory store writes as capture goes; "cpu" moves the tensors once the trace is assembled.
        rec = Recorder(
            names,
            roles,
            capture,
            params,
            plan,
            store_to if isinstance(store_to, DirectoryStore) else None,
            grads=grads is not None,
        )
        handles = []
        caller_grad = torch.is_grad_enabled()
        loss = None
        try:
            try:
                for m in names:
                    handles.append(m.register_forward_pre_hook(rec.pre_hook, with_kwargs=True))
                    handles.append(m.register_forward_hook(rec.post_hook, always_call=True))
                with (
                    CompiledRunsEagerly(),
                    accelerate_hooks(names, rec) as dispatch,
                    rec,
                    torch.enable_grad() if grads is not None else contextlib.nullcontext(),
                ):
                    output = model(*args, **kwargs)
            except BaseException as exc:
                annotate(exc, rec)
                raise
            finally:
                for h in handles:
                    h.remove()
            if grads is not None:
                with torch.enable_grad(), rec.watching():  # a write the loss makes is seen
                    loss = loss_of(grads, output, loss_name)
                if not caller_grad:  # the caller asked for no graph: the output it gets holds none
                    output = _detached(output)
            result = finish(
                rec,
                model,
                names,
                aliases,
                roles,
                capture,
                plan,
                store_to,
                dispatch,
                (args, kwargs, output),
                loss,
                loss_name,
            )
        except (
            BaseException
        ):  # the forward raised, or the trace was refused after it (save=, grads=)
            if isinstance(store_to, DirectoryStore):  # what it wrote serves no trace
                store_to.discard()
            raise
        del output, loss  # the returned trace is the output's only holder here
        del held  # the parameters named for the forward (see above)
        rec.producer.clear()  # the recorder's weak references to the op outputs, the output's too
        rec._frozen_only.clear()
        settle(result, rec.output_groups)  # see `_capture.output_copies`
        return result


def parameter_names(names: dict[nn.Module, str]) -> tuple[dict[int, str], list[Tensor]]:
    """`id(parameter) -> qualified name` of every parameter of the modules in `names` (a shared,
    tied, weight by its first name), and the parameters themselves: the caller holds them while
    the ids name them, so that no other tensor takes one of those ids meanwhile."""
    params: dict[int, str] = {}
    held: list[Tensor] = []
    for m, addr in names.items():
        for n, p in m._parameters.items():
            if p is not None and id(p) not in params:
                params[id(p)] = f"{addr}.{n}" if addr else n
                held.append(p)
    return params, held


def module_names(model: nn.Module) -> tuple[dict[nn.Module, str], dict[str, str]]:
    """Each module's canonical address (the first `named_modules` gives it), and every other
    address of a shared module -> its canonical address."""
    names: dict[nn.Module, str] = {}
    aliases: dict[str, str] = {}
    for addr, m in model.named_modules(remove_duplicate=False):
        if m in names:
            aliases[addr] = names[m]
        else:
            names[m] = addr
    return names, aliases


def finish(
    rec: Recorder,
    model: nn.Module,
    names: dict,
    aliases: dict,
    roles: Any,
    capture: Any,
    plan: Any,
    store_to: Any,
    dispatch: Any,
    call: tuple,
    loss: Tensor | None = None,
    loss_name: str = "",
) -> Trace:
    """A recorded forward call's `Trace`: assembled, gradients taken (`grads=`), snapshotted, edits
    noted, stored, guarded and sealed, in that order (`trace`, and each step of `trace_generate`).

    Args:
        rec: the recorder of the call, its mode exited.
        model: the root module.
        names: module -> address.
        aliases: alias address -> address.
        roles: the roles the recorder settled.
        capture: the capture plan (`save=`).
        plan: the edit plan, or None.
        store_to: the parsed `store=`.
        dispatch: what `accelerate_hooks` returned for the call.
        call: `(args, kwargs, output)` of the call.
        loss: with `grads=`, the checked loss of the call's output (`_analysis.grads.loss_of`).
        loss_name: the loss function's name, for the gradients' messages.
    """
    output = call[2]
    if plan is not None:
        plan.check_applied()
    # Inside an outer trace, deriving the facets is not part of the forward; an accelerate-dispatched
    # model's modules hold the weights the forward used (not meta placeholders) while it runs.
    with rec.hidden(), dispatch.weights():
        if rec.spill is not None:  # what was held after the last block goes to the directory too
            rec.write_spill()
        overwritten = rec.check_versions()
        # the module inputs and outputs the hooks kept as aliases, which assembly releases: a
        # derived gradient finds its edges there where no op output was kept (`save=` a facet)
        io = {id(c): (c._in, c._out) for c in rec.calls} if loss is not None else {}
        result = assemble(rec, model, names, aliases, roles, capture, output, overwritten)
        grads_taken = loss is not None
        if loss is not None:
            assert rec.edges is not None
            modules = {addr: m for m, addr in names.items()}
            found = backward(loss, rec.edges, rec.ops, rec.calls, modules, io)
            io.clear()
            grad_maps(rec.calls, found, loss_name)
            rec.edges = loss = None  # the graph is held no longer than the caller's output holds it
        # after assembly: only what the trace keeps is copied; what only the output shares is
        # decided when `trace` returns (`output_copies.settle`), a step's output is generate's
        snapshot(rec, model, call, own_output=rec.deferred is None)
        if plan is not None:
            result.edits = tuple(plan.records)
            plan.check_placed(result)  # each op edit replaced the op its site is in this forward
            note_edited_refusals(result)
            if grads_taken:
                note_cut_gradients(result)
        result = apply_store(result, store_to)
        arm_guards(
            rec, result
        )  # the versions of what only the autograd graph shares, where the store left it
        seal_checks(result)  # last: each pending check records what its inputs hold as returned
        return result


def _check_grads(grads: Any) -> str:
    """The loss function's name, for messages; refuse what cannot give gradients before the forward."""
    if grads is None:
        return ""
    if not callable(grads):
        raise GradientError(
            f"grads= takes a function of the model's output returning a scalar tensor (grads=lambda out: "
            f"out.logits[0, -1].max()), got a {type(grads).__name__}."
        )
    if torch.is_inference_mode_enabled():
        raise GradientError(
            "grads= cannot run under torch.inference_mode(): tensors made there record no autograd graph and "
            "cannot be made to (unlike torch.no_grad(), which the trace overrides for its own forward). Call "
            "trace outside the inference_mode block, or under torch.no_grad() instead."
        )
    return getattr(grads, "__name__", None) or type(grads).__name__


def _detached(output: Any) -> Any:
    """`output` with every tensor in it detached (tuples, lists, dicts and model-output classes)."""
    if isinstance(output, Tensor):
        return output.detach()
    if isinstance(
        output, dict
    ):  # transformers' ModelOutput is a dict (an OrderedDict) and a dataclass
        for k, v in list(output.items()):
            output[k] = _detached(v)
        return output
    if isinstance(output, tuple) and hasattr(output, "_fields"):
        return type(output)(*[_detached(v) for v in output])
    if isinstance(output, (list, tuple)):
        return type(output)(_detached(v) for v in output)
    return output


def _locate(model: nn.Module, args: tuple, kwargs: dict, edit: Any, roles: Any):
    """The locating pass of an edited trace (`locating_trace`) and the edit plan."""
    check_inputs(args, kwargs)
    return plan_edits(locating_trace(model, args, kwargs, roles), edit)


def locating_trace(model: nn.Module, args: tuple, kwargs: dict, roles: Any) -> Trace:
    """A locating pass: one `save="none"` trace of `model(*args, **kwargs)`, the RNG state
    restored after it (so dropout in training mode draws the same masks in the edited run) and
    the tensors it wrote (the inputs, buffers, parameters: `_capture.undo`) restored too, so the
    edited forward starts where the pass did (an edited `trace`, and each edited step of
    `trace_generate`)."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), writes_undone(model.modules(), args, kwargs):
        return trace(model, *args, save="none", roles=roles, **kwargs)


def annotate(exc: BaseException, rec: Recorder) -> None:
    if rec.failure is not None and rec.failure[0] is exc:  # the hooks unwound the stack already
        where = " > ".join(rec.failure[1]) or "<outside any module>"
    else:
        where = " > ".join(c.address or "<root>" for c in rec.stack) or "<outside any module>"
    if rec.op_failure is not None and rec.op_failure[0] is exc:
        note = (
            f"torchlens: raised during op #{len(rec.ops)} ({rec.op_failure[1]}) in module {where}"
        )
    elif not rec.ops:
        note = f"torchlens: raised before the first op, in module {where}"
    else:
        note = (
            f"torchlens: raised after op #{len(rec.ops) - 1} ({rec.ops[-1].name}) in module {where}"
        )
    if hasattr(exc, "add_note"):
        exc.add_note(note)

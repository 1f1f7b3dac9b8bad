"""Models dispatched with accelerate: weights moved in by hooks, kept off the capture.

`accelerate` (`dispatch_model`, `cpu_offload`, `disk_offload`, `device_map=` in
`from_pretrained`) keeps offloaded weights on the meta device and attaches a hook object to each
module (`module._hf_hook`) that the module's wrapped `forward` calls: `pre_forward` loads the
weights and moves the inputs to the execution device, `post_forward` puts the weights back on
meta and moves the output to the input's device.

Those moves are not the model's computation, so while a trace runs each module's hook object is
wrapped (on that module only, restored before `trace` returns or raises) so that:

- the hook's own torch calls are not recorded as ops, but the recorder still sees the writes
  among them (a hook that writes into a tensor, also through `.data`, is a write in place), and
  another torch function mode below the trace still sees them all;
- a tensor the hook moved to another device keeps the data-flow reference of the tensor it
  copies (its values are compared), so an op reading it is linked to the op that produced the
  original; a tensor the hook replaced with other values (an ablation written as a `ModelHook`)
  is recorded as an `accelerate_hook` op computed from the one it replaced;
- each weight the hook loaded is named like the parameter it stands for (a tied weight by its
  first name, as in the undispatched model: dispatch unties the meta placeholders, so the ties a
  Hugging Face model declares in `all_tied_weights_keys` are used), and kept until the
  facets are derived: while they are, the modules hold the weights the forward used instead of
  the meta placeholders (facets such as a norm's gain check or an attention head's result read
  them). Its name is dropped with it, so a later tensor at its address is not taken for it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from torchlens._core.records import Ref

__all__ = ["accelerate_hooks"]


def _flat(value: Any, out: list[Tensor], depth: int = 0) -> list[Tensor]:
    if isinstance(value, Tensor):
        out.append(value)
    elif depth < 8 and isinstance(value, (tuple, list)):
        for v in value:
            _flat(v, out, depth + 1)
    elif depth < 8 and isinstance(value, Mapping):
        for v in value.values():
            _flat(v, out, depth + 1)
    return out


def _moved(old: Tensor, new: Tensor) -> bool:
    """Whether `new` holds exactly `old`'s values: the same shape and dtype, and equal elements
    (compared on `new`'s device). NaNs compare unequal, so a tensor holding one counts as changed
    (it is then recorded as computed, which is still true)."""
    if new.shape != old.shape or new.dtype != old.dtype or old.is_meta or new.is_meta:
        return False
    return bool(torch.equal(old.to(new.device), new))


class _Quiet:
    """Stands in for one module's accelerate hook object while a trace runs."""

    def __init__(self, hook: Any, rec: Any, address: str, used: dict):
        self.hook = hook
        self.rec = rec
        self.address = address
        self.used = used

    def __getattr__(self, name: str) -> Any:
        return getattr(self.hook, name)

    @contextlib.contextmanager
    def _quiet(self, hide: bool = False) -> Iterator[None]:
        """The hook's own calls are not recorded as ops (the recorder still sees their writes,
        `Recorder._quiet_call`); with `hide`, this wrapper's bookkeeping reaches no torch
        function mode below either. The hook itself runs where a plain forward runs it: another
        mode (`torch.device(...)`, an outer trace) sees its calls."""
        quiet = self.rec._quiet
        self.rec._quiet = True
        try:
            with self.rec.hidden() if hide else contextlib.nullcontext():
                yield
        finally:
            self.rec._quiet = quiet

    def _alias(self, before: list[Tensor], after: list[Tensor]) -> None:
        """Link each tensor the hook replaced to what it stands for.

        A move (the same values, on another device: a model spread over devices moves each
        block's inputs and outputs) keeps the data-flow reference of the tensor it copies: the op
        that produced it, as it is now (one written in place since gets its `written_in_place`
        op first), or the parameter's name. A hook that returns other values (an ablation written
        as an accelerate `ModelHook`) computed something: its result is recorded as an
        `accelerate_hook` op whose input is the tensor it replaced, so the trace holds the values
        the next module received. On one device, accelerate's own hooks return the tensors
        themselves. A hook that adds or drops a tensor argument pairs nothing by position: each
        tensor it returns that it was not given is an `accelerate_hook` op with no input.
        """
        rec = self.rec
        if len(before) != len(after):  # a hook that added or dropped a tensor argument
            with self._quiet(hide=True):
                kept = {id(t) for t in before}
                for new in after:
                    # each tensor it did not pass on as it was: from what, no position tells, so
                    # it is recorded as computed by the hook (never as the model's input)
                    if isinstance(new, Tensor) and id(new) not in kept:
                        rec._record("accelerate_hook", (new,), (), False)
            return
        with self._quiet(hide=True):
            for old, new in zip(before, after):
                if new is old or not isinstance(new, Tensor):
                    continue
                if not _moved(old, new):
                    rec._record("accelerate_hook", (new,), (old,), False)
                    continue
                ref = rec._ref(old)
                if isinstance(ref, Ref):
                    rec.producer[id(new)] = (ref, weakref.ref(new), rec._stamp(new))
                elif isinstance(ref, str):
                    rec.param_names[id(new)] = ref
                else:
                    continue
                self.used[("moved", id(new))] = (
                    new  # alive until the trace is assembled, so ids stay unique
                )

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any):
        before = _flat((args, kwargs), [])
        with self._quiet():
            args, kwargs = self.hook.pre_forward(module, *args, **kwargs)
        self._alias(before, _flat((args, kwargs), []))
        prefix = self.address + "." if self.address else ""
        with self._quiet(hide=True):
            for name, p in module.named_parameters(recurse=True):
                if not p.is_meta:
                    # Assigned, not set-if-missing: the meta placeholder this id named may be gone.
                    self.rec.param_names[id(p)] = self.rec.canonical_param.get(
                        prefix + name, prefix + name
                    )
                    self.used.setdefault((module, name), p)  # what `weights()` puts back
                    self.used[("loaded", id(p))] = (
                        p  # alive until the trace is assembled, so ids stay unique
                    )
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any):
        before = _flat(output, [])
        with self._quiet():
            output = self.hook.post_forward(module, output)
        self._alias(before, _flat(output, []))
        return output


class _Dispatch:
    def __init__(self, param_names: dict[int, str]) -> None:
        self.used: dict = {}
        #: the recorder's `id -> parameter name`: each weight a hook loaded or moved is named there
        #: while `used` keeps it alive, and no longer once `used` lets it go (`weights`), so a
        #: tensor made later at its address (a generation's next inputs, a loaded buffer) is not
        #: taken for it
        self.param_names = param_names

    @contextlib.contextmanager
    def weights(self) -> Iterator[None]:
        """The weights the forward used, back on their modules (in place of meta tensors)."""
        swapped = []
        try:
            for key, p in self.used.items():
                module, name = key
                if not isinstance(module, nn.Module):
                    continue
                owner, leaf = module, name
                if "." in name:
                    path, leaf = name.rsplit(".", 1)
                    owner = module.get_submodule(path)
                current = owner._parameters.get(leaf)
                if current is not None and current.is_meta:
                    owner._parameters[leaf] = p
                    swapped.append((owner, leaf, current))
            yield
        finally:
            for owner, leaf, meta in swapped:
                owner._parameters[leaf] = meta
            for key in self.used:
                if key[0] in ("loaded", "moved"):
                    self.param_names.pop(key[1], None)
            self.used.clear()


@contextlib.contextmanager
def accelerate_hooks(names: dict[nn.Module, str], rec: Any) -> Iterator[_Dispatch]:
    """While the forward runs, keep accelerate's hooks out of the capture (see the module docs).

    Yields an object whose `weights()` context puts the used weights back for deriving facets.
    """
    dispatch = _Dispatch(rec.param_names)
    # accelerate sets `module._hf_hook` as a plain attribute (in the instance dict); reading it
    # there costs no `Module.__getattr__` miss per module of a model that is not dispatched
    wrapped = [(m, m.__dict__["_hf_hook"]) for m in names if m.__dict__.get("_hf_hook") is not None]
    if wrapped and not hasattr(rec, "canonical_param"):
        canonical: dict[str, str] = {}
        by_id: dict[int, str] = {}
        root = next((m for m, a in names.items() if a == ""), None)
        if root is not None:
            for n, p in root.named_parameters(remove_duplicate=False):
                canonical[n] = by_id.setdefault(id(p), n)  # a tied weight keeps its first name
            # Dispatch gives each tied name its own meta placeholder; Hugging Face models still
            # declare which weights the forward shares (target -> source, as configured).
            tied = getattr(root, "all_tied_weights_keys", None)
            if isinstance(tied, Mapping):
                for target, source in tied.items():
                    if isinstance(target, str) and isinstance(source, str) and target in canonical:
                        canonical[target] = canonical.get(source, source)
        rec.canonical_param = canonical
    try:
        for m, hook in wrapped:
            m._hf_hook = _Quiet(hook, rec, names[m], dispatch.used)  # type: ignore[assignment]  # a plain attribute
        yield dispatch
    finally:
        for m, hook in wrapped:
            m._hf_hook = hook

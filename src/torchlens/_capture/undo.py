"""Undoing what a locating pass wrote into tensors that outlive it.

An edited trace (`trace(..., edit=...)`, and each edited step of `trace_generate`) runs the model
twice: a locating pass (`save="none"`), which finds the op or hook each edit key names, then the
edited forward the trace records. A forward that writes state would otherwise write it twice, and
the edited forward would start from the state the locating pass left:

- a `BatchNorm` in training mode updates its running statistics and `num_batches_tracked`;
- a model may write its input in place (`x.mul_(3)`): the edited forward would read `3 * x`;
- an `nn.Embedding` with `max_norm` renormalizes rows of its weight in place;
- a module may replace one of its buffers (`self.steps = self.steps + 1`).

`LocatingWrites` is a torch function mode entered below the locating pass's own recorder, so it
sees each op that pass runs. Before an op reads a buffer of the model or a tensor input of the
call, it keeps one copy of that tensor (a buffer is small, and a kernel may write one it was only
given as an argument, as `batch_norm` writes its running statistics); before an op writes a
parameter in place (or repoints it, `p.data = y`), it keeps a copy of the parameter. When the pass
is over, `restore` puts back every buffer or parameter a module now holds in its place, and the
values of each copied tensor that the pass changed (its version counter moved, its values differ:
`batch_norm` writes its running statistics without moving their counter, or it was repointed to
other memory). The edited forward then starts from what the caller passed, and the model's
state after the trace is that of one edited forward.

The cost is one copy of each buffer and input the pass reads (on a GPT-2-small shape at 128
tokens an edited `trace` took 1% longer with it, on the 2-layer test GPT-2 7%), and of each
parameter it writes. What no tensor holds is not undone: a counter kept as a Python number, a hook of the caller's own
(it runs in both passes), a parameter written by a kernel that was not given it as the tensor it
writes in place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from torchlens._capture.values import tensor_args, writes_inputs, written_tensors
from torchlens._core.holdings import storage_ptr
from torchlens._core.ops import REPOINT, classify

__all__ = ["LocatingWrites", "writes_undone"]


def _version(t: Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


class LocatingWrites(TorchFunctionMode):
    """Copies of the tensors a locating pass may write, made as it runs, and `restore`.

    Args:
        modules: every module of the model (their parameters and buffers are watched).
        args: the positional inputs of the call.
        kwargs: the keyword inputs of the call.
    """

    def __init__(self, modules: Iterable[nn.Module], args: tuple, kwargs: dict):
        super().__init__()
        #: (the dict a module keeps them in, name, the tensor there now) of every parameter and buffer
        self._slots: list[tuple[dict, str, Tensor]] = []
        self._state: dict[int, Tensor] = {}  # storage -> a buffer or input on it: copied when read
        self._params: dict[int, Tensor] = {}  # storage -> a parameter on it: copied when written
        for m in modules:
            for name, b in m._buffers.items():
                if isinstance(b, Tensor):
                    self._slots.append((m._buffers, name, b))
                    self._watch(self._state, b)
            for name, p in m._parameters.items():
                if isinstance(p, Tensor):
                    self._slots.append((m._parameters, name, p))
                    self._watch(self._params, p)
        for t in tensor_args(args, kwargs or {}):
            self._watch(self._state, t)
        #: storage -> (the tensor, its copy, its version then, its storage then)
        self._copies: dict[int, tuple[Tensor, Tensor, int | None, int]] = {}

    @staticmethod
    def _watch(table: dict[int, Tensor], t: Tensor) -> None:
        ptr = storage_ptr(t)
        if ptr:  # none for a tensor without a storage of its own; 0 for an empty one
            table.setdefault(ptr, t)

    def _keep(self, ptr: int, t: Tensor) -> None:
        if ptr not in self._copies:
            self._copies[ptr] = (t, t.detach().clone(), _version(t), ptr)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        state, params = self._state, self._params
        if state:
            for t in tensor_args(args, kwargs):
                ptr = storage_ptr(t)
                if ptr in state:
                    self._keep(ptr, state[ptr])
        if params:
            kind = classify(func)[1]
            if writes_inputs(kind, kwargs) or kind == REPOINT:
                for t in written_tensors(args, kwargs):
                    ptr = storage_ptr(t)
                    if ptr in params:
                        self._keep(ptr, params[ptr])
        return func(*args, **kwargs)

    def restore(self) -> None:
        """Put back each parameter and buffer a module held before the pass, and the values of
        every copied tensor the pass changed."""
        for table, name, t in self._slots:
            if table.get(name) is not t:
                table[name] = t
        with torch.no_grad(), torch._C.DisableTorchFunction():
            for t, copy, version, ptr in self._copies.values():
                if version is None:  # an inference tensor: written only in inference mode
                    continue
                if storage_ptr(t) != ptr:  # repointed (`t.data = y`): back to memory of its own
                    t.data = copy
                elif _version(t) != version or not torch.equal(t, copy):
                    # a kernel may write a tensor it was given without moving its version counter
                    # (`batch_norm` its running statistics): the values tell
                    t.copy_(copy)
        self._copies.clear()


@contextlib.contextmanager
def writes_undone(modules: Iterable[nn.Module], args: tuple, kwargs: dict) -> Iterator[None]:
    """Run the block (a locating pass of the model over `modules`, called on `args` and
    `kwargs`) under `LocatingWrites`, and `restore` after it, also when it raised."""
    writes = LocatingWrites(modules, args, kwargs)
    try:
        with writes:
            yield
    finally:
        writes.restore()

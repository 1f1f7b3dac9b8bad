"""What the recorder reads out of, and writes back into, the values a forward passes around: the
tensors among an op's arguments, the tensor a module output stands for, and replacing it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from torchlens._core.errors import CaptureError
from torchlens._core.ops import INPLACE

__all__ = [
    "all_plain",
    "first_tensor",
    "plain_tensors",
    "refuse_script_modules",
    "replace_first",
    "replace_input",
    "tensor_args",
    "writes_inputs",
]


def tensor_args(args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors among an op's arguments, one level into lists and tuples (e.g. `torch.cat`)."""
    found = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend([x for x in a if isinstance(x, Tensor)])
    return found


def written_tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors a writing op (in place, `out=`, `inplace=True`) is given to write: its first
    argument (its first tensor keyword argument when it has neither a positional one nor `out=`:
    `nn.init.uniform_` hands on `tensor=` as a keyword) and its `out=` tensors."""
    out = kwargs.get("out")
    first = (
        args[0]
        if args
        else next((v for k, v in kwargs.items() if k != "out" and isinstance(v, Tensor)), None)
        if out is None  # `torch.mul(input=y, other=2, out=z)` writes z alone
        else None
    )
    targets: list[Tensor] = [first] if isinstance(first, Tensor) else []
    if isinstance(out, Tensor):
        targets.append(out)
    elif isinstance(out, (list, tuple)):
        targets += [t for t in out if isinstance(t, Tensor)]
    return targets


def writes_inputs(kind: int, kwargs: dict | None) -> bool:
    """Whether a call of this `classify` kind with these keyword arguments writes into a tensor
    it was given: an in-place function, or one called with `out=` or `inplace=True`."""
    return (
        kind == INPLACE
        or kwargs is not None
        and (kwargs.get("out") is not None or kwargs.get("inplace") is True)
    )


def plain_tensors(args: tuple, kwargs: dict) -> bool:
    """Whether every tensor among a module call's arguments (as `tensor_args` finds them) is a
    plain `torch.Tensor`, no subclass."""
    return all(type(t) is Tensor for t in tensor_args(args, kwargs))


def all_plain(args: tuple, kwargs: dict) -> bool:
    """`plain_tensors(args, kwargs)` without building the list (once per module call)."""
    return _all_plain(args) and (not kwargs or _all_plain(kwargs.values()))


def _all_plain(values: Iterable[Any]) -> bool:
    """No value, nor an element of a list or tuple value, is a tensor subclass."""
    for a in values:
        if isinstance(a, Tensor):
            if type(a) is not Tensor:
                return False
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, Tensor) and type(x) is not Tensor:
                    return False
    return True


def first_tensor(value: Any, _depth: int = 0) -> Tensor | None:
    """The tensor a module output stands for: the first tensor in it, depth first.

    A tensor is itself; a tuple or list gives the first tensor among its elements (so element 0
    when that is a tensor, and `(None, x)` or `(("a", (x, 2)), y)` give `x`); a mapping (a dict,
    a `ModelOutput`) gives the first tensor among its values. Anything else has none.
    """
    if isinstance(value, Tensor):
        return value
    if _depth < 8:
        if isinstance(value, Mapping):
            value = value.values()
        elif not isinstance(value, (tuple, list)):
            return None
        for v in value:
            t = first_tensor(v, _depth + 1)
            if t is not None:
                return t
    return None


def replace_first(value: Any, fn: Any, _depth: int = 0) -> Any:
    """`value` with the tensor `first_tensor(value)` finds replaced by `fn(tensor)`.

    Tuples and lists are rebuilt (a named tuple as its own type); a mapping (a dict, a
    `ModelOutput`) has the entry set in place. Returns `value` unchanged when it holds no tensor.
    """
    if isinstance(value, Tensor):
        return fn(value)
    if _depth >= 8:
        return value
    if isinstance(value, Mapping):
        for k, v in value.items():
            if first_tensor(v) is not None:
                # set in place, as the model's own mapping (a read-only one raises, as it would for the model)
                value[k] = replace_first(v, fn, _depth + 1)  # type: ignore[index]
                break
        return value
    if isinstance(value, (tuple, list)):
        items = list(value)
        for i, v in enumerate(items):
            if first_tensor(v) is not None:
                items[i] = replace_first(v, fn, _depth + 1)
                break
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def replace_input(args: tuple, kwargs: dict, fn: Any) -> tuple[tuple, dict]:
    """(args, kwargs) with the module input `_enter` reads (the first positional argument when it
    is a tensor, else with no positional arguments the first tensor keyword argument) replaced."""
    if args:
        if isinstance(args[0], Tensor):
            return (fn(args[0]),) + tuple(args[1:]), kwargs
        return args, kwargs
    for k, v in kwargs.items():
        if isinstance(v, Tensor):
            return args, {**kwargs, k: fn(v)}
    return args, kwargs


def refuse_script_modules(names: dict[nn.Module, str]) -> None:
    """Raise `CaptureError` naming the first `torch.jit.script`ed module of the model.

    TorchScript runs a scripted module's forward in its own interpreter: it takes no forward
    hooks and its ops never reach a torch function mode, so nothing inside it could be recorded.
    """
    for module, addr in names.items():
        if isinstance(module, torch.jit.ScriptModule):
            where = f"module {addr!r}" if addr else "the model itself"
            raise CaptureError(
                f"{where} is a torch.jit.ScriptModule ({type(module).__name__}): TorchScript runs its "
                "forward in its own interpreter, which takes no module hooks and hides its ops, so "
                "TorchLens cannot record it. Trace the eager module instead: keep the module you "
                f"passed to torch.jit.script (or torch.jit.trace) and put it back before tracing"
                + (f" (model.{addr} = eager_module)" if addr else "")
                + ", or build the model without scripting."
            )

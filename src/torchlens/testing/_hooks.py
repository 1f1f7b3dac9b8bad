"""Ground truth from outside TorchLens: what a model's modules returned, read with plain forward
hooks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def hooked_outputs(
    model: torch.nn.Module, addresses: Iterable[str], *args: Any, **kwargs: Any
) -> dict[str, torch.Tensor]:
    """Run `model(*args, **kwargs)` once under `no_grad` and return what plain forward hooks saw.

    This is ground truth from outside TorchLens: one `register_forward_hook` per address, each
    cloning the module's output (the first element when the module returns a tuple) as it was
    returned. The hooks are removed before this returns, also when the forward raises.

    Args:
        model: the model.
        addresses: module addresses as `model.named_modules()` spells them.
        *args: the forward's positional arguments.
        **kwargs: the forward's keyword arguments.

    Returns:
        address -> the output tensor, for each address whose module ran (a module that ran more
        than once keeps its last output).

    Raises:
        KeyError: an address is not a module of `model`.

    Examples:
        >>> from torchlens import testing
        >>> model = testing.build("gpt2")
        >>> out = testing.hooked_outputs(model, ["transformer.h.1", "lm_head"], testing.token_ids(length=3))
        >>> {a: tuple(t.shape) for a, t in out.items()}
        {'transformer.h.1': (1, 3, 32), 'lm_head': (1, 3, 64)}
        >>> testing.hooked_outputs(model, ["transformer.h.7"], testing.token_ids())
        Traceback (most recent call last):
        KeyError: "not modules of GPT2LMHeadModel: ['transformer.h.7']"
    """
    seen: dict[str, torch.Tensor] = {}
    mods = dict(model.named_modules())
    wanted = list(addresses)
    missing = [a for a in wanted if a not in mods]
    if missing:
        raise KeyError(f"not modules of {type(model).__name__}: {missing}")
    handles = []
    try:
        for a in wanted:

            def hook(module, hook_args, out, a=a):
                seen[a] = (out[0] if isinstance(out, tuple) else out).detach().clone()

            handles.append(mods[a].register_forward_hook(hook))
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen

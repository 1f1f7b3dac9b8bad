"""The full forward a decode step is held against: its arguments, rebuilt from what the steps
received (every token fed so far, the step's attention mask, the position ids that mask implies,
no cache), the sites the step saved, and the rerun that saves the same sites."""

from __future__ import annotations

import copy
import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from torchlens._core.errors import GenerateSpecError
from torchlens._tracing import trace

if TYPE_CHECKING:
    from torchlens._generation.result import GenerationTrace
    from torchlens._trace import Trace

__all__ = ["reference_kwargs", "rerun", "saved_sites", "takes"]


def takes(model: nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def reference_kwargs(gen: GenerationTrace, step: int, shift: int = 0) -> dict[str, Any]:
    """The keyword arguments of the full forward that step `step` is held against."""
    model = gen.model
    assert model is not None  # `check_decode` refuses a generation that holds no model
    info = gen.info
    fed = [info[s].input_ids for s in range(step + 1)]
    if any(t is None for t in fed):
        raise GenerateSpecError(
            f"step {step}: a step up to it was fed no input_ids (inputs_embeds), so the full forward "
            "over the prefix cannot be rebuilt from the tokens."
        )
    ids = torch.cat([t for t in fed if t is not None], dim=-1)
    encdec = gen.encoder_decoder
    mask = info[step].attention_mask
    if mask is None or mask.dim() != 2 or mask.shape[-1] != ids.shape[-1]:
        # a static cache's 4D mask, a dict of masks, none: the 2D mask generate keeps, which is the
        # call's mask with a 1 for every token fed since
        given = None if encdec else gen._call.get("kwargs", {}).get("attention_mask")
        if isinstance(given, Tensor) and given.dim() == 2 and given.shape[-1] <= ids.shape[-1]:
            ones = given.new_ones(given.shape[0], ids.shape[-1] - given.shape[-1])
            mask = torch.cat([given, ones], dim=-1)
        else:
            mask = None if encdec else torch.ones_like(ids)
    if encdec:
        call = gen._call
        # the decoder's ids first: the root's `input` facet is its first tensor argument, as at the step
        kwargs: dict[str, Any] = {
            "decoder_input_ids": ids,
            "input_ids": gen.prompt,
            "use_cache": False,
        }
        if call.get("kwargs", {}).get("attention_mask") is not None:
            kwargs["attention_mask"] = call["kwargs"]["attention_mask"]
        if mask is not None:
            kwargs["decoder_attention_mask"] = mask
        return kwargs
    kwargs = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
    assert mask is not None  # None only for an encoder-decoder, which returned above
    if takes(model, "position_ids"):
        # padding's own positions are masked: their value (0 here, as generate sets it) changes nothing
        pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        if shift:
            pos = pos.clone()
            pos[:, info[0].new_tokens :] += shift
        kwargs["position_ids"] = pos
    return kwargs


def saved_sites(step_trace: Trace) -> list[tuple[Any, str]]:
    """(module call, facet) of every site the step saved, in forward order: by the op that
    produced the site (a site computed after the forward, by the end of its call)."""
    found = []
    for rec in step_trace.modules.values():
        for c in rec.calls:
            if c.facets is None:
                continue
            for rank, (name, site) in enumerate(c.facets.sites.items()):
                if site.saved:
                    where = site.op if site.op is not None else max(c.end_op - 1, c.first_op)
                    found.append(((where, -c.first_op, rank), c, name))
    found.sort(key=lambda x: x[0])
    return [(c, name) for _, c, name in found]


def rerun(
    model: nn.Module, kwargs: dict, wanted: set[tuple[str, str]], dtype: torch.dtype | None = None
) -> Trace:
    if dtype is not None:
        model = copy.deepcopy(model).to(dtype)
    with torch.no_grad():
        return trace(model, save=lambda address, facet: (address, facet) in wanted, **kwargs)

"""Lining an engine's tensor up with the trace's: the engine's value as a CPU tensor, the
TorchLens tensor in each layout `compare` accepts, the nearest of them, and the differences."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from torchlens._naming.layouts import fitting
from torchlens._naming.pool import mask_floor


def layouts(
    ref: Tensor, engine_shape: tuple[int, ...], facet: str, broadcasts: bool = True
) -> list[tuple[str, Tensor]]:
    """The TorchLens tensor in each layout `compare` accepts (`_naming.layouts`) that gives the engine's shape."""
    return fitting(ref, tuple(engine_shape), facet, broadcasts=broadcasts)


def closest(
    engine: Tensor, options: list[tuple[str, Tensor]], facet: str
) -> tuple[str, float, Tensor, Tensor]:
    """Of the layouts `options` (not empty), the one nearest the engine's tensor: its label, the
    largest difference, the converted tensor and the elementwise differences."""
    best: tuple[str, float, Tensor, Tensor] | None = None
    for label, t in options:
        err, d = diff(engine, t, facet)
        if best is None or err < best[1]:
            best = (label, err, t, d)
    assert best is not None  # options is not empty
    return best


def diff(engine: Tensor, ref: Tensor, facet: str) -> tuple[float, Tensor]:
    """The largest absolute difference and the elementwise ones, in float32 (NaN counts as
    infinitely far); for `scores`, a masked entry equals a masked entry whatever the fill."""
    e, r = engine.float(), ref.float()
    if facet == "scores":  # a masked entry is masked whichever fill each side uses
        # (-inf or the minimum of each side's own dtype: float16's is -65504)
        e_masked, r_masked = e <= mask_floor(engine.dtype), r <= mask_floor(ref.dtype)
        same_mask = e_masked == r_masked
        d = torch.where(e_masked & r_masked, torch.zeros_like(e), (e - r).abs())
        d = torch.where(same_mask, d, torch.full_like(d, float("inf")))
    else:
        d = (e - r).abs()
    d = d.nan_to_num(nan=float("inf"))
    return (float(d.max()) if d.numel() else 0.0), d


def engine_tensor(value: Any) -> tuple[Tensor, tuple, str]:
    """(element 0 as a CPU tensor, the other elements, hint) for what the engine handed.

    Raises:
        TypeError, ValueError, RuntimeError: what it handed holds no tensor (None, an empty
            tuple, an object torch cannot make a tensor of); `compare` makes that a failed row.
    """
    rest: tuple = ()
    hint = ""
    if isinstance(value, (tuple, list)) and not value:
        raise TypeError(f"an empty {type(value).__name__}")
    if isinstance(value, (tuple, list)):
        hint = f"engine value is a {type(value).__name__} of {len(value)}: compared element 0"
        value, rest = value[0], tuple(value[1:])
    if not isinstance(value, Tensor):
        value = getattr(value, "value", value)  # proxies that wrap a saved value
    if value is None:
        raise TypeError("None")
    engine = torch.as_tensor(value) if not isinstance(value, Tensor) else value
    return engine.detach().cpu(), tuple(getattr(r, "value", r) for r in rest), hint

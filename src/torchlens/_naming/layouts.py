"""The layouts an engine's tensor may come in, and the conversions between them and a site's.

`compare` accepts a tensor in any *accepted* conversion of the site (batch dimension dropped,
heads flattened, `z` token-major, key/value heads repeated per query head, a `[batch*pos, d]`
site unflattened, ...); the diagnosis of a mismatch also tries the conversions that are
mistakes (head-major instead of token-major, kv heads tiled instead of repeated) and names them.
Both read them here, so they agree on which conversion is a layout and which one is a bug.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from torchlens._core.facet_spec import (
    HEAD_MAJOR,
    KV_HEADS,
    NORM_FACETS,
    PER_HEAD,
    TOKEN_MAJOR,
    tokens_flattened,
)

__all__ = ["Conversion", "apply", "conversions", "fitting", "inverse", "norm_factor"]


class Conversion(NamedTuple):
    """One way to bring a site's tensor to an engine's shape.

    Attributes:
        label: what the conversion does, as a comparison row shows it (`"batch dropped, heads
            flattened"`, `"as is"`); for a mistake, what the mistake is.
        accepted: whether `compare` accepts a tensor in this layout (otherwise the conversion
            names a mistake the diagnosis reports).
        steps: what `apply` does, in order.
    """

    label: str
    accepted: bool
    steps: tuple


def conversions(
    c_shape: tuple[int, ...],
    e_shape: tuple[int, ...],
    facet: str | None,
    *,
    broadcasts: bool = False,
) -> list[Conversion]:
    """The conversions of a site's tensor of `c_shape` (the site's facet `facet`) that give `e_shape`.

    With `broadcasts`, where no other accepted conversion fits, also the two that copy the site's
    values: a batch-1 tensor broadcast over the engine's batch (a position embedding), and a
    norm's tensor copied per head (TransformerLens's `use_split_qkv_input`).
    """
    c_shape, e_shape = tuple(c_shape), tuple(e_shape)
    if tokens_flattened(c_shape, e_shape):  # the model flattened [batch, pos] (OPT's MLP)
        return [Conversion("tokens unflattened", True, (("reshape", e_shape),))]
    found: list[Conversion] = []
    majors: list[tuple[str, bool, tuple, tuple]] = [("", True, (), c_shape)]
    if len(c_shape) == 4:
        swapped = (c_shape[0], c_shape[2], c_shape[1], c_shape[3])
        if facet in HEAD_MAJOR:
            label, ok = "token-major", facet in PER_HEAD  # accepted for z, not for scores/pattern
        elif facet in TOKEN_MAJOR:
            label, ok = "head-major instead of token-major", False
        else:
            label, ok = "axes 1 and 2 swapped", False
        majors.append((label, ok, (("swap",),), swapped))
    for mlabel, mok, msteps, mshape in majors:
        kvs: list[tuple[str, bool, tuple, tuple]] = [("", True, (), mshape)]
        if facet in KV_HEADS and len(mshape) == 4:
            axis = 1 if mlabel and facet in TOKEN_MAJOR else 2
            wanted = set(e_shape) | (
                {e_shape[-1] // mshape[3]} if mshape[3] and e_shape[-1] % mshape[3] == 0 else set()
            )
            for target in sorted(wanted):
                if target > mshape[axis] and target % mshape[axis] == 0:
                    rep = target // mshape[axis]
                    grown = mshape[:axis] + (target,) + mshape[axis + 1 :]
                    # repeated per query head, as attention uses them: a layout, also head-major
                    # (the kernel's own layout, [batch, heads, pos, d_head])
                    kvs.append(("kv heads repeated", True, (("interleave", axis, rep),), grown))
                    kvs.append(
                        (
                            "kv heads tiled (repeat) instead of repeated per head (repeat_interleave)",
                            False,
                            (("tile", axis, rep),),
                            grown,
                        )
                    )
        for klabel, kok, ksteps, kshape in kvs:
            repeated = klabel == "kv heads repeated"
            batches: list[tuple[str, bool, tuple[tuple[Any, ...], ...], tuple[int, ...]]] = [
                ("", True, (), kshape)
            ]
            if kshape and kshape[0] == 1:
                batches.append(("batch dropped", True, (("drop",),), kshape[1:]))
            for blabel, bok, bsteps, bshape in batches:
                flats: list[tuple[str, bool, tuple[tuple[Any, ...], ...], tuple[int, ...]]] = [
                    ("", True, (), bshape)
                ]
                if len(bshape) >= 3:
                    flats.append(
                        (
                            "heads flattened",
                            facet in PER_HEAD,
                            (("flat",),),
                            bshape[:-2] + (bshape[-2] * bshape[-1],),
                        )
                    )
                for flabel, fok, fsteps, fshape in flats:
                    if fshape != e_shape:
                        continue
                    ok = (mok or repeated) and kok and bok and fok
                    if (
                        repeated and ok
                    ):  # the major axis is the kernel's own: the row names what was repeated
                        rest = ", ".join(x for x in (blabel, flabel) if x) or "as is"
                        # head-major (the kernel's [batch, heads, pos, d_head]) said, so that
                        # `compare` can tell it from token-major where the two have one shape
                        major = "head-major, " if mlabel else ""
                        label = f"kv heads repeated, {major}{rest}"
                    else:
                        label = (
                            ", ".join(x for x in (mlabel, klabel, blabel, flabel) if x) or "as is"
                        )
                    found.append(Conversion(label, ok, msteps + ksteps + bsteps + fsteps))
    if broadcasts and not any(c.accepted for c in found):
        n = len(c_shape)
        if n == len(e_shape) >= 2 and c_shape[0] == 1 < e_shape[0] and c_shape[1:] == e_shape[1:]:
            found.append(
                Conversion("batch broadcast", True, (("expand", e_shape),))
            )  # one row for every sequence
        elif (
            facet in NORM_FACETS
            and len(e_shape) == n + 1 >= 4
            and e_shape[:2] == c_shape[:2]
            and e_shape[3:] == c_shape[2:]
        ):
            found.append(Conversion("repeated per head", True, (("per_head", e_shape),)))
    return found


def fitting(
    t: Tensor, e_shape: tuple[int, ...], facet: str | None, *, broadcasts: bool = False
) -> list[tuple[str, Tensor]]:
    """`t` (a site's tensor) in each accepted conversion that gives `e_shape`, with its label."""
    return [
        (c.label, apply(t, c.steps))
        for c in conversions(tuple(t.shape), tuple(e_shape), facet, broadcasts=broadcasts)
        if c.accepted
    ]


def apply(t: Tensor, steps: tuple) -> Tensor:
    """`t` converted by `steps` (a `Conversion`'s)."""
    for s in steps:
        if s[0] == "swap":
            t = t.transpose(1, 2)
        elif s[0] == "interleave":
            t = t.repeat_interleave(s[2], dim=s[1])
        elif s[0] == "tile":
            reps = [1] * t.dim()
            reps[s[1]] = s[2]
            t = t.repeat(*reps)
        elif s[0] == "drop":
            t = t[0]
        elif s[0] == "flat":
            t = t.flatten(-2)
        elif s[0] == "reshape":
            t = t.reshape(s[1])
        elif s[0] == "expand":
            t = t.expand(s[1])
        elif s[0] == "per_head":
            t = t.unsqueeze(2).expand(s[1])
    return t


def inverse(e: Tensor, c_shape: tuple[int, ...], steps: tuple) -> Tensor:
    """`e` brought back to the layout of a `c_shape` tensor, undoing `steps` (reshapes and transposes)."""
    shapes = [tuple(c_shape)]
    t = torch.empty(c_shape, device="meta")
    for st in steps:
        t = apply(t, (st,))
        shapes.append(tuple(t.shape))
    for st, before in zip(reversed(steps), reversed(shapes[:-1])):
        if st[0] == "swap":
            e = e.transpose(1, 2)
        else:
            e = e.reshape(before)
    return e.contiguous()


def norm_factor(steps: tuple) -> float:
    """How a conversion scales the norm (repeating heads r times scales it by sqrt(r))."""
    f = 1.0
    for s in steps:
        if s[0] in ("interleave", "tile"):
            f *= math.sqrt(s[2])
    return f

"""`compare`'s row for an activation: the engine's tensor against the trace's at the name's site,
in the nearest accepted layout, with a hint and, for a failed row, what the tensor equals
(`_naming.diagnose`)."""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch
from torch import Tensor

from torchlens._core.facet_spec import HEAD_MAJOR, KERNEL_REBUILT
from torchlens._naming.diagnose import diagnose
from torchlens._naming.results import AliasResolution
from torchlens.mechinterp._comparison import Comparison
from torchlens.mechinterp._lineup import closest, diff, engine_tensor, layouts


def value_row(
    trace, name, value, res: AliasResolution, tol, editable, generation, explain
) -> Comparison:
    """`compare`'s row for one engine tensor against the tensor `res` resolves to.

    `tol` is `(atol, rtol, dtype name or None, note)`: the dtype name where `tolerance="auto"`
    set atol and rtol, the note where it could not.
    """
    atol, rtol, auto_dtype, auto_note = tol
    hints = [auto_note] if auto_note else []
    not_a_tensor = ""
    try:
        engine, rest, tuple_hint = engine_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        engine, rest, tuple_hint = torch.empty(()), (), ""  # a 0-d stand-in: its row has shape ()
        not_a_tensor = (
            f"the engine's value is not a tensor ({type(value).__name__}: {exc}): compare takes a tensor, "
            "or a tuple or list whose element 0 is one, per name"
        )
    if tuple_hint:
        hints.append(tuple_hint)

    def row(status, passed, hint, ref_shape=None, layout="as is", err=None, ambiguous=False):
        explanation, candidates = "", cast(tuple, ())
        if (
            not passed
            and not ambiguous  # the values match: the hint says why the row does not pass
            and explain
            and engine.is_floating_point()
            and engine.numel() > 1
        ):
            try:
                explanation, candidates = diagnose(
                    trace,
                    engine,
                    res.module_address if res.readable else None,
                    res.facet if res.readable else None,
                    generation or res.generation,
                    atol,
                    rtol,
                    rest,
                )
            except Exception as exc:  # the row's verdict stands; say why it has no explanation
                explanation = f"no explanation: the search failed ({type(exc).__name__}: {exc})"
        return Comparison(
            name,
            status,
            res.module_address,
            res.facet,
            tuple(engine.shape),
            ref_shape,
            layout,
            err,
            passed,
            "; ".join(hints + ([hint] if hint else [])),
            explanation,
            candidates,
            (atol, rtol),
        )

    if not_a_tensor:
        return row(res.status, False, not_a_tensor)
    if not res.readable:
        return row(
            res.status, False, f"no readable TorchLens site: {res.reason} {res.remedy}".strip()
        )
    if editable and res.status == "reconstructed_read_only":
        return row(
            res.status,
            False,
            "not compared: editable=True, and TorchLens only reconstructs this site "
            "(read-only): an engine writing it "
            "edits a tensor the eager model never materializes; trace with attn_implementation='eager'",
        )
    assert res.tensor is not None and res.facet is not None  # a readable resolution has both
    ref = res.tensor.detach().cpu()
    if engine.dtype != ref.dtype:
        hints.append(
            f"dtypes differ (engine {str(engine.dtype)[6:]}, TorchLens {str(ref.dtype)[6:]})"
        )
    options = layouts(ref, engine.shape, res.facet)
    if not options:
        return row(
            res.status,
            False,
            f"shapes do not line up under any layout conversion "
            f"(engine {list(engine.shape)}, TorchLens {list(ref.shape)})",
            tuple(ref.shape),
        )
    label, err, t, d = closest(engine, options, res.facet)
    scale = _scale(t)
    passed = _within(d, scale, atol, rtol)
    hint = ""
    # the layouts of the same shape that read the values differently (asked only of a match)
    others = (
        [o for o in options if o[1] is not t and not _fits(engine, o[1], res.facet, atol, rtol)]
        if passed and len(options) > 1
        else []
    )
    ambiguous = bool(others) and not _names_layout(label, res.facet)
    if ambiguous:
        # The engine's shape fits several layouts that read the values differently (heads and
        # positions of one size), and it matches under one the names do not use (every naming
        # generation is token-major): a forgotten transpose matches there, so that is no proof.
        passed = False
        hint = (
            f"ambiguous layout: the values match read {label}, but the engine's shape "
            f"{list(engine.shape)} also fits {', '.join(sorted({repr(o[0]) for o in others}))}, where they "
            "differ (two axes of one size, such as heads and positions): compare on an input whose length "
            "differs from the head count to tell the layouts apart"
        )
    elif not passed:
        hint = _mismatch_hint(trace, res, d, atol, rtol, scale, engine, t)
        if (
            auto_dtype is not None
        ):  # the precision is accounted for: keep only a hint about something else
            note = f"tolerance='auto' at {auto_dtype} precision: atol {atol:.2g}, rtol {rtol:.2g}"
            hint = note if hint.startswith("half-precision") else f"{note}; {hint}"
    return row(res.status, passed, hint, tuple(ref.shape), label, err, ambiguous)


def _names_layout(label: str, facet: str) -> bool:
    """Whether the conversion `label` gives the layout the naming generations use for `facet`:
    token-major (TorchLens keeps z head-major, so its token-major conversion is theirs; q, k and v
    token-major, so theirs is any conversion not labelled head-major)."""
    return "token-major" in label if facet in HEAD_MAJOR else "head-major" not in label


def _scale(t: Tensor) -> Tensor:
    """The magnitudes `rtol` is taken of: TorchLens's values, infinities (a masked score's
    fill) and NaNs counted as 0."""
    return t.float().abs().nan_to_num(posinf=0.0, neginf=0.0)


def _within(d: Tensor, scale: Tensor, atol: float, rtol: float) -> bool:
    """Whether the differences `d` pass: each at most `atol + rtol * scale`."""
    return bool((d <= atol + rtol * scale).all())


def _fits(engine: Tensor, t: Tensor, facet: str, atol: float, rtol: float) -> bool:
    """Whether `engine` equals `t` as `value_row` passes a row (`_within` of their `diff`)."""
    _, d = diff(engine, t, facet)
    return _within(d, _scale(t), atol, rtol)


def _equals_facet(trace, res: AliasResolution, facet: str, engine: Tensor, atol, rtol) -> bool:
    """Whether the engine tensor equals another facet of the same module (in some layout)."""
    try:
        # AliasResolution.tensor reads the call the alias names (a block object run for several layers)
        other = replace(res, facet=facet, trace=trace).tensor
    except Exception:  # the module has no such facet, or it was not kept
        return False
    if not isinstance(other, Tensor):
        return False
    other = other.detach().cpu()
    return any(
        _fits(engine, t, facet, atol, rtol)
        for _, t in layouts(other, engine.shape, facet, broadcasts=False)
    )


def _mismatch_hint(
    trace, res: AliasResolution, d: Tensor, atol, rtol, scale, engine: Tensor, ref: Tensor
) -> str:
    bad = d > atol + rtol * scale
    if res.facet == "normalized" and _equals_facet(trace, res, "output", engine, atol, rtol):
        return (
            "the engine's tensor is this norm's output, after the gain and bias: TransformerLens 2.x hooks "
            "hook_normalized there on an unfolded LayerNorm (fold_ln=False); TorchLens's normalized is the "
            "tensor before the gain, which a folded model (fold_ln=True) hooks"
        )
    if res.status == "reconstructed_read_only":
        if res.facet in KERNEL_REBUILT:
            return "TorchLens rebuilt this site from a fused kernel's inputs; compare an eager-attention copy to be sure"
        return (
            "TorchLens computed this site from recorded tensors; check the engine's convention for it"
            + (f" ({res.note})" if res.note else "")
        )
    if engine.dtype in (torch.bfloat16, torch.float16) or ref.dtype in (
        torch.bfloat16,
        torch.float16,
    ):
        return "half-precision run: loosen atol/rtol to the engine's precision"
    if bad.dim() >= 2 and ref.dim() >= 2:
        per_pos = bad.flatten(0, -2).any(-1) if bad.dim() > 2 else bad.any(-1)
        if 0 < int(per_pos.sum()) < per_pos.numel() // 2:
            return "only some positions differ: check padding and the attention mask on both sides"
    return "a different tensor: the engine's hook may sit before/after another op (dropout, norm, cast) or a fused kernel"

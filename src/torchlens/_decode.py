"""The decode-path check: each cached decode step of a generation held against a full forward.

A decode forward computes one new position per row and reads every earlier position's keys and
values from the KV cache. The same values come out of one forward over the whole prefix without
a cache, so that forward is the reference for the step (`check_decode`):

- the reference of decode step `i` runs the model on every token fed up to step `i` (the prompt
  and the tokens fed at steps `1..i`), with step `i`'s attention mask, the position ids that mask
  implies (`cumsum - 1`, as `generate` derives them; only where the model's forward
  takes `position_ids`) and `use_cache=False`: nothing of the cached path is reused;
- every site the step saved is compared with the reference's site at the step's own positions
  (the last `new` positions of the prefix); an attention score or pattern is compared key by
  key at the absolute positions the step attended to: all of them (a dynamic cache), the first
  ones of a static cache's buffer (whose unused slots must get no weight), or the last ones (a
  sliding-window cache, whose dropped positions the reference must give no weight either);
- the tolerance of a site is set from its dtype much as `compare(tolerance="auto")` sets it: a
  copy of the model is run in float64 on the same inputs, and the step passes at a site when
  `|step - full| <= AUTO_FACTOR * (max|full - full64| + eps * |full|)`, element by element. The
  relative term is `AUTO_FACTOR` units in the last place rather than compare's one: the step and
  the full forward run the same kernels in the same dtype over other shapes (one row against the
  prefix), which round differently by a few units in the last place, also where the model computes
  in float32 whatever its dtype (T5's norm), so that the float64 copy does not bound them.

A step that differs is explained (`StepVerdict.explanation`): the first site that differs, in
forward order, and what the step computed instead, by testing what goes wrong in a cached path:

- keys the reference masks but the step attended to: padding of a row (a padded row's cache
  not masked), positions outside the model's sliding window (a window applied on the prefill
  only), or others;
- keys the reference attends to but the step did not, or whose score alone differs: when they
  are the step's own positions, the step read the cache before writing its new keys into it;
- the step's values equal a full forward whose positions computed at decode steps are shifted by
  `d` (rerun for `d` in 1, -1, 2, -2): the decode forward's position ids are off by `d` (RoPE
  rotates at the wrong angle, a learned position embedding reads the wrong row).

Every hypothesis that was tested is a [`Candidate`][torchlens.mechinterp.Candidate] of the step,
matched or not, with its error.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from torchlens._core import html
from torchlens._core.errors import GenerateSpecError, LookupFailed
from torchlens._core.facet_spec import BY_NAME
from torchlens._naming.diagnose import Candidate
from torchlens._tracing import trace

if TYPE_CHECKING:
    from torchlens._generate import GenerationTrace
    from torchlens._trace import Trace

__all__ = ["AUTO_FACTOR", "DecodeReport", "DecodeRow", "StepVerdict", "check_decode"]

#: How far from the full forward a decode step may be, in units of the full forward's own distance
#: from float64 at the site: the factor `compare(tolerance="auto")` uses
#: (`mechinterp._auto_tolerance.AUTO_FACTOR`; a test keeps the two equal).
AUTO_FACTOR = 4
#: The shifts of the decode positions tried when explaining a step that differs.
SHIFTS = (1, -1, 2, -2)
_MASKED = torch.finfo(torch.float32).min / 2


@dataclass
class DecodeRow:
    """One site of one decode step, compared with the full forward.

    Attributes:
        step: the step (`GenerationTrace.steps[step]`).
        site: `"address:facet"` (with `" (call n)"` for a module's later calls).
        module_address: the module.
        call: the module's call within the step's forward.
        facet: the facet.
        shape: the step's tensor's shape.
        reference_shape: the full forward's tensor's shape, before taking the step's positions.
        layout: how the two were lined up: `"last N positions"`, and for scores and patterns how
            the step's keys map to the prefix's positions.
        max_abs_error: the largest absolute difference.
        passed: whether every element is within tolerance.
        tolerance: `(atol, rtol)` of the row.
        hint: a note on the row (what the tolerance rests on, a site the full forward lacks).
    """

    step: int
    site: str
    module_address: str
    call: int
    facet: str
    shape: tuple[int, ...]
    reference_shape: tuple[int, ...] | None
    layout: str
    max_abs_error: float | None
    passed: bool
    tolerance: tuple[float, float] | None
    hint: str = ""


@dataclass
class StepVerdict:
    """One decode step's verdict.

    Attributes:
        step: the step.
        passed: every row of the step passed.
        rows: how many sites were compared.
        first: the first row that failed, in forward order (None when the step passed).
        explanation: for a step that failed, where it first differs and what explains it, in
            words; `""` for a step that passed.
        candidates: the hypotheses tested (`Candidate.matches` says which held), best first.
    """

    step: int
    passed: bool
    rows: int
    first: DecodeRow | None = None
    explanation: str = ""
    candidates: tuple[Candidate, ...] = ()


class DecodeReport(list):
    """The rows `check_decode` returns (a list of [`DecodeRow`][torchlens.DecodeRow]), with a
    verdict per step (`steps`); prints as one line per step."""

    def __init__(self, rows=(), steps: dict[int, StepVerdict] | None = None):
        super().__init__(rows)
        self.steps: dict[int, StepVerdict] = dict(steps or {})

    @property
    def ok(self) -> bool:
        """True when every site of every checked step agreed."""
        return all(v.passed for v in self.steps.values()) and all(r.passed for r in self)

    @property
    def failed_steps(self) -> list[int]:
        """The steps with a row that failed."""
        return [s for s, v in self.steps.items() if not v.passed]

    @property
    def mismatched(self) -> list[tuple[int, str]]:
        """`(step, site)` of every row that failed."""
        return [(r.step, r.site) for r in self if not r.passed]

    @property
    def explanation(self) -> str:
        """The explanation of the first step that failed (`""` when every step passed)."""
        bad = self.failed_steps
        return self.steps[bad[0]].explanation if bad else ""

    def __repr__(self) -> str:
        if not self.steps:
            return "DecodeReport([])"
        lines = [
            f"decode check: {len(self.steps)} steps, {len(self)} sites, "
            f"{'every site agrees with a full forward' if self.ok else f'{len(self.failed_steps)} steps differ'}"
        ]
        for s, v in self.steps.items():
            worst = max((r.max_abs_error or 0.0 for r in self if r.step == s), default=0.0)
            line = f"  step {s:>3}: {'ok ' if v.passed else 'BAD'} {v.rows:>4} sites, max |diff| {worst:.3g}"
            if not v.passed:
                line += f"\n           {v.explanation}"
            lines.append(line)
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = []
        for s, v in self.steps.items():
            worst = max((r.max_abs_error or 0.0 for r in self if r.step == s), default=0.0)
            rows.append(
                [
                    html.esc(s),
                    "ok" if v.passed else "<b>differs</b>",
                    html.esc(v.rows),
                    html.esc(f"{worst:.3g}"),
                    html.esc(v.explanation),
                ]
            )
        return html.table(
            ["step", "verdict", "sites", "max |diff|", "explanation"], rows, caption="decode check"
        )


# -- the reference forward ---------------------------------------------------------------------


def _takes(model: nn.Module, name: str) -> bool:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def _reference_kwargs(gen: GenerationTrace, step: int, shift: int = 0) -> dict[str, Any]:
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
    if _takes(model, "position_ids"):
        # padding's own positions are masked: their value (0 here, as generate sets it) changes nothing
        pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        if shift:
            pos = pos.clone()
            pos[:, info[0].new_tokens :] += shift
        kwargs["position_ids"] = pos
    return kwargs


def _saved_sites(step_trace: Trace) -> list[tuple[Any, str]]:
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


def _rerun(
    model: nn.Module, kwargs: dict, wanted: set[tuple[str, str]], dtype: torch.dtype | None = None
) -> Trace:
    if dtype is not None:
        model = copy.deepcopy(model).to(dtype)
    with torch.no_grad():
        return trace(model, save=lambda address, facet: (address, facet) in wanted, **kwargs)


# -- lining a step's tensor up with the full forward's -------------------------------------------


def _axes(facet: str, dec: Tensor, ref: Tensor) -> tuple[int | None, int | None]:
    """(position axis, key axis) of a facet's tensor: from its row's axes, else (input, output,
    a module's own layout) axis 1 where the two differ only there."""
    spec = BY_NAME.get(facet)
    if spec is not None and spec.axes:
        pos = next((i for i, a in enumerate(spec.axes) if a in ("pos", "query")), None)
        key = next((i for i, a in enumerate(spec.axes) if a == "key"), None)
        return pos, key
    if dec.shape == ref.shape or dec.dim() != ref.dim() or dec.dim() < 2:
        return None, None
    same = all(a == b for i, (a, b) in enumerate(zip(dec.shape, ref.shape)) if i != 1)
    return (1, None) if same and dec.shape[1] <= ref.shape[1] else (None, None)


def _diff(step: Tensor, full: Tensor, facet: str) -> Tensor:
    """|step - full| in float64, a masked score equal to a masked score whatever its fill."""
    e, r = step.double(), full.double()
    if facet == "scores":
        em, rm = e <= _MASKED, r <= _MASKED
        d = torch.where(em & rm, torch.zeros_like(e), (e - r).abs())
        d = torch.where(em == rm, d, torch.full_like(d, float("inf")))
        return d.nan_to_num(nan=float("inf"), posinf=float("inf"))
    return (e - r).abs().nan_to_num(nan=float("inf"), posinf=float("inf"))


def _align(facet: str, dec: Tensor, ref: Tensor, new: int) -> tuple[Tensor, Tensor, str] | None:
    """The step's tensor and the full forward's, lined up element by element, and how; None when
    the shapes cannot be lined up.

    The full forward's positions are narrowed to the step's (its last ones). On the key axis of
    scores and patterns, the step's keys are the prefix's positions: all of them, the first ones
    (a static cache's buffer, longer than the prefix: its extra slots are compared against 0 for a
    pattern), or the last ones (a sliding-window cache: the prefix's older positions are compared
    against 0 for a pattern, and left out for scores, which the cache never computed). A step
    with fewer keys than the prefix is also lined up with the first ones (its own positions
    missing), whichever of the two is closer.
    """
    lined = _align_axes(facet, dec, ref, new)
    if lined is None and dec.dim() == ref.dim() and dec.shape != ref.shape:
        # another layout than the facet row's (T5's relative-position bias is [query, key]): the one
        # axis where the step is shorter holds the positions, the step's the last ones
        differ = [i for i in range(dec.dim()) if dec.shape[i] != ref.shape[i]]
        if len(differ) == 1 and dec.shape[differ[0]] < ref.shape[differ[0]]:
            i, n = differ[0], dec.shape[differ[0]]
            return dec, ref.narrow(i, ref.shape[i] - n, n), f"last {n} positions along axis {i}"
    return lined


def _align_axes(
    facet: str, dec: Tensor, ref: Tensor, new: int
) -> tuple[Tensor, Tensor, str] | None:
    pos, key = _axes(facet, dec, ref)
    if pos is None:
        return (dec, ref, "as is") if dec.shape == ref.shape else None
    n = dec.shape[pos]
    if n > ref.shape[pos]:
        return None
    ref = ref.narrow(pos, ref.shape[pos] - n, n)
    layout = f"last {n} positions"
    if key is None:
        return (dec, ref, layout) if dec.shape == ref.shape else None
    kd, kr = dec.shape[key], ref.shape[key]
    others = [i for i in range(dec.dim()) if i != key]
    if any(dec.shape[i] != ref.shape[i] for i in others):
        return None
    if kd == kr:
        return dec, ref, layout + f"; keys: the {kr} positions"
    if kd > kr:  # a static cache's buffer: slots past the prefix
        if facet == "pattern":
            pad = ref.new_zeros(ref.shape[:key] + (kd - kr,) + ref.shape[key + 1 :])
            return (
                dec,
                torch.cat([ref, pad], dim=key),
                layout + f"; keys: {kr} positions, then {kd - kr} empty slots (weight 0)",
            )
        return dec.narrow(key, 0, kr), ref, layout + f"; keys: the first {kr} of {kd} slots"
    # fewer keys than positions: a window's last ones, or (a cache read before its update) the first ones
    options = []
    for where, start in (("last", kr - kd), ("first", 0)):
        if facet == "pattern":
            full = dec.new_zeros(dec.shape[:key] + (kr,) + dec.shape[key + 1 :])
            full.narrow(key, start, kd).copy_(dec)
            pair = (full, ref)
        else:
            pair = (dec, ref.narrow(key, start, kd))
        err = _diff(pair[0], pair[1], facet)
        options.append((float(err.max()) if err.numel() else 0.0, where, pair))
    options.sort(key=lambda o: o[0])
    _, where, (a, b) = options[0]
    return a, b, layout + f"; keys: the {where} {kd} of {kr} positions"


# -- tolerance ---------------------------------------------------------------------------------


def _tolerance(
    facet: str,
    full: Tensor,
    full64: Tensor | None,
    atol: float | None,
    rtol: float | None,
    auto: bool,
) -> tuple[float, float, str]:
    if not auto or full64 is None or not full.is_floating_point():
        return (1e-5 if atol is None else atol), (1e-4 if rtol is None else rtol), ""
    d = _diff(full, full64, facet)
    finite = (
        torch.isfinite(d)
        & torch.isfinite(full64)
        & (full64.abs() < torch.finfo(torch.float32).max / 4)
    )
    dev = float(d[finite].max()) if bool(finite.any()) else 0.0
    return AUTO_FACTOR * dev, AUTO_FACTOR * torch.finfo(full.dtype).eps, ""


# -- explaining a step that differs ------------------------------------------------------------


def _pattern_pair(step_trace: Trace, full: Trace, call, new: int):
    """The step's and the full forward's pattern of one attention call, lined up, or None."""
    try:
        dec = step_trace.modules[call.address].calls[call.index].facets["pattern"]
        ref = full.modules[call.address].calls[call.index].facets["pattern"]
    except (LookupFailed, IndexError):
        return None
    lined = _align("pattern", dec.detach().cpu(), ref.detach().cpu(), new)
    if lined is None:
        return None
    return lined


def _positions(cols: list[int]) -> str:
    cols = sorted(set(cols))
    return ", ".join(map(str, cols[:8])) + (" ..." if len(cols) > 8 else "")


def _key_hypotheses(
    gen: GenerationTrace,
    step: int,
    step_trace: Trace,
    full: Trace,
    rows: list[DecodeRow],
) -> tuple[str, list[Candidate]]:
    """What the attention of the first attention call that differs says: keys attended that the
    full forward masks, keys missing, or only the step's own keys scored differently."""
    bad = [r for r in rows if not r.passed and r.facet in ("pattern", "scores")]
    if not bad:
        return "", []
    info = gen.info[step]
    new = info.new_tokens
    mask = info.attention_mask
    prefix = sum(gen.info[s].new_tokens for s in range(step + 1))
    window = getattr(getattr(gen.model, "config", None), "sliding_window", None)
    out: list[Candidate] = []
    seen = set()
    for r in bad:
        if (r.module_address, r.call) in seen:
            continue
        seen.add((r.module_address, r.call))
        call = step_trace.modules[r.module_address].calls[r.call]
        pair = _pattern_pair(step_trace, full, call, new)
        if pair is None:
            continue
        a, b, layout = pair
        a64, b64 = a.double(), b.double()
        tol = max(r.tolerance[0] if r.tolerance else 0.0, 1e-6)
        kr = b.shape[-1]
        kd = a.shape[-1]
        extra = (a64 > tol) & (b64 <= tol)  # attended, but masked by the full forward
        missing = (b64 > tol) & (a64 <= tol)  # attended by the full forward, not by the step
        site = f"{r.module_address}:pattern"
        if bool(extra.any()):
            cols = [int(c) for c in extra.nonzero()[:, -1].tolist()]
            rows_b = sorted({int(x) for x in extra.nonzero()[:, 0].tolist()})
            mass = float((a64 * extra).sum(-1).max())
            pad = [
                c
                for c in cols
                if c < kr
                and mask is not None
                and c < mask.shape[-1]
                and bool((mask[rows_b, c] == 0).any())
            ]
            if pad and len(pad) == len(cols):
                text = (
                    f"the step attends to padding: row(s) {', '.join(map(str, rows_b))} give weight (up to "
                    f"{mass:.3g}) to key position(s) {_positions(pad)}, which the attention mask marks as padding "
                    f"and the full forward masks: a padded row's cache is not masked at decode"
                )
                out.append(
                    Candidate(
                        site,
                        "keys the full forward masks: padding of a row (the attention mask's 0s)",
                        mass,
                        mass,
                        True,
                        module_address=r.module_address,
                        facet="pattern",
                    )
                )
                return text, out
            if window and all(c < prefix - int(window) for c in cols if c < kr):
                text = (
                    f"the step attends to key position(s) {_positions(cols)}, older than the model's sliding window "
                    f"of {window} (the full forward gives them no weight; up to {mass:.3g} here): the sliding window "
                    f"is not applied at decode (a window applied on the prefill only)"
                )
                out.append(
                    Candidate(
                        site,
                        f"keys outside the sliding window of {window}",
                        mass,
                        mass,
                        True,
                        module_address=r.module_address,
                        facet="pattern",
                    )
                )
                return text, out
            if kd > kr and all(c >= kr for c in cols):
                text = (
                    f"the step gives weight (up to {mass:.3g}) to slot(s) {_positions(cols)} of its cache buffer, past "
                    f"the {kr} positions of the prefix: the unused slots of a static cache are not masked"
                )
                out.append(
                    Candidate(
                        site,
                        "unused slots of a static cache",
                        mass,
                        mass,
                        True,
                        module_address=r.module_address,
                        facet="pattern",
                    )
                )
                return text, out
            out.append(
                Candidate(
                    site,
                    f"keys the full forward masks (positions {_positions(cols)})",
                    mass,
                    mass,
                    False,
                    module_address=r.module_address,
                    facet="pattern",
                )
            )
        own = set(range(prefix - new, prefix))
        if bool(missing.any()):
            cols = sorted({int(c) for c in missing.nonzero()[:, -1].tolist()})
            mass = float((b64 * missing).sum(-1).max())
            if set(cols) <= own:
                text = (
                    f"the step does not attend to its own key(s) (position(s) {_positions(cols)}; the full forward "
                    f"gives them weight up to {mass:.3g}): it read the cache before writing this step's keys into it"
                )
                out.append(
                    Candidate(
                        site,
                        "the step's own keys missing from the keys it read",
                        mass,
                        mass,
                        True,
                        module_address=r.module_address,
                        facet="pattern",
                    )
                )
                return text, out
            out.append(
                Candidate(
                    site,
                    f"keys the step did not attend to (positions {_positions(cols)})",
                    mass,
                    mass,
                    False,
                    module_address=r.module_address,
                    facet="pattern",
                )
            )
        # scores that differ only in the step's own key columns: a stale slot read before the write
        try:
            step_facets = step_trace.modules[r.module_address].calls[r.call].facets
            full_facets = full.modules[r.module_address].calls[r.call].facets
            if step_facets is None or full_facets is None:
                lined = None
            else:
                sd = step_facets["scores"].detach().cpu()
                sf = full_facets["scores"].detach().cpu()
                lined = _align("scores", sd, sf, new)
        except (LookupFailed, IndexError):
            lined = None
        if lined is not None and lined[0].shape[-1] == kr:
            d = _diff(lined[0], lined[1], "scores")
            tol_s = max(tol, 1e-6)
            cols = sorted({int(c) for c in (d > tol_s).nonzero()[:, -1].tolist()})
            if cols and set(cols) <= own:
                err = float(d.max())
                text = (
                    f"the step's scores differ only at its own key position(s) {_positions(cols)} (max |diff| "
                    f"{err:.3g}; every cached key scores as in the full forward): the key it attended to there is not "
                    f"the one it computed: it read the cache before writing this step's keys into it (a stale slot)"
                )
                out.append(
                    Candidate(
                        f"{r.module_address}:scores",
                        "only the step's own keys scored differently",
                        err,
                        err,
                        True,
                        module_address=r.module_address,
                        facet="scores",
                    )
                )
                return text, out
        break  # the first attention call that differs decides
    return "", out


def _shift_hypotheses(
    gen: GenerationTrace, step: int, step_trace: Trace, wanted, sites, first: DecodeRow, tolerances
) -> tuple[str, list[Candidate]]:
    """Whether the step equals a full forward whose decode positions are shifted."""
    model = gen.model
    assert model is not None  # `check_decode` refuses a generation that holds no model
    if gen.encoder_decoder or not _takes(model, "position_ids"):
        return "", []
    out = []
    for shift in SHIFTS:
        full = _rerun(model, _reference_kwargs(gen, step, shift), wanted)
        rows = _compare_sites(
            step,
            step_trace,
            full,
            None,
            sites,
            gen.info[step].new_tokens,
            None,
            None,
            False,
            tolerances,
        )
        failed = [r for r in rows if not r.passed]
        at_first = next((r for r in rows if r.site == first.site), None)
        err = (
            at_first.max_abs_error
            if at_first is not None and at_first.max_abs_error is not None
            else float("inf")
        )
        relation = (
            f"a full forward with the positions computed at decode steps shifted by {shift:+d}"
        )
        out.append(
            Candidate(
                first.site,
                relation,
                err,
                err,
                not failed,
                module_address=first.module_address,
                facet=first.facet,
            )
        )
        if not failed:
            what = (
                "RoPE rotates"
                if any(f in ("rot_q", "rot_k") for _, f in wanted)
                else "the positions are"
            )
            text = (
                f"every site of the step equals a full forward whose decode positions are shifted by {shift:+d}: the "
                f"decode forward's position ids are off by {shift:+d} ({what} at the wrong position; "
                f"first differing site {first.site})"
            )
            out.sort(key=lambda c: (not c.matches, c.error))
            return text, out
    out.sort(key=lambda c: c.error)
    return "", out


# -- comparing -------------------------------------------------------------------------------


def _site_name(call, facet: str) -> str:
    return f"{call.address or '<root>'}:{facet}" + (f" (call {call.index})" if call.index else "")


def _compare_sites(
    step: int,
    step_trace: Trace,
    full: Trace,
    full64: Trace | None,
    sites,
    new: int,
    atol: float | None,
    rtol: float | None,
    auto: bool,
    tolerances: dict | None,
) -> list[DecodeRow]:
    rows = []
    for call, facet in sites:
        name = _site_name(call, facet)
        try:
            dec = step_trace.modules[call.address].calls[call.index].facets[facet]
        except LookupFailed:  # a pending check refused it on this read: the step does not serve it
            continue
        dec = dec.detach().cpu()
        try:
            ref = full.modules[call.address].calls[call.index].facets[facet].detach().cpu()
        except (LookupFailed, IndexError) as exc:
            rows.append(
                DecodeRow(
                    step,
                    name,
                    call.address,
                    call.index,
                    facet,
                    tuple(dec.shape),
                    None,
                    "",
                    None,
                    False,
                    None,
                    f"the full forward has no tensor here ({exc})",
                )
            )
            continue
        lined = _align(facet, dec, ref, new)
        if lined is None:
            rows.append(
                DecodeRow(
                    step,
                    name,
                    call.address,
                    call.index,
                    facet,
                    tuple(dec.shape),
                    tuple(ref.shape),
                    "",
                    None,
                    False,
                    None,
                    "the shapes do not line up (step "
                    f"{list(dec.shape)}, full forward {list(ref.shape)})",
                )
            )
            continue
        a, b, layout = lined
        key = (call.address, call.index, facet)
        if tolerances is not None and key in tolerances:
            at, rt, hint = tolerances[key]
        else:
            b64 = None
            if full64 is not None:
                try:
                    r64 = (
                        full64.modules[call.address].calls[call.index].facets[facet].detach().cpu()
                    )
                    l64 = _align(facet, dec, r64, new)
                    b64 = l64[1] if l64 is not None else None
                except (LookupFailed, IndexError):
                    b64 = None
            at, rt, hint = _tolerance(facet, b, b64, atol, rtol, auto)
            if tolerances is not None:
                tolerances[key] = (at, rt, hint)
        d = _diff(a, b, facet)
        scale = b.double().abs().nan_to_num(posinf=0.0, neginf=0.0)
        if facet == "scores":
            scale = torch.where(b.double() <= _MASKED, torch.zeros_like(scale), scale)
        passed = (
            bool((d <= at + rt * scale).all()) if a.is_floating_point() else bool(torch.equal(a, b))
        )
        err = float(d.max()) if d.numel() else 0.0
        rows.append(
            DecodeRow(
                step,
                name,
                call.address,
                call.index,
                facet,
                tuple(dec.shape),
                tuple(ref.shape),
                layout,
                err,
                passed,
                (at, rt),
                hint,
            )
        )
    return rows


def _step_list(gen: GenerationTrace, steps: Any) -> list[int]:
    n = len(gen.steps)
    if steps is None:
        chosen = [i for i in range(1, n) if gen.info[i].kept]
        if not chosen:
            raise GenerateSpecError(
                "steps: no decode step of this generation kept tensors (steps= of trace_generate kept only "
                f"{[i for i in range(n) if gen.info[i].kept]}), so there is nothing to compare; trace the steps to check, "
                "or name them here."
            )
        return chosen
    items = (
        [steps]
        if isinstance(steps, int) and not isinstance(steps, bool)
        else list(steps)
        if isinstance(steps, (list, tuple, range, set, frozenset))
        else None
    )
    if items is None or any(isinstance(s, bool) or not isinstance(s, int) for s in items):
        raise GenerateSpecError(
            f"steps={steps!r}: give a step number, a range or a list of them (0 is the prefill)."
        )
    for s in items:
        if not 0 <= s < n:
            raise GenerateSpecError(
                f"steps={steps!r}: step {s} is outside the generation (steps 0..{n - 1})."
            )
        if not gen.info[s].kept:
            raise GenerateSpecError(
                f"steps={steps!r}: step {s} kept no tensors (trace_generate's steps= left it out), so it has no site to "
                f"compare; the steps that kept tensors are {[i for i in range(n) if gen.info[i].kept]}."
            )
    return sorted(set(items))


def check_decode(
    gen: GenerationTrace,
    steps: Any = None,
    *,
    tolerance: str | None = "auto",
    atol: float | None = None,
    rtol: float | None = None,
    explain: bool = True,
) -> DecodeReport:
    """Hold each decode step of `gen` against a full forward without the cache (see the module docs).

    Args:
        gen: a [`GenerationTrace`][torchlens.GenerationTrace].
        steps: the steps to check (default: every decode step that kept tensors).
        tolerance: `"auto"` (per site from a float64 rerun of a copy of the model) or None
            (`atol`/`rtol`).
        atol: absolute tolerance for `tolerance=None` (default 1e-5).
        rtol: relative tolerance for `tolerance=None` (default 1e-4).
        explain: explain each step that differs (reruns the full forward under the hypotheses).

    Returns:
        A [`DecodeReport`][torchlens.DecodeReport].

    Raises:
        GenerateSpecError: `steps` names a step outside the generation or one that kept no
            tensors; `tolerance` is not `"auto"` or None; the generation was edited (a full forward
            cannot replay edits made per step); the model was not kept.
    """
    if tolerance not in ("auto", None):
        raise GenerateSpecError(
            f"tolerance={tolerance!r}: pass 'auto' (per site, from a float64 rerun) or None "
            "(atol/rtol)."
        )
    if gen.model is None:
        raise GenerateSpecError(
            "model: this GenerationTrace holds no model (a loaded one), so no full forward can run."
        )
    if gen.edits:
        raise GenerateSpecError(
            "edit=: this generation was edited at steps "
            f"{sorted(gen.edits)}; a full forward over the prefix cannot replay edits made step by step, so the decode "
            "check runs on an unedited generation (trace_generate without edit=)."
        )
    chosen = _step_list(gen, steps)
    model = gen.model
    auto = tolerance == "auto"
    twin = None
    if auto:
        twin = copy.deepcopy(model).to(torch.float64)
    report = DecodeReport()
    for s in chosen:
        step_trace = gen.steps[s]
        new = gen.info[s].new_tokens
        sites = _saved_sites(step_trace)
        wanted = {(c.address, f) for c, f in sites}
        kwargs = _reference_kwargs(gen, s)
        full = _rerun(model, kwargs, wanted)
        full64 = None
        if twin is not None:
            with torch.no_grad():
                full64 = trace(
                    twin,
                    save=lambda address, facet: (address, facet) in wanted,  # noqa: B023  # called in this step
                    **kwargs,
                )
        tolerances: dict = {}
        rows = _compare_sites(s, step_trace, full, full64, sites, new, atol, rtol, auto, tolerances)
        report.extend(rows)
        failed = [r for r in rows if not r.passed]
        verdict = StepVerdict(s, not failed, len(rows))
        if failed:
            first = failed[0]
            verdict.first = first
            if first.max_abs_error is None:
                err = first.hint
            elif first.max_abs_error == float("inf"):
                err = "a key masked on one side only"
            else:
                err = f"max |diff| {first.max_abs_error:.3g}"
            where = (
                f"step {s} first differs from the full forward at {first.site} ({err}); every earlier site of the "
                f"step agrees"
            )
            if explain:
                text, cands = _key_hypotheses(gen, s, step_trace, full, rows)
                if not text:
                    shift_text, shift_cands = _shift_hypotheses(
                        gen, s, step_trace, wanted, sites, first, tolerances
                    )
                    text, cands = shift_text, cands + shift_cands
                verdict.candidates = tuple(cands)
                verdict.explanation = (
                    f"{where}: {text}"
                    if text
                    else (
                        f"{where}. No cache hypothesis explains it (keys masked or unmasked, the step's own keys, positions "
                        f"shifted by {', '.join(f'{d:+d}' for d in SHIFTS)}): compare the first differing site's inputs."
                    )
                )
            else:
                verdict.explanation = where
        report.steps[s] = verdict
    return report

"""Why a decode step differs from its full forward: the hypotheses of a cached path gone wrong,
each tested, in the order the check tries them.

- keys the reference masks but the step attended to: padding of a row (a padded row's cache
  not masked), positions outside the model's sliding window (a window applied on the prefill
  only), unused slots of a static cache, or others;
- keys the reference attends to but the step did not, or whose score alone differs: when they
  are the step's own positions, the step read the cache before writing its new keys into it;
- the step's values equal a full forward whose positions computed at decode steps are shifted by
  `d` (rerun for `d` in `SHIFTS`): the decode forward's position ids are off by `d` (RoPE
  rotates at the wrong angle, a learned position embedding reads the wrong row).

Every hypothesis that was tested is a `Candidate` of the step, matched or not, with its error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchlens._core.errors import LookupFailed
from torchlens._generation.decode_reference import reference_kwargs, rerun, takes
from torchlens._generation.decode_report import DecodeRow
from torchlens._generation.decode_sites import align, compare_sites, diff
from torchlens._naming.diagnose import Candidate

if TYPE_CHECKING:
    from torchlens._generation.result import GenerationTrace
    from torchlens._trace import Trace

__all__ = ["SHIFTS", "key_hypotheses", "shift_hypotheses"]

#: The shifts of the decode positions tried when explaining a step that differs.
SHIFTS = (1, -1, 2, -2)


def _on_pattern(r: Any, what: str, mass: float, matches: bool) -> Candidate:
    """A hypothesis about row `r`'s pattern: `what` the step's keys are, `mass` the weight on them."""
    return Candidate(
        f"{r.module_address}:pattern",
        what,
        mass,
        mass,
        matches,
        module_address=r.module_address,
        facet="pattern",
    )


def _pattern_pair(step_trace: Trace, full: Trace, call, new: int):
    """The step's and the full forward's pattern of one attention call, lined up, or None."""
    try:
        dec = step_trace.modules[call.address].calls[call.index].facets["pattern"]
        ref = full.modules[call.address].calls[call.index].facets["pattern"]
    except (LookupFailed, IndexError):
        return None
    lined = align("pattern", dec.detach().cpu(), ref.detach().cpu(), new)
    if lined is None:
        return None
    return lined


def _positions(cols: list[int]) -> str:
    cols = sorted(set(cols))
    return ", ".join(map(str, cols[:8])) + (" ..." if len(cols) > 8 else "")


def key_hypotheses(
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
                    _on_pattern(
                        r,
                        "keys the full forward masks: padding of a row (the attention mask's 0s)",
                        mass,
                        True,
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
                    _on_pattern(r, f"keys outside the sliding window of {window}", mass, True)
                )
                return text, out
            if kd > kr and all(c >= kr for c in cols):
                text = (
                    f"the step gives weight (up to {mass:.3g}) to slot(s) {_positions(cols)} of its cache buffer, past "
                    f"the {kr} positions of the prefix: the unused slots of a static cache are not masked"
                )
                out.append(_on_pattern(r, "unused slots of a static cache", mass, True))
                return text, out
            out.append(
                _on_pattern(
                    r, f"keys the full forward masks (positions {_positions(cols)})", mass, False
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
                    _on_pattern(r, "the step's own keys missing from the keys it read", mass, True)
                )
                return text, out
            out.append(
                _on_pattern(
                    r,
                    f"keys the step did not attend to (positions {_positions(cols)})",
                    mass,
                    False,
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
                lined = align("scores", sd, sf, new)
        except (LookupFailed, IndexError):
            lined = None
        if lined is not None and lined[0].shape[-1] == kr:
            d = diff(lined[0], lined[1], "scores")
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


def shift_hypotheses(
    gen: GenerationTrace, step: int, step_trace: Trace, wanted, sites, first: DecodeRow, tolerances
) -> tuple[str, list[Candidate]]:
    """Whether the step equals a full forward whose decode positions are shifted."""
    model = gen.model
    assert model is not None  # `check_decode` refuses a generation that holds no model
    if gen.encoder_decoder or not takes(model, "position_ids"):
        return "", []
    out = []
    for shift in SHIFTS:
        full = rerun(model, reference_kwargs(gen, step, shift), wanted)
        rows = compare_sites(
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

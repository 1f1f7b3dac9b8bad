"""The decode-path check: each cached decode step of a generation held against a full forward.

A decode forward computes one new position per row and reads every earlier position's keys and
values from the KV cache. The same values come out of one forward over the whole prefix without
a cache, so that forward is the reference for the step (`check_decode`):

- the reference of decode step `i` runs the model on every token fed up to step `i` (the prompt
  and the tokens fed at steps `1..i`), with step `i`'s attention mask, the position ids that mask
  implies (`cumsum - 1`, as `generate` derives them; only where the model's forward
  takes `position_ids`) and `use_cache=False`: nothing of the cached path is reused
  (`torchlens._generation.decode_reference`);
- every site the step saved is compared with the reference's site at the step's own positions
  (the last `new` positions of the prefix); an attention score or pattern is compared key by
  key at the absolute positions the step attended to: all of them (a dynamic cache), the first
  ones of a static cache's buffer (whose unused slots must get no weight), or the last ones (a
  sliding-window cache, whose dropped positions the reference must give no weight either)
  (`torchlens._generation.decode_sites`);
- the tolerance of a site is set from its dtype much as `compare(tolerance="auto")` sets it: a
  copy of the model is run in float64 on the same inputs, and the step passes at a site when
  `|step - full| <= AUTO_FACTOR * (max|full - full64| + eps * |full|)`, element by element. The
  relative term is `AUTO_FACTOR` units in the last place rather than compare's one: the step and
  the full forward run the same kernels in the same dtype over other shapes (one row against the
  prefix), which round differently by a few units in the last place, also where the model computes
  in float32 whatever its dtype (T5's norm), so that the float64 copy does not bound them.

A step that differs is explained (`StepVerdict.explanation`,
`torchlens._generation.decode_explain`): the first site that differs, in forward order, and what
the step computed instead, by testing what goes wrong in a cached path: keys masked or not, the
step's own keys, shifted positions.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from torchlens._core.errors import GenerateSpecError, bad_tolerance
from torchlens._generation.decode_explain import SHIFTS, key_hypotheses, shift_hypotheses
from torchlens._generation.decode_reference import reference_kwargs, rerun, saved_sites
from torchlens._generation.decode_report import DecodeReport, StepVerdict
from torchlens._generation.decode_sites import compare_sites
from torchlens._tracing import trace

if TYPE_CHECKING:
    from torchlens._generation.result import GenerationTrace

__all__ = ["check_decode"]


def weights_now(model: torch.nn.Module) -> list:
    """(name, parameter, its version counter) of each parameter of `model`. A parameter written
    in place since (an optimizer step) is the same tensor with another version; one replaced by
    another tensor (an accelerate offload hook swaps them at each forward) is not compared, and
    neither are the buffers, which a forward may recompute (a dynamic rotary table)."""
    out = []
    for name, t in model.named_parameters():
        try:
            version = t._version
        except RuntimeError:  # an inference tensor
            version = None
        out.append((name, t, version))
    return out


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
    if not items:
        raise GenerateSpecError(
            f"steps={steps!r} names no step, so there is nothing to check; leave steps= out for "
            "every decode step that kept tensors."
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
            tensors; `tolerance` is not `"auto"` or None; `atol`/`rtol` given with `"auto"`, or
            not a number of zero or more; the generation was edited (a full forward
            cannot replay edits made per step); the model was not kept, or its weights changed
            since the generation (an optimizer step).
    """
    if tolerance not in ("auto", None):
        raise GenerateSpecError(
            f"tolerance={tolerance!r}: pass 'auto' (per site, from a float64 rerun) or None "
            "(atol/rtol)."
        )
    for name, value in (("atol", atol), ("rtol", rtol)):
        if value is None:
            continue
        why = bad_tolerance(name, value)
        if why:
            raise GenerateSpecError(f"{why}.")
        if tolerance == "auto":
            raise GenerateSpecError(
                f"{name}={value!r} sets the tolerance only with tolerance=None; with the default "
                "tolerance='auto' each site's is set from a float64 rerun. Pass tolerance=None with "
                f"{name}=, or leave {name}= out."
            )
    if gen.model is None:
        raise GenerateSpecError(
            "model: this GenerationTrace holds no model (a loaded one), so no full forward can run."
        )
    now = {name: (t, version) for name, t, version in weights_now(gen.model)}
    changed = []
    for name, t, version in gen._weights:  # a parameter written in place since (an optimizer step)
        seen = now.get(name)
        if seen is not None and seen[0] is t and seen[1] != version:
            changed.append(name)
    if changed:
        what = ", ".join(changed[:3]) + (
            f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        )
        raise GenerateSpecError(
            f"model: its weights were written since trace_generate returned ({what}, in place: an "
            "optimizer step, a load_state_dict), so a full forward now would not compute what the "
            "generation did. Run check_decode before changing the model, or generate again."
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
        sites = saved_sites(step_trace)
        wanted = {(c.address, f) for c, f in sites}
        kwargs = reference_kwargs(gen, s)
        full = rerun(model, kwargs, wanted)
        full64 = None
        if twin is not None:
            with torch.no_grad():
                full64 = trace(
                    twin,
                    save=lambda address, facet: (address, facet) in wanted,  # noqa: B023  # called in this step
                    **kwargs,
                )
        tolerances: dict = {}
        rows = compare_sites(s, step_trace, full, full64, sites, new, atol, rtol, auto, tolerances)
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
                text, cands = key_hypotheses(gen, s, step_trace, full, rows)
                if not text:
                    shift_text, shift_cands = shift_hypotheses(
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

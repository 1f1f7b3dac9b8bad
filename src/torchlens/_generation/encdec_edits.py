"""`edit=` on an encoder-decoder model's generation (T5, BART): each key resolved once, and placed
in the encoder's call or in the decoder's forwards.

`generate` calls an encoder-decoder model's encoder once, directly, and then the model once per new
token with the encoder's output; step 0 of the generation captures the encoder's call and the
decoder's first forward together. Edits are placed where the model computes the site, as `trace`
places them (`torchlens._edits`), one part at a time:

- before the encoder's call, one `save="none"` trace of a full forward of the model on the
  encoder's arguments (and a one-token decoder input) resolves every key, another library's names
  included (read on a trace of the encoder-decoder kind), says whether the key's module runs in
  the encoder's call, in a decoder forward, or in both, and locates the encoder's sites;
- each decoder forward, step 0's included, is located as a decoder-only model's step is: on a
  copy of the cache it receives.

Each part's plan is moved onto the capture it edits: its module calls renumbered (the decoder's
first forward follows the encoder's call in step 0's capture), its op positions moved to where the
part starts there, measured once the part's first module has been entered. The recorder checks the
name and module call of each op it replaces, and the step's own trace must find each edited site
at the op replaced (`EditPlan.check_placed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchlens._core.errors import GenerateSpecError
from torchlens._edits import EditPlan, plan_edits, resolve_key
from torchlens._trace import Trace

__all__ = ["EncDecKey", "decoder_sites", "encoder_plan", "given_keys", "input_ops", "resolve_keys"]


@dataclass
class EncDecKey:
    """One `edit=` entry of an encoder-decoder generation, resolved.

    Attributes:
        given: the key as given.
        site: the key each locating pass resolves: the key as given, or another library's name
            as `(module address, facet[, call])`, resolved once on an encoder-decoder trace (a
            decoder forward's trace alone is of the decoder-only kind, whose names differ).
        steps: the steps it applies at, or None for every step.
        value: the function or tensor.
        encoder: its module runs in the encoder's call (step 0 only).
        decoder: its module runs in a decoder forward.
    """

    given: Any
    site: Any
    steps: set[int] | None
    value: Any
    encoder: bool
    decoder: bool


def _inside(call: Any, top: Any) -> bool:
    while call is not None:
        if call is top:
            return True
        call = call.parent
    return False


def resolve_keys(
    located: Trace, encoder: str, edits: list[tuple[Any, Any, Any]]
) -> list[EncDecKey]:
    """Resolve every `edit=` entry on `located`, a full forward of the model, and say which part
    runs its module; an encoder site keyed to a decode step is refused."""
    top = located.modules[encoder].calls[0]
    out = []
    for key, steps, value in edits:
        address, facet, call = resolve_key(located, key)
        inside = [_inside(c, top) for c in located.modules[address].calls]
        if not inside:
            raise GenerateSpecError(
                f"edit= key {key!r}: {address or '<root>'} runs neither in the encoder's call nor in a "
                f"decoder forward (one full forward of the model does not call it). Name a module that runs; "
                f"trace_generate(...).steps[0].modules lists the modules of step 0."
            )
        in_encoder, in_decoder = any(inside), not all(inside)
        if in_encoder and not in_decoder and steps is not None and any(s > 0 for s in steps):
            given = sorted(steps)
            raise GenerateSpecError(
                f"edit= key {key!r} at steps {given}: {address} runs in the encoder ({encoder}), which "
                f"generate calls once, in step 0, before the decoder's first forward; decode steps 1.. run "
                f"the decoder only. Key an encoder site without a step ({key!r}: fn) or at step 0 "
                f"((0, {key!r}): fn); a decoder site takes any steps."
            )
        if isinstance(key, tuple) or (isinstance(key, str) and ":" in key):
            site = key
        else:  # another library's name: its site, as this trace's kind reads it
            site = (address, facet) if call is None else (address, facet, call)
        out.append(EncDecKey(key, site, steps, value, in_encoder, in_decoder))
    return out


def given_keys(plan: EditPlan, keys: list[EncDecKey]) -> None:
    """Name each record of `plan` by the key as given (the plan was made with `EncDecKey.site`)."""
    by_site = {k.site: k.given for k in keys}
    for r in plan.records:
        r.key = by_site.get(r.key, r.key)


def encoder_plan(
    located: Trace, encoder: str, keys: list[EncDecKey]
) -> tuple[EditPlan | None, int]:
    """The edits of the encoder's call (step 0), located on `located`, a full forward of the model:
    only the module calls inside the encoder's call, renumbered from the first of them; with the
    position of the encoder call's first op in `located`, from which its op positions count."""
    wanted = [k for k in keys if k.encoder and (k.steps is None or 0 in k.steps)]
    if not wanted:
        return None, 0
    plan = plan_edits(located, {k.site: k.value for k in wanted})
    given_keys(plan, wanted)
    top = located.modules[encoder].calls[0]
    firsts: dict[str, list[int]] = {}

    def calls(address: str, i: int) -> int | None:
        if address not in firsts:
            firsts[address] = [c.index for c in located.modules[address].calls if _inside(c, top)]
        mine = firsts[address]
        return i - mine[0] if i in mine else None

    plan.move_calls(calls)
    return plan, top.first_op


def decoder_sites(keys: list[EncDecKey], step: int) -> dict:
    """The sites a decoder forward of `step` edits, as the locating pass resolves them."""
    return {k.site: k.value for k in keys if k.decoder and (k.steps is None or step in k.steps)}


def input_ops(located: Trace) -> int:
    """How many `input` ops a trace records as its root is entered: its op positions past them
    are the ones of a capture where the same call starts at another position."""
    n = 0
    for op in located.ops:
        if op.name != "input":
            break
        n += 1
    return n

"""The exceptions TorchLens raises, and the helper that makes their messages teach.

Every error the library raises on purpose derives from [`TorchLensError`][torchlens.TorchLensError],
so callers can catch one type. Lookup errors also derive from `KeyError` and argument errors
from `ValueError`, so code written against plain mappings keeps working.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "TorchLensError",
    "LookupFailed",
    "SaveSpecError",
    "RoleSpecError",
    "ModuleNotFoundInTrace",
    "FacetNotFound",
    "FacetNotSaved",
    "AmbiguousModuleCall",
    "CaptureError",
    "EditSpecError",
    "NotEditable",
    "GenerateSpecError",
    "close_matches",
]


def close_matches(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Return up to `n` entries of `choices` that look like `word`, best first.

    Matching ignores case and treats `_`, `-`, `.`, and spaces alike, so
    `"Resid-Post"` still finds `"resid_post"`.

    Examples:
        >>> close_matches("resid_pst", ["resid_pre", "resid_post", "output"])
        ['resid_post', 'resid_pre']
    """
    choices = list(dict.fromkeys(choices))

    def norm(s: str) -> str:
        return "".join("_" if c in "-. " else c for c in s.lower())

    by_norm: dict[str, str] = {}
    for c in choices:
        by_norm.setdefault(norm(c), c)
    hits = difflib.get_close_matches(norm(word), list(by_norm), n=n, cutoff=0.6)
    return [by_norm[h] for h in hits]


def _suggest(word: str, choices: Iterable[str]) -> str:
    hits = close_matches(word, choices)
    return f" Did you mean {', '.join(repr(h) for h in hits)}?" if hits else ""


class TorchLensError(Exception):
    """Base class of every error TorchLens raises on purpose."""


class LookupFailed(TorchLensError, KeyError):
    """Base of every lookup error: a module, facet or alias name that finds nothing.

    It is a `KeyError` (so `except KeyError` keeps working) whose message prints as written,
    not quoted. Catch `torchlens.LookupFailed` to catch any failed lookup at once.
    """

    def __str__(self) -> str:
        return self.args[0] if self.args else ""


class SaveSpecError(TorchLensError, ValueError):
    """The `save=` argument of [`trace`][torchlens.trace] is not one TorchLens accepts."""


class RoleSpecError(TorchLensError, ValueError):
    """`roles=` is not accepted: not a dict, a role TorchLens does not know, or a key naming no module."""


class CaptureError(TorchLensError, RuntimeError):
    """The forward pass could not be captured (for example a compiled submodule hid its ops)."""


class EditSpecError(TorchLensError, ValueError):
    """The `edit=` argument of [`trace`][torchlens.trace] is not accepted: not a dict, a key that
    names no site, a value that is neither a callable nor a tensor, or a replacement of the wrong
    shape or dtype."""


class GenerateSpecError(TorchLensError, ValueError):
    """An argument of [`trace_generate`][torchlens.trace_generate] or
    [`GenerationTrace.check_decode`][torchlens.GenerationTrace.check_decode] is not accepted: a
    model without `generate`, beam search, `max_new_tokens=0`, a `steps=` outside the generation,
    an `edit=` key naming a step that never ran. The message names the argument and what it
    accepts."""


class NotEditable(TorchLensError):
    """An `edit=` key names a site that no single op of the forward produces, so it cannot be
    replaced where the model computes it (a pattern rebuilt from a fused SDPA kernel, a facet
    computed from recorded tensors, a slice of a fused projection). The message names the site,
    says why, and gives the remedy."""


class ModuleNotFoundInTrace(LookupFailed):
    """A module address is not in the trace."""

    def __init__(self, address: str, known: Iterable[str]):
        known = list(known)
        self.address = address
        msg = f"no module at address {address!r} in this trace.{_suggest(address, known)}"
        if not close_matches(address, known):
            msg += f" The trace has {len(known)} module addresses, e.g. {known[:4]!r}."
        super().__init__(msg)


class FacetNotFound(LookupFailed):
    """A facet name does not exist on this module."""

    def __init__(self, address: str, facet: str, known: Iterable[str], role: str | None = None, reason: str = ""):
        known = list(known)
        self.address, self.facet = address, facet
        # "other" is the role of a module with no known role: "the other module" would read as a
        # second module.
        what = f"the {role} module" if role and role != "other" else "the module"
        if reason:
            msg = f"{what} {address!r} has no facet {facet!r}: {reason}."
        else:
            msg = (
                f"{what} {address!r} has no facet {facet!r}.{_suggest(facet, known)}"
                f" Its facets are: {', '.join(known) or '(none)'}."
            )
        super().__init__(msg)


class FacetNotSaved(LookupFailed):
    """The facet exists on this module, but this trace's `save=` did not keep its tensor."""

    def __init__(self, address: str, facet: str, reason: str = ""):
        self.address, self.facet = address, facet
        msg = (
            f"facet {facet!r} of {address!r} exists but was not saved by this trace. "
            f"{reason + ' ' if reason else ''}Trace again with save='all', "
            f"save=[{address!r}] or save=[{facet!r}] to keep it."
        )
        super().__init__(msg)


class AmbiguousModuleCall(LookupFailed):
    """A module ran more than once, so `.facets` must name the call."""

    def __init__(self, address: str, n_calls: int):
        self.address = address
        msg = (
            f"module {address!r} ran {n_calls} times in this forward pass, so its facets are "
            f"per call: use trace.modules[{address!r}].calls[i].facets with i in 0..{n_calls - 1}."
        )
        super().__init__(msg)

"""The exceptions TorchLens raises, and the helper that makes their messages teach.

Every error the library raises on purpose derives from [`TorchLensError`][torchlens.TorchLensError],
so callers can catch one type. Lookup errors also derive from `KeyError` and argument errors
from `ValueError`, so code written against plain mappings keeps working.
"""

from __future__ import annotations

import difflib
import errno
import inspect
from collections.abc import Iterable
from typing import Any

__all__ = [
    "TorchLensError",
    "LookupFailed",
    "SaveSpecError",
    "RoleSpecError",
    "ModuleNotFoundInTrace",
    "FacetNotFound",
    "FacetNotSaved",
    "GradNotFound",
    "GradNotSaved",
    "NoGradients",
    "GradientError",
    "AmbiguousModuleCall",
    "CaptureError",
    "EditSpecError",
    "NotEditable",
    "GenerateSpecError",
    "close_matches",
    "cannot_take",
    "did_you_mean",
    "hint_of",
    "write_remedy",
]


def bad_tolerance(name: str, value: object) -> str | None:
    """Why `value` cannot be the tolerance `name` (`atol`, `rtol`): it must be a real number, zero
    or more; None when it can."""
    try:  # a float, an int, a NumPy scalar, a 0-d tensor
        number = None if isinstance(value, (bool, str, bytes)) else float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        number = None
    if number is None:
        return f"{name}={value!r} is not a number; pass a float such as 1e-5"
    if not number >= 0:  # also NaN
        return f"{name}={value!r}: a tolerance is zero or more"
    return None


def cannot_take(fn: Any, *args: Any) -> str | None:
    """Why the callable `fn` cannot be called with `args` (its signature does not bind them), or
    None when it can, or when it has no signature to read (a builtin: it is called as it is)."""
    try:
        inspect.signature(fn).bind(*args)
    except TypeError as exc:
        return str(exc)
    except ValueError:
        return None
    return None


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


def write_remedy(code: int | None) -> str:
    """What to do about a failed file write whose `OSError.errno` is `code`: one sentence, or ""
    for an errno with no advice of its own (the caller words its general remedy then).

    Examples:
        >>> write_remedy(errno.EISDIR)
        'A directory is in the way of a file of that name: remove it, or write elsewhere.'
    """
    if code is not None and code == getattr(errno, "EDQUOT", None):
        return "The disk quota is used up: free space there or write elsewhere."
    return _WRITE_REMEDIES.get(code or 0, "")


_WRITE_REMEDIES = {
    errno.ENOSPC: "The disk is full: free space there or write elsewhere.",
    errno.EROFS: "The file system is read-only: write to a writable directory.",
    errno.EACCES: "This process may not write there: write to a directory it may write to.",
    errno.EPERM: "This process may not write there: write to a directory it may write to.",
    errno.EFBIG: "The file is larger than this process or file system allows (see `ulimit -f`).",
    errno.ENOTDIR: "A part of the path is a file, not a directory: write to another path.",
    errno.EISDIR: "A directory is in the way of a file of that name: remove it, or write elsewhere.",
}


def hint_of(hits: Iterable[str]) -> str:
    """`" Did you mean 'a', 'b'?"` for the close matches `hits`, or `""` when there are none: the
    suggestion every lookup error ends its first sentence with."""
    hits = list(hits)
    return f" Did you mean {', '.join(repr(h) for h in hits)}?" if hits else ""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`hint_of` the close matches of `word` among `choices`."""
    return hint_of(close_matches(word, choices))


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

    def __init__(self, address: Any, known: Iterable[str]):
        known = list(known)
        self.address = address
        if not isinstance(address, str):
            super().__init__(
                f"modules[{address!r}]: module addresses are strings, as named_modules() gives them "
                f"('transformer.h.0'; '' is the root), not {type(address).__name__}. The trace has "
                f"{len(known)}, e.g. {known[:4]!r}."
            )
            return
        msg = f"no module at address {address!r} in this trace.{did_you_mean(address, known)}"
        if not close_matches(address, known):
            msg += f" The trace has {len(known)} module addresses, e.g. {known[:4]!r}."
        super().__init__(msg)


def _no_facet(
    address: str, facet: str, known: Iterable[str], role: str | None, reason: str, *, gradient: bool
) -> str:
    """The message of a facet (or its gradient) that a module does not serve: the reason where
    there is one, else the close matches and the names the module has."""
    known = list(known)
    # "other" is the role of a module with no known role: "the other module" would read as a
    # second module.
    what = f"the {role} module" if role and role != "other" else "the module"
    if reason:
        if gradient:
            return f"no gradient for facet {facet!r} of {what} {address!r}: {reason}."
        return f"{what} {address!r} has no facet {facet!r}: {reason}."
    missing = f"{what} {address!r} has no facet {facet!r}" + (
        ", so no gradient of it" if gradient else ""
    )
    listed = "gradients" if gradient else "facets"
    return (
        f"{missing}.{did_you_mean(facet, known)} Its {listed} are: {', '.join(known) or '(none)'}."
    )


class FacetNotFound(LookupFailed):
    """A facet name does not exist on this module."""

    #: whether the lookup asked for the facet's gradient (`GradNotFound`)
    _gradient = False

    def __init__(
        self,
        address: str,
        facet: str,
        known: Iterable[str],
        role: str | None = None,
        reason: str = "",
    ):
        self.address, self.facet = address, facet
        LookupFailed.__init__(
            self, _no_facet(address, facet, known, role, reason, gradient=self._gradient)
        )


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


class GradientError(TorchLensError, ValueError):
    """`grads=` (or `param_grads=`) of [`trace`][torchlens.trace] cannot be served: not a
    callable, a loss that is not a differentiable scalar, a loss function that raised, no kept
    site on a differentiable path to the loss, or `torch.inference_mode()` around the call. The
    message says what to do; nothing the trace changed (hooks, modes, `requires_grad`) is left."""


class NoGradients(LookupFailed):
    """A gradient was asked of a trace taken without `grads=`."""

    def __init__(self, what: str):
        super().__init__(
            f"{what}: this trace has no gradients; trace again with grads=loss_fn (a function of the model's "
            f"output returning a scalar, e.g. grads=lambda out: out.logits[0, -1].max()) to keep d loss / d "
            f"each saved site."
        )


class GradNotFound(FacetNotFound):
    """A facet has no gradient to serve: the facet does not exist, its value is not served, or its
    gradient is refused (not differentiable, not in the autograd graph, a derivation whose check
    failed); the message gives the reason."""

    _gradient = True


class GradNotSaved(FacetNotSaved):
    """The facet exists, but this trace's `save=` did not keep it, so its gradient was not kept either."""

    def __init__(self, address: str, facet: str, reason: str = ""):
        self.address, self.facet = address, facet
        LookupFailed.__init__(
            self,
            (
                f"the gradient of facet {facet!r} of {address!r} was not kept: save= selects gradients as it selects "
                f"values, and this trace's did not keep {facet!r} there. {reason + ' ' if reason else ''}Trace again "
                f"with save='all', save=[{address!r}] or save=[{facet!r}] (and grads=) to keep it."
            ),
        )


class AmbiguousModuleCall(LookupFailed):
    """A module ran more than once, so `.facets` must name the call."""

    def __init__(self, address: str, n_calls: int, attr: str = "facets"):
        self.address = address
        what = "facets" if attr == "facets" else "gradients"
        msg = (
            f"module {address!r} ran {n_calls} times in this forward pass, so its {what} are "
            f"per call: use trace.modules[{address!r}].calls[i].{attr} with i in 0..{n_calls - 1}."
        )
        super().__init__(msg)

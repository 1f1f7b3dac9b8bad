"""Gradients of facets: `GradMap`, the gradients of one call's facets, a `FacetMap` whose sites
hold d loss / d the facet's tensor instead of the tensor.

A trace taken with `grads=loss_fn` gives every module call a `grads` map next to its `facets`:
the same keys, the same call rules (`ModuleRecord.grads` of a module that ran once, else
`calls[i].grads`), the same statuses and refusals. Its sites are `FacetSite`s: `kind` says how
the gradient was obtained (`"real"`: autograd's gradient at the tensor the model used there;
`"computed"`: for a derived facet, derived from autograd's gradients where the model did run
an op (a fused kernel's rebuilt pattern and scores, a norm's `normalized` and statistics, the
per-head `result`) and checked against the model's own gradients), `check_error` the largest
difference in that check, `note` how. A derived gradient is pending until first read, as a
derived facet value is (`FacetSite`): its derivation and check run then, and a failed check
refuses it then, with the reason (`refused`, `pending`).
"""

from __future__ import annotations

from typing import Any

import torch

from torchlens._core.errors import GradNotFound, GradNotSaved
from torchlens._core.persisted import persisted
from torchlens._core.sites import FacetMap, FacetSite

__all__ = ["GradMap"]


@persisted
class GradMap(FacetMap):
    """The gradients of one module call's facets: facet name -> d loss / d that facet's tensor.

    Read it as `trace.modules[address].grads[facet]` (or `calls[i].grads[facet]`). A facet whose
    value `save=` did not keep has no gradient kept either (`GradNotSaved`); a facet whose value is
    refused, or whose gradient cannot be obtained (an integer tensor; a tensor outside the autograd
    graph; a derived gradient whose check fails), raises `GradNotFound` with the reason. Both are
    `FacetNotSaved` / `FacetNotFound` subclasses.

    Attributes:
        address: the module's address.
        role: the module's role.
        refused: facet name -> why its gradient is not served.
        ran: False for the empty map of a module that did not run in the forward.
        loss: what the gradients are of, in words (the loss function's name).
    """

    loss: str = ""
    #: the `FacetMap` of the same call: a gradient is served only while its value is
    _values: FacetMap | None = None

    _missing = GradNotFound

    def _bad_key(self, name: Any) -> str:
        return f"gradients are looked up by facet name (a str), not by {type(name).__name__}"

    def __getitem__(self, name: str) -> torch.Tensor:
        site = self._sites.get(name) if isinstance(name, str) else None
        if site is None:
            raise self._not_found(name)
        values = self._values
        if values is not None and name in values._sites:
            values.check(name)  # the value's pending check: a refused value has no gradient served
            if name in values.refused:
                self._sites.pop(name, None)
                self.refused[name] = f"its value is not served ({values.refused[name]})"
                raise self._not_found(name)
        t = site.tensor  # runs a pending check
        if site._refusal is not None:
            raise self._not_found(name)
        if t is None:
            raise GradNotSaved(self.address, name)
        return t

    _PERSISTED = ("address", "role", "refused", "sites", "ran", "loss")

    def __repr__(self) -> str:
        return "Grad" + super().__repr__()


def refused_grad(site: FacetSite, reason: str) -> FacetSite:
    """A gradient site that is not served, with `reason`, in place of the value site `site`."""
    return FacetSite(site.name, "refused", site.shape, site.dtype, note=reason)

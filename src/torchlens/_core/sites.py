"""Facets: `FacetSite` (what TorchLens knows about one facet of one module call) and `FacetMap`
(the facets of one call, a read-only mapping from name to tensor)."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from torchlens._core.errors import FacetNotFound, FacetNotSaved
from torchlens._core.facet_spec import FACETS
from torchlens._core.persisted import persisted

if TYPE_CHECKING:
    from torchlens._core.pending import Pending

__all__ = ["FacetMap", "FacetSite", "forward_order"]


@persisted
class FacetSite:
    """What TorchLens knows about one facet of one module call.

    A derived facet (a rebuilt attention pattern, a per-head result, a norm's statistics) and a
    real facet whose check is expensive (`z`'s `pattern @ v`, `resid_mid`'s residual sums) are
    *pending* when `trace` returns: the trace holds what they are computed from, and the tensor
    is computed and checked on first read of `tensor` (or by `FacetMap.check` /
    [`Trace.check`][torchlens.Trace.check]), then kept. Until then `checked` is False and
    `check_error` is None; a site whose check fails then is refused (`tensor` is None and its
    `FacetMap` lists it under `refused`). Nothing else about a site (its kind, shape, dtype,
    `saved`, its repr) computes anything.

    Attributes:
        name: the facet name (`"resid_post"`, `"pattern"`, ...).
        kind: `"real"` (the output of an op the model ran), `"computed"` (derived from recorded
            tensors and the module's weights, read-only), or `"reconstructed"` (rebuilt from a
            fused kernel's recorded inputs and checked against the kernel output, read-only).
            The kind is how TorchLens got the tensor; a name that resolves here (see
            `torchlens.mechinterp`) gets the status `real` for a real facet and
            `reconstructed_read_only` for a computed or reconstructed one.
        shape: the tensor's shape, known even when it was not saved.
        dtype: the tensor's dtype, known even when it was not saved.
        tensor: the tensor; reading it runs a pending check first. None when this trace's `save=`
            did not keep it, or when its check failed. Assigning None drops the tensor and any
            pending check with it.
        op: index of the op whose output this is, for real facets.
        check_error: for a checked facet, the largest absolute difference in its check against a
            relation the model fixes (the rebuilt vs the recorded kernel output; normalized *
            gain + bias vs the norm output; the sum over heads of result + bias vs the output
            projection; pattern @ v vs z; the residual sums around resid_mid); None while the
            check is pending. A facet whose check fails is not served: it is listed in
            `FacetMap.refused` with the reason.
        note: how the facet was found or computed, in one line.
    """

    # While a check is pending: the deferred check (a `Pending`, shared by the sites it checks
    # together) and `_inputs`, the one list of tensors it computes from, weights included. The
    # protocol for code that holds or moves a trace's tensors: `_inputs` entries are captured
    # as the forward left them and are read only when the check runs; `_capture.snapshot` copies those
    # the caller could still write into, and a store may replace an entry in place by a tensor
    # with the same values (on any device; the check computes where its inputs are), keeping
    # every tensor the trace holds on one storage and dtype on one version counter (views of one
    # base). When `trace` returns it seals the check (`Pending.seal`: each entry's version, or a
    # fingerprint of its values where a counter cannot tell), which refuses if one no longer
    # matches when it runs (a write after the trace, e.g. into a served facet). Both are
    # None once the check ran or the site was dropped. The stored tensor itself is
    # `site._value` (`tensor` is a property).
    #
    # A site is a slotted object: a trace keeps several hundred of them per forward call (a
    # generation one set per step), and an instance dictionary would be one more object per site
    # for the garbage collector to scan for as long as the trace lives.
    __slots__ = (
        "name",
        "kind",
        "shape",
        "dtype",
        "_value",
        "op",
        "check_error",
        "note",
        "_pending",
        "_inputs",
        "_refusal",
        "_guard",
        "_copies",
        "__weakref__",
    )
    _pending: Pending | None
    _inputs: list | None
    _refusal: str | None  # why a deferred check refused this site, once it ran and failed
    # the `_capture.snapshot.Guarded` group of a tensor on memory only the autograd graph shares,
    # copied on the first read instead of when the trace is returned; None otherwise
    _guard: Any
    # how many consecutive heads of the op output are copies of each of this site's heads (a key
    # the model broadcast to the query heads of its group before RoPE): the site holds the first
    # copy, and its gradient is the sum over the copies; None for a site that is no such selection
    _copies: int | None

    @classmethod
    def _blank(cls) -> FacetSite:
        """A site with no field set but the private ones (no check, no guard, nothing refused):
        what `torchlens.load` fills in with the stored fields."""
        site = object.__new__(cls)
        site._pending = site._inputs = site._refusal = site._guard = site._value = None
        site._copies = None
        return site

    def __init__(
        self,
        name: str,
        kind: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        tensor: torch.Tensor | None = None,
        op: int | None = None,
        check_error: float | None = None,
        note: str = "",
    ):
        self._pending = self._inputs = self._refusal = self._guard = self._copies = None
        self.name = name
        self.kind = kind
        self.shape = shape
        self.dtype = dtype
        self._value = tensor
        self.op = op
        self.check_error = check_error
        self.note = note

    @property
    def tensor(self) -> torch.Tensor | None:
        """The tensor, computed and checked first if this site is pending; None when `save=` did
        not keep it or its check failed."""
        if self._pending is not None:
            self._pending.run()
        if self._guard is not None:
            self._check_guard()
        return self._value

    @tensor.setter
    def tensor(self, value: torch.Tensor | None) -> None:
        self._value = value
        if value is None and self._pending is not None:
            self._pending.discard(self)

    def _check_guard(self, copy: bool = True) -> None:
        """Resolve the guarded group of this site's tensor (`_capture.snapshot.Guarded`: copied if
        unwritten, else refused); with `copy` False, only refuse a written one."""
        group = self._guard
        if copy:
            group.resolve()
        else:
            group.check()
        if group.done:
            self._guard = None

    @property
    def checked(self) -> bool:
        """False while this site's check is pending (it runs on first read); True once it ran, or
        when the site needs no check."""
        return self._pending is None

    @property
    def saved(self) -> bool:
        """Whether the trace holds the tensor, or (a pending site) what it is computed from.
        Computes nothing; a pending site whose check then fails is no longer saved."""
        return self._refusal is None and (self._pending is not None or self._value is not None)

    @property
    def read_only(self) -> bool:
        """True for computed and reconstructed facets: no op in the model produced this tensor."""
        return self.kind != "real"

    def __getstate__(self) -> dict[str, Any]:
        """For pickling: the pending check runs first (it cannot be pickled), so the copy holds
        the final tensor and status."""
        if self._pending is not None:
            self._pending.run()
        if self._guard is not None:
            self._check_guard()
        return {k: getattr(self, k) for k in _SITE_STATE}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._pending = self._inputs = self._guard = self._copies = None
        for k in _SITE_STATE:
            setattr(self, k, state[k])

    #: The fields a saved trace stores (`Trace.save` runs the pending check first).
    _PERSISTED: tuple[str, ...] = (
        "name",
        "kind",
        "shape",
        "dtype",
        "tensor",
        "op",
        "check_error",
        "note",
    )

    def _persist_fields(self) -> list[tuple[str, Any]]:
        return [(f, getattr(self, f)) for f in self._PERSISTED]

    def __repr__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        how = self.kind
        if self.op is not None:
            how += f", op #{self.op}"
        if self._pending is not None:
            how += ", check pending"
        elif self.check_error is not None:
            how += f", check error {self.check_error:.2g}"
        return f"FacetSite({self.name}: {list(self.shape)} {dtype}, {how}, {'saved' if self.saved else 'not saved'})"


#: What a pickled site holds: every slot but the pending check, its inputs and the guard.
_SITE_STATE = ("name", "kind", "shape", "dtype", "_value", "op", "check_error", "note", "_refusal")


def forward_order(names) -> list[str]:
    """Facet names in forward order: `input`, then the order `FACETS` lists them in (the order
    a forward computes them: `resid_pre`, `resid_mid`, `resid_post`; `q`, `k`, `v`, ...), then
    names `FACETS` does not list, then `output`."""
    return list(_order(tuple(names)))


@functools.lru_cache(maxsize=4096)
def _order(names: tuple[str, ...]) -> tuple[str, ...]:
    """`forward_order` of one tuple of names, kept: a trace sorts the same few facet sets once
    per module call, so each distinct set is sorted once."""
    rank = _facet_rank()
    last = rank["output"] - 1
    return tuple(sorted(names, key=lambda name: rank.get(name, last)))


@functools.lru_cache(maxsize=1)
def _facet_rank() -> dict[str, int]:
    """Facet name -> its place in forward order (`FACETS` is fixed once imported)."""
    rank: dict[str, int] = {}
    for facets in FACETS.values():
        for name in facets:
            rank.setdefault(name, len(rank))
    last = len(rank)
    rank.update(input=-1, output=last + 1)
    return rank


@persisted
class FacetMap(Mapping):
    """The facets of one module call: a read-only mapping from facet name to tensor.

    Iteration, `len` and `in` cover the facets whose tensor this trace saved, pending ones
    included: they compute nothing. `sites` lists every facet the module has, saved or not,
    with its kind and shape. Reading a facet (`facets[name]`, `items()`, `values()`) runs its
    check if it is pending (see [`FacetSite`][torchlens.FacetSite]); `check()` runs them all.
    Asking for a facet that exists but was not saved raises
    [`FacetNotSaved`][torchlens.FacetNotSaved]; asking for one that does not exist, or whose
    check failed, raises [`FacetNotFound`][torchlens.FacetNotFound] with close matches or the
    reason.

    Attributes:
        address: the module's address.
        role: the module's role.
        refused: facet name -> why it is not served: its check against a relation the model
            fixes failed or could not run. It lists the checks that ran: a pending check that
            fails later (on first read, or in `check()`) adds its facets here then, and takes
            them out of `sites`.
        ran: False for the empty map of a module that did not run in the forward.
    """

    _explain: dict[str, str] | None = None  # facet -> words to add to its reason, if refused

    def __init__(self, address: str, role: str, sites: dict[str, FacetSite], ran: bool = True):
        self.address = address
        self.role = role
        self.refused = {n: s.note for n, s in sites.items() if s.kind == "refused"}
        served = {n: s for n, s in sites.items() if s.kind != "refused"} if self.refused else sites
        names = tuple(served)
        order = _order(names)
        # the sites in forward order: the given dict itself when it is in that order already (it
        # is this map's own from here on; `derive` hands each call's dict over)
        self._sites = served if order == names else {n: served[n] for n in order}
        self.ran = ran
        for s in self._sites.values():
            if s._pending is not None:
                s._pending.owner = self

    @property
    def sites(self) -> dict[str, FacetSite]:
        """Facet name -> [`FacetSite`][torchlens.FacetSite], in forward order: every facet the
        module has and serves (refused ones are in `refused`). A new dict on each access, so a
        check that runs while you iterate it changes nothing under you."""
        return dict(self._sites)

    def _refuse(self, sites: list[FacetSite], reason: str) -> None:
        """A deferred check failed: its sites move from `sites` to `refused`."""
        for s in sites:
            if self._sites.get(s.name) is s:
                del self._sites[s.name]
                self.refused[s.name] = reason + (self._explain or {}).pop(s.name, "")

    def explain_refusal(self, facet: str, text: str) -> None:
        """Add `text` to the reason `facet` is refused, now if it is, or when its pending check
        refuses it later; nothing if its check holds. (An edited trace words this way the
        refusals its edits cause.)"""
        if facet in self.refused:
            self.refused[facet] += text
        else:
            if self._explain is None:
                self._explain = {}
            self._explain[facet] = self._explain.get(facet, "") + text

    def __getstate__(self) -> dict[str, Any]:
        """For pickling and copying: every pending check runs first, so that a failing one moves
        its site to `refused` before the sites are copied, not while they are."""
        self.check()
        return dict(self.__dict__)

    def check(self, name: str | None = None) -> dict[str, str]:
        """Run the pending checks: every one of this call, or that of the facet `name`.

        Returns:
            `refused`: the facets not served, with the reason.

        Raises:
            FacetNotFound: `name` is no facet of this call (with the close matches).
        """
        if name is not None and not (
            isinstance(name, str) and (name in self._sites or name in self.refused)
        ):
            raise self._not_found(name)
        todo = (
            [self._sites[name]]
            if isinstance(name, str) and name in self._sites
            else []
            if name is not None
            else list(self._sites.values())
        )
        for s in todo:
            if s._pending is not None:
                s._pending.run()
            if s._guard is not None:  # a guarded tensor written since the trace is refused now
                s._check_guard(copy=False)
        return self.refused

    @property
    def pending(self) -> list[str]:
        """The facets whose check has not run yet (computes nothing)."""
        return [n for n, s in self._sites.items() if s._pending is not None]

    #: the error of a name this map does not serve (`GradMap`: `GradNotFound`)
    _missing: type[FacetNotFound] = FacetNotFound

    def _bad_key(self, name: Any) -> str:
        return (
            f"facets are looked up by name (a str), not by {type(name).__name__}; "
            f"its facets are: {', '.join(self._sites) or '(none)'}"
        )

    def _not_found(self, name: Any) -> FacetNotFound:
        if not isinstance(name, str):
            reason = self._bad_key(name)
            return self._missing(self.address, repr(name), self._sites, self.role, reason)
        if name in self.refused:
            reason = f"it is not served: {self.refused[name]}"
        else:
            reason = "" if self.ran else "it did not run in this forward pass, so it has no facets"
        return self._missing(self.address, name, self._sites, self.role, reason)

    def __getitem__(self, name: str) -> torch.Tensor:
        site = self._sites.get(name) if isinstance(name, str) else None
        if site is None:
            raise self._not_found(name)
        t = site.tensor  # runs a pending check
        if site._refusal is not None:
            raise self._not_found(name)
        if t is None:
            raise FacetNotSaved(self.address, name)
        return t

    def __iter__(self) -> Iterator[str]:
        return iter([n for n, s in self._sites.items() if s.saved])

    def __len__(self) -> int:
        return sum(s.saved for s in self._sites.values())

    def __contains__(self, name: object) -> bool:
        site = self._sites.get(name) if isinstance(name, str) else None
        return site is not None and site.saved

    def items(self):
        """(name, tensor) of the saved facets; runs their pending checks first, so a facet whose
        check fails is left out (and listed in `refused`)."""
        self.check()
        return super().items()

    def values(self):
        """The saved facets' tensors; runs their pending checks first (see `items`)."""
        self.check()
        return super().values()

    def site(self, name: str) -> FacetSite:
        """The [`FacetSite`][torchlens.FacetSite] of `name`, saved or not (its check is not run)."""
        site = self._sites.get(name) if isinstance(name, str) else None
        if site is None:
            raise self._not_found(name)
        return site

    #: The fields a saved trace stores; `sites` (under its public name) is loaded into `_sites`.
    _PERSISTED: tuple[str, ...] = ("address", "role", "refused", "sites", "ran")
    _persist_renames = {"sites": "_sites"}

    def _persist_fields(self) -> list[tuple[str, Any]]:
        return [(f, getattr(self, self._persist_renames.get(f, f))) for f in self._PERSISTED]

    def __repr__(self) -> str:
        items = []
        for n, s in self._sites.items():
            flag = "" if s.kind == "real" else f" {s.kind}"
            flag += "" if s.saved else " not saved"
            flag += " check pending" if s._pending is not None else ""
            items.append(f"{n}{list(s.shape)}{flag}")
        return f"FacetMap({self.address!r}: {', '.join(items)})"

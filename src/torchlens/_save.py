"""The `save=` argument of `trace`: what a finished trace keeps, and what capture must hold."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ._errors import SaveSpecError, close_matches
from ._facet_spec import ALL_FACETS, FACETS

__all__ = ["SaveSpec", "parse_save", "retained_modules"]

#: Facets whose tensors live on a module other than the one that reports them: keep these
#: roles' ops when the facet is selected by name.
_FACET_SOURCE_ROLES = {"logits": ("unembed",), "final_norm_input": ("norm",)}


@dataclass(frozen=True)
class SaveSpec:
    """A normalized `save=` argument: what the finished trace keeps.

    Attributes:
        everything: keep every op output and every facet (`save="all"`).
        addresses: module addresses whose facets and ops (children included) are kept.
        facets: facet names kept on every module that has them.
        predicate: `predicate(address, facet) -> bool`, for any other rule.
    """

    everything: bool = False
    addresses: frozenset[str] = frozenset()
    facets: frozenset[str] = frozenset()
    predicate: Callable[[str, str], bool] | None = field(default=None, compare=False)

    def keep(self, address: str, facet: str) -> bool:
        """Whether the facet `facet` of module `address` is kept."""
        if self.everything or facet in self.facets or self.covers(address):
            return True
        return bool(self.predicate and self.predicate(address, facet))

    def covers(self, address: str) -> bool:
        """Whether `address` is selected or lies inside a selected module."""
        return any(address == a or address.startswith(a + ".") or a == "" for a in self.addresses)

    def describe(self) -> str:
        """The selection in words, for reprs and remedies."""
        if self.everything:
            return "all"
        parts = sorted(self.addresses) + sorted(self.facets) + (["<predicate>"] if self.predicate else [])
        return ", ".join(repr(p) for p in parts) or "none"


_EMPTY = (
    "{what} names no module: the root's address is '' in trace.modules, but as a save= value it "
    "would quietly mean everything. Pass save='all' to keep everything, or name what to keep: a "
    "module address such as 'model.layers.0', a container such as 'model.layers' (keeps all its "
    "children), or a facet name such as 'resid_post'."
)


def parse_save(save: Any, addresses: Iterable[str]) -> SaveSpec:
    """Turn a `save=` argument into a `SaveSpec`, or explain why not.

    A module address selects that module and everything inside it, so a container that never
    runs itself (an `nn.ModuleList` such as `"model.layers"`) selects all its children. `""`
    (the root's address) is refused: it would silently mean `"all"`.
    """
    addresses = list(addresses)
    accepted = (
        "save= accepts 'all', 'none', a module address or facet name, a list of those, "
        "or a callable predicate(address, facet) -> bool"
    )
    if save is None or save == "none":
        return SaveSpec()
    if isinstance(save, str):
        if save == "":
            raise SaveSpecError(_EMPTY.format(what="save=''"))
        if save == "all":
            return SaveSpec(everything=True)
        save = [save]
    if callable(save):
        return SaveSpec(predicate=save)
    if not isinstance(save, (list, tuple, set, frozenset)):
        raise SaveSpecError(f"save={save!r} is of type {type(save).__name__}; {accepted}.")
    addr_set = set(addresses)
    picked_addresses, picked_facets = set(), set()
    for item in save:
        if not isinstance(item, str):
            raise SaveSpecError(f"save= list item {item!r} is not a string; {accepted}.")
        if item == "":
            raise SaveSpecError(_EMPTY.format(what="save= list item ''"))
        if item in ("all", "none"):
            raise SaveSpecError(f"save= list item {item!r}: pass save={item!r} on its own, not inside a list.")
        if item in addr_set:
            picked_addresses.add(item)
        elif item in ALL_FACETS:
            picked_facets.add(item)
        else:
            hits = close_matches(item, list(ALL_FACETS) + addresses)
            hint = f" Did you mean {', '.join(repr(h) for h in hits)}?" if hits else ""
            raise SaveSpecError(
                f"save= item {item!r} is neither a module address of this model nor a facet name.{hint} "
                f"Facet names: {', '.join(sorted(ALL_FACETS))}."
            )
    return SaveSpec(addresses=frozenset(picked_addresses), facets=frozenset(picked_facets))


def retained_modules(spec: SaveSpec, roles: dict[str, str]) -> set[str]:
    """Addresses whose calls keep their op outputs during capture.

    A selected address brings every module below it: a container such as an `nn.ModuleList` never
    runs, so its children cannot inherit the selection from a running parent.
    """
    keep = set(spec.addresses)
    prefixes = tuple(a + "." for a in spec.addresses if a)
    if prefixes:
        keep |= {a for a in roles if a.startswith(prefixes)}
    for facet in spec.facets:
        wanted = set(_FACET_SOURCE_ROLES.get(facet, ()))
        wanted |= {role for role, table in FACETS.items() if facet in table}
        if "any" in wanted:
            return set(roles)
        keep |= {a for a, r in roles.items() if r in wanted}
    return keep

"""The `save=` argument of `trace`, end to end: what a finished trace keeps, and what capture holds.

One module holds every `save=` rule, in the order a trace uses them:

1. `parse_save` turns the argument into a `SaveSpec`, with every module address canonical (the
   address a shared module is first reached under: `model.lm_head` and `model.wte` name one
   module when the weights are tied through a shared module).
2. `plan_capture` turns the spec and the roles known before the forward into a `CapturePlan`:
   which module calls keep the outputs of the ops they run, and which keep only the tensors their
   hooks see (their input, their output). It raises "kept nothing" before the forward when no
   module of the model can give what was selected.
3. After the forward, `CapturePlan.trim` applies the one trimming rule (`SaveSpec.keep` for a
   facet, `SaveSpec.covers` for an op output) and `CapturePlan.check_kept` raises "kept
   nothing" for what only the forward could tell.

Where a facet's tensor comes from is read from its row in `torchlens._core.facet_spec`:

- an `"io"` facet (`FacetSpec.hooks`): a tensor a module hook sees, such as `resid_post` (a
  block's output), `final_norm_input` (the input of a norm outside every block, where the final
  norm is) or `logits` (the unembedding's output, and the root's output where a final map such as
  a softcap is computed from it). Capture keeps that tensor, as the output of the op that
  produced it, and nothing else.
- every other facet (`FacetSpec.retain`): found, rebuilt or checked from the ops inside a module
  of its role (`pattern`, `q`, `pre`, `normalized`, `resid_mid`, ...). Capture keeps every op
  output inside each call of such a module.

A predicate is asked only after the forward, so `save=predicate` retains everything during
capture and drops what it refuses afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from torchlens._core.errors import SaveSpecError, cannot_take, did_you_mean
from torchlens._core.facet_spec import ALL_FACETS, BY_NAME, EVERY_MODULE
from torchlens._core.persisted import persisted
from torchlens._core.sites import FacetSite

__all__ = ["CapturePlan", "SaveSpec", "parse_save", "plan_capture"]

#: Roles a facet needs a module of before the forward, beyond its own role and the roles of the
#: hooks that serve it: the final norm is found only after a stack of blocks.
_ALSO_NEEDS: dict[str, tuple[str, ...]] = {"final_norm_input": ("block",)}


def _needs(facet: str) -> tuple[str, ...]:
    """Roles some module of the model must have (before the forward) for it to have `facet`.

    Roles before the forward are a superset of the settled ones, except that attention and MLP
    sublayers are confirmed only inside blocks (their facets need a block). The root and "any"
    module always exist.
    """
    row = BY_NAME[facet]
    roles = [
        r for r in row.roles + tuple(r for r, _ in row.hooks) if r not in (EVERY_MODULE, "root")
    ]
    if row.hooks and row.roles == ("root",):  # a root facet is served by the hooks' modules alone
        roles = [r for r, _ in row.hooks if r not in (EVERY_MODULE, "root")]
    roles = ["block" if r in ("attention", "mlp") else r for r in roles] + list(
        _ALSO_NEEDS.get(facet, ())
    )
    return tuple(dict.fromkeys(roles))


@persisted
@dataclass(frozen=True)
class SaveSpec:
    """A normalized `save=` argument: what the finished trace keeps.

    Attributes:
        everything: keep every op output and every facet (`save="all"`).
        addresses: canonical module addresses whose facets and ops (children included) are kept.
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
        """Whether `address` is selected or lies inside a selected module (its ops are kept)."""
        return self.everything or any(
            address == a or address.startswith(a + ".") or a == "" for a in self.addresses
        )

    @property
    def selects(self) -> bool:
        """Whether this is a selection (addresses, facets or a predicate), not `"all"` or `"none"`."""
        return not self.everything and bool(self.addresses or self.facets or self.predicate)

    def describe(self) -> str:
        """The selection in words, for reprs and remedies."""
        if self.everything:
            return "all"
        parts = (
            sorted(self.addresses)
            + sorted(self.facets)
            + (["<predicate>"] if self.predicate else [])
        )
        return ", ".join(repr(p) for p in parts) or "none"


_EMPTY = (
    "{what} names no module: the root's address is '' in trace.modules, but as a save= value it "
    "would quietly mean everything. Pass save='all' to keep everything, or name what to keep: a "
    "module address such as 'model.layers.0', a container such as 'model.layers' (keeps all its "
    "children), or a facet name such as 'resid_post'."
)


def parse_save(
    save: Any, addresses: Iterable[str], aliases: Mapping[str, str] | None = None
) -> SaveSpec:
    """Turn a `save=` argument into a `SaveSpec`, or explain why not.

    A module address selects that module and everything inside it, so a container that never
    runs itself (an `nn.ModuleList` such as `"model.layers"`) selects all its children. `""`
    (the root's address) is refused: it would silently mean `"all"`.

    Args:
        save: the argument as passed to `trace`.
        addresses: the model's canonical module addresses.
        aliases: other addresses of shared modules -> their canonical address; a selected alias
            is stored as the canonical address (the one the trace records the module under).
    """
    aliases = dict(aliases or {})
    addresses = list(addresses) + [a for a in aliases if a not in addresses]
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
        why = cannot_take(save, "address", "facet")
        if why:
            raise SaveSpecError(
                f"save={getattr(save, '__name__', save)!r}: a save= function is called as "
                f"predicate(address, facet) -> bool (e.g. lambda address, facet: facet == "
                f"'resid_post'), and this one cannot take those two arguments ({why})."
            )
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
            raise SaveSpecError(
                f"save= list item {item!r}: pass save={item!r} on its own, not inside a list."
            )
        if item in addr_set:
            picked_addresses.add(aliases.get(item, item))
        elif item in ALL_FACETS:
            picked_facets.add(item)
        else:
            address, colon, facet = item.rpartition(":")
            if colon and (address in addr_set or address == "") and facet in ALL_FACETS:
                raise SaveSpecError(
                    f"save= item {item!r}: save= takes module addresses and facet names, not "
                    f"'address:facet' keys. To keep that one facet, pass a predicate: save=lambda "
                    f"address, facet: (address, facet) == ({address!r}, {facet!r}); or keep the "
                    f"module, save=[{address!r}], or the facet everywhere, save=[{facet!r}]."
                )
            hint = did_you_mean(item, list(ALL_FACETS) + addresses)
            raise SaveSpecError(
                f"save= item {item!r} is neither a module address of this model nor a facet name.{hint} "
                f"Facet names: {', '.join(sorted(ALL_FACETS))}."
            )
    return SaveSpec(addresses=frozenset(picked_addresses), facets=frozenset(picked_facets))


@dataclass(frozen=True)
class CapturePlan:
    """What capture holds for one trace, and the rules that trim it afterwards.

    Attributes:
        spec: the `SaveSpec` the plan serves.
        retain_all: every op keeps its output (`save="all"`, or a predicate, which is asked only
            after the forward).
        op_modules: addresses whose calls keep the outputs of every op they run (children's
            ops included).
        hold_in: addresses whose calls keep the tensor their forward pre-hook sees as input.
        hold_out: addresses whose calls keep the tensor their forward hook sees as output.
    """

    spec: SaveSpec
    retain_all: bool = False
    op_modules: frozenset[str] = frozenset()
    hold_in: frozenset[str] = frozenset()
    hold_out: frozenset[str] = frozenset()
    #: the roles the plan was made from (guessed before the forward), for `trim`'s reasons
    guessed: Mapping[str, str] = field(default_factory=dict)

    def trim(self, ops: list, calls: list, sites: list[dict]) -> None:
        """Drop what capture held but the spec does not keep: a facet's tensor unless
        `spec.keep(address, facet)`, an op's outputs unless `spec.covers(op.module)`.

        Args:
            ops: the recorded `OpRecord`s.
            calls: the recorded `ModuleCall`s.
            sites: each call's facet sites, in the order of `calls`.
        """
        spec = self.spec
        if spec.everything:
            return
        covered: dict[str, bool] = {}

        def covers(address: str) -> bool:
            kept = covered.get(address)
            if kept is None:
                kept = covered[address] = spec.covers(address)
            return kept

        facets, predicate = spec.facets, spec.predicate
        for call, call_sites in zip(calls, sites):
            whole = covers(call.address)  # every facet of the call is kept
            for name, site in call_sites.items():
                wanted = (
                    whole
                    or name in facets
                    or (predicate is not None and predicate(call.address, name))
                )
                if wanted:
                    if site.kind != "refused" and not site.saved:
                        # selected, but capture did not keep it: never silently "not saved"
                        call_sites[name] = FacetSite(
                            name,
                            "refused",
                            site.shape,
                            site.dtype,
                            note=self._unkept(ops, call, site),
                        )
                elif site._value is not None or site._pending is not None:  # `saved`, cheaply
                    site.tensor = None  # drops a pending check, and what it would compute from, too
        for op in ops:
            tensors = op.tensors
            if len(tensors) == 1:  # most ops: one output
                if tensors[0] is not None and not covers(op.module):
                    op.tensors = (None,)
            elif any(t is not None for t in tensors) and not covers(op.module):
                op.tensors = (None,) * len(tensors)

    def _unkept(self, ops: list, call: Any, site: Any) -> str:
        """Why a site `save=` selected has no tensor: the plan, made before the forward from
        guessed roles, kept nothing it is found from."""
        guess = self.guessed.get(call.address, "other")
        head = f"{_UNKEPT}save={self.spec.describe()} selected it, but capture did not keep its tensor: "
        if guess != call.role:
            return (
                f"{head}before the forward, TorchLens took {call.address or '<root>'} for a {guess!r} "
                f"module (it is {call.role!r}), and a save= selection keeps only what the roles it "
                f"guessed need. Pass roles={{{call.address!r}: {call.role!r}}} with this save=, or "
                f"save='all'"
            )
        where = ops[site.op].module if site.op is not None and site.op < len(ops) else None
        return (
            f"{head}it is computed in {where or '<root>'!r}"
            + (f" (op #{site.op})" if site.op is not None else "")
            + f", whose ops this selection does not keep. Add {where or '<root>'!r} to save= (an "
            "address keeps every op inside it), or save='all'"
            if where is not None and where != call.address
            else f"{head}its op ran where this selection keeps no op outputs; save='all' keeps it"
        )

    def check_kept(self, calls: list) -> None:
        """Raise `SaveSpecError` when a selection kept no facet of any call (known only after the
        forward: a facet its modules turned out not to have, a predicate that refused all)."""
        if not self.spec.selects or any(len(c.facets) for c in calls):
            return
        unkept = [
            (c.address, name, why)
            for c in calls
            for name, why in c.facets.refused.items()
            if why.startswith(_UNKEPT)
        ]
        if unkept:  # the facets exist, and the plan kept none of them: say why
            address, name, why = unkept[0]
            more = f" ({len(unkept) - 1} more sites likewise)" if len(unkept) > 1 else ""
            raise SaveSpecError(
                f"save={self.spec.describe()} kept nothing in this forward: {address or '<root>'}:{name}"
                f"{more}: {why[len(_UNKEPT) :]}."
            )
        exist = sorted({n for c in calls for n in c.facets.sites})
        raise SaveSpecError(
            f"save={self.spec.describe()} kept nothing in this forward: no module that ran has those facets. "
            f"Facets that exist here: {', '.join(exist)}."
        )

    def check_each_named(self, calls: list, where: str = "in this forward") -> None:
        """Raise `SaveSpecError` when a facet the selection names exists on no call of this
        forward, though others it names do (`check_kept` raises only when nothing was kept): a
        name that reaches nothing is never ignored silently. A generation holds all its steps'
        calls to it together (a step may lack what another has), `where` saying so."""
        if not self.spec.facets:
            return
        exist = {
            n for c in calls if c.facets is not None for n in (*c.facets.sites, *c.facets.refused)
        }
        missing = sorted(self.spec.facets - exist)
        if missing:
            raise SaveSpecError(
                f"save={self.spec.describe()} names {', '.join(repr(m) for m in missing)}, which no module "
                f"that ran {where} has; drop {'it' if len(missing) == 1 else 'them'}. Facets that "
                f"exist here: {', '.join(sorted(exist))}."
            )


#: How a selected site's refusal starts where capture kept nothing it is found from (`trim`).
_UNKEPT = "not kept: "


def _runs(module: nn.Module) -> bool:
    """Whether calling `module` can run a forward (a `ModuleList`/`ModuleDict` has none)."""
    return type(module).forward is not nn.Module.forward or "forward" in module.__dict__


def plan_capture(
    spec: SaveSpec, roles: Mapping[str, str], modules: Mapping[str, nn.Module]
) -> CapturePlan:
    """The `CapturePlan` for `spec`, from the roles known before the forward.

    Args:
        spec: the parsed `save=`.
        roles: canonical address -> role before the forward (`_analysis.role_rules.static_roles`, a
            superset of the roles the forward settles).
        modules: canonical address -> module.

    Raises:
        SaveSpecError: the selection can keep nothing in this model, whatever the forward does:
            every facet it names needs a role no module here has, and every address it names holds
            no module with a forward.
    """
    if spec.everything or spec.predicate is not None:
        return CapturePlan(spec, retain_all=True)
    if not spec.addresses and not spec.facets:
        return CapturePlan(spec)
    present = set(roles.values())
    blocks = tuple(a + "." for a, r in roles.items() if r == "block")
    op_modules: set[str] = set(spec.addresses)
    prefixes = tuple(a + "." for a in spec.addresses if a)
    if prefixes:  # a container never runs, so its children cannot inherit the selection from it
        op_modules |= {a for a in roles if a.startswith(prefixes)}
    hold: dict[str, set[str]] = {"in": set(), "out": set()}
    possible = False
    for facet in spec.facets:
        if not _can_have(facet, present):
            continue
        possible = True
        row = BY_NAME[facet]
        op_modules |= {
            a for a, r in roles.items() if r in row.retain
        }  # found from the ops inside them
        for where, side in row.hooks:  # served by a tensor a hook sees: held alone
            if where == EVERY_MODULE:
                hold[side] |= set(roles)
            elif where == "norm" and row.roles == (
                "root",
            ):  # the final norm lies outside every block
                hold[side] |= {
                    a for a, r in roles.items() if r == "norm" and not a.startswith(blocks)
                }
            else:
                hold[side] |= {a for a, r in roles.items() if r == where}
    if not possible:
        possible = any(
            any(_runs(m) for a, m in modules.items() if a == s or a.startswith(s + "."))
            for s in spec.addresses
        )
    if not possible:
        _kept_nothing_before(spec, roles, modules, present)
    return CapturePlan(
        spec,
        False,
        frozenset(op_modules),
        frozenset(hold["in"]),
        frozenset(hold["out"]),
        dict(roles),
    )


def _can_have(facet: str, present: set[str]) -> bool:
    """Whether some module of a model whose roles (before the forward) are `present` can have `facet`."""
    return all(r in present for r in _needs(facet))


def _kept_nothing_before(
    spec: SaveSpec, roles: Mapping[str, str], modules: Mapping[str, nn.Module], present: set[str]
) -> None:
    reasons = []
    for facet in sorted(spec.facets):
        what = " and ".join(f"a {r} module" for r in _needs(facet))
        reasons.append(f"{facet!r} needs {what}")
    for a in sorted(spec.addresses):
        reasons.append(f"{a!r} ({type(modules[a]).__name__}) holds no module with a forward")
    exist = sorted(f for f in ALL_FACETS if _can_have(f, present))
    raise SaveSpecError(
        f"save={spec.describe()} kept nothing in this model, so the forward was not run: "
        f"{'; '.join(reasons)}, and its modules have the roles {', '.join(sorted(present))} "
        "(pass roles= to name a module's role where TorchLens cannot tell). "
        f"Facets that exist here: {', '.join(exist)} (those the roles of its modules allow)."
    )

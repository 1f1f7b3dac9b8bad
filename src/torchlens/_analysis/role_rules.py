"""Roles before the forward, and the `roles=` override.

`static_roles` guesses, from the module tree alone, which module could be a block, attention, MLP,
norm, embedding or unembedding: a generous guess used only to decide which tensors the capture
keeps for `save=` (the rules after the forward, in `structure`, settle each role from the data
flow). `parse_roles` reads `roles=`, whose named roles win over every rule.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from torchlens._core import roles as _roles
from torchlens._core.errors import RoleSpecError, did_you_mean

__all__ = ["OVERRIDABLE_ROLES", "Roles", "groups", "parse_roles", "static_roles"]

#: The roles `roles=` accepts.
OVERRIDABLE_ROLES = (
    "block",
    "attention",
    "cross_attention",
    "mlp",
    "norm",
    "embedding",
    "unembed",
    "other",
)


# -- roles= ------------------------------------------------------------------------------------


def parse_roles(roles: Any, addresses: list[str]) -> dict[str, str]:
    """Check a `roles=` argument and expand its patterns to addresses.

    Args:
        roles: None, or a dict from a module address or a glob pattern to a role in
            `OVERRIDABLE_ROLES`. In a pattern `*` matches one address part (`"model.layers.*"`: the
            layers, not their children), `**` any number of parts.
        addresses: every module address of the model.

    Returns:
        address -> role, for every address a key names.

    Raises:
        RoleSpecError: not a dict, a role not accepted, or a key that names no module.
    """
    if roles is None:
        return {}
    if not isinstance(roles, dict):
        raise RoleSpecError(
            f"roles= takes a dict {{address_or_pattern: role}}, got {type(roles).__name__}. "
            f"Roles: {', '.join(OVERRIDABLE_ROLES)}."
        )
    out: dict[str, str] = {}
    for key, role in roles.items():
        if not isinstance(key, str):
            raise RoleSpecError(
                f"roles= key {key!r} is not a string (a module address or a glob pattern)."
            )
        if role not in OVERRIDABLE_ROLES:
            hint = did_you_mean(str(role), OVERRIDABLE_ROLES)
            raise RoleSpecError(
                f"roles={{{key!r}: {role!r}}}: {role!r} is not a role.{hint} "
                f"Roles: {', '.join(OVERRIDABLE_ROLES)}."
            )
        rx = _glob(key)
        hit = [a for a in addresses if a == key or rx.fullmatch(a)]
        if not hit:
            hint = did_you_mean(key, addresses)
            raise RoleSpecError(f"roles= key {key!r} names no module of this model.{hint}")
        for a in hit:
            out[a] = role
    return out


def _glob(pattern: str) -> re.Pattern:
    """`*` matches one address part (no dot), `**` any number of parts, `?` one character."""
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^.]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^.]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


# -- before the forward ------------------------------------------------------------------------


def groups(model: nn.Module, names: dict[nn.Module, str]) -> list[tuple[str, list[nn.Module]]]:
    """Groups of repeated non-leaf modules, as (holder address, distinct modules in order): the
    children of an `nn.ModuleList` / `nn.Sequential` when all are non-leaf (of any classes), and
    two or more children of one class of any other module."""
    out = []
    for holder in names:  # every module of `model`, once each, in `model.modules()` order
        kids, seen = [], set()  # a module registered under two names counts once
        for m in holder._modules.values():
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                kids.append(m)
        nonleaf = [m for m in kids if any(c is not None for c in m._modules.values())]
        if not nonleaf:
            continue
        if isinstance(holder, (nn.ModuleList, nn.Sequential)):
            # a list of layers, of one class or several (a hybrid stack: Jamba's Mamba and attention
            # layers); `find` keeps it only where each call reads the previous one's output
            if len(nonleaf) == len(kids):
                out.append((names[holder], nonleaf))
            continue
        by_class: dict[type, list[nn.Module]] = {}
        for m in nonleaf:
            by_class.setdefault(type(m), []).append(m)
        for group in by_class.values():
            if len(group) >= 2:
                out.append(
                    (names[holder], group)
                )  # `find` drops siblings that are attentions (BART's two)
    return out


def _vocab_sizes(names: dict[nn.Module, str]) -> set[int]:
    return {m.num_embeddings for m in names if isinstance(m, nn.Embedding)}


class Roles(dict):
    """address -> role, carrying the user's `roles=` (after `parse_roles`) as `overrides`."""

    def __init__(self, roles: dict[str, str], overrides: dict[str, str]):
        super().__init__(roles)
        self.overrides = overrides
        #: `groups(model, names)` as `static_roles` found it (`find` reads it instead of walking
        #: the module tree again); None until then.
        self.groups: list[tuple[str, list[nn.Module]]] | None = None


def static_roles(model: nn.Module, names: dict[nn.Module, str], overrides: dict[str, str]) -> Roles:
    """A first role for every address, from the module tree alone (see the module docstring).

    It is a superset guess: `find` settles the roles after the forward.
    """
    roles = Roles({addr: "other" for addr in names.values()}, overrides)
    roles[""] = "root"
    vocab = _vocab_sizes(names)
    for module, addr in names.items():
        if isinstance(module, nn.Embedding):
            roles[addr] = "embedding"
        elif _roles.is_norm(module):
            roles[addr] = "norm"
        elif isinstance(module, nn.Linear) and (
            module.out_features in vocab or addr.rsplit(".", 1)[-1] in _roles.UNEMBED_ATTRS
        ):
            roles[addr] = "unembed"
        elif isinstance(module, nn.MultiheadAttention) or any(
            f in type(module).__name__ for f in _roles.ATTENTION_CLASS_FRAGMENTS
        ):
            roles[addr] = "attention"
    roles.groups = groups(model, names)
    by_address = {addr: m for m, addr in names.items()}
    kinds = [  # (whether the holder is a list of layers, the group)
        (isinstance(by_address[holder], (nn.ModuleList, nn.Sequential)), group)
        for holder, group in roles.groups
    ]
    listed = {id(m) for in_list, group in kinds if in_list for m in group}  # listed layers
    for in_list, group in kinds:
        for block in group:
            if not in_list and (
                roles[names[block]] == "attention"  # BART's self_attn and encoder_attn, one class
                or any(id(m) in listed for m in block.modules() if m is not block)
            ):  # a stack holding a list of layers (T5's encoder and decoder) is no block
                continue
            roles[names[block]] = "block"
            for attr, child in block.named_children():
                role = _roles.child_role(attr, child)
                if role and roles[names[child]] == "other":
                    roles[names[child]] = role
    for addr, role in overrides.items():
        roles[addr] = "attention" if role == "cross_attention" else role
    return roles

"""Whether an object tree (a model's output) is held by nothing but the one reference given to it.

A model returns a tree of containers (tuples, lists, dicts, a `ModelOutput`: a dict whose items
are also its attributes) with tensors among the leaves. `sole_tree` tells, from reference counts,
whether the tree can be reached only through one slot of an owner (the `Trace` that holds the
output): every object of the tree, each container and each tensor, must have exactly the
references the containers of the tree give it, and the root only the owner's. Anything else that
holds one of them (a hook that kept the output, a cache object that keeps a tensor, a dict a
caller took from `vars(output)`) adds a reference that no container of the tree accounts for, and
the answer is None.

Only what the tree's containers provably hold is counted, so an error can only ever miss an
exclusive tree, never take a shared one for exclusive: the items of tuples and lists, the keys and
values of dicts, and the instance dictionary of a container that has one (itself a node, whose
only reference is its object's). Any other object in the tree is a leaf, neither entered nor
counted: a tensor it holds is not part of the tree, and one of the tree's objects it holds adds a
reference the count sees. An empty container reaches no tensor and is not counted either (the
one empty tuple Python shares has references everywhere). A weak reference to an object of the
tree reaches it without a reference, so it too counts as something else holding it.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch

__all__ = ["sole_tree", "tree_children"]

#: The most objects `sole_tree` counts before it gives up (an output is a few dozen).
_LIMIT = 10_000


def tree_children(x: Any) -> list | None:
    """The objects a container of the tree holds (the items of a tuple or list, the keys and values
    of a dict, a subclass's instance dictionary), None for a leaf (a tensor, anything else)."""
    if isinstance(x, torch.Tensor):
        return None
    if isinstance(x, (tuple, list)):
        found = list(x)
    elif isinstance(x, dict):
        found = [*dict.keys(x), *dict.values(x)]
    else:
        return None
    if type(x) not in (tuple, list, dict):
        own = getattr(x, "__dict__", None)
        if type(own) is dict:
            found.append(own)
    return found


def _counted(owner: dict, key: str) -> tuple[list, dict[int, int]]:
    """The objects of the tree at `owner[key]` (containers and tensors, each once) and, per object,
    the references the tree gives it (the root: one, the owner's)."""
    nodes = [owner[key]]
    given = {id(nodes[0]): 1}
    i = 0
    while i < len(nodes) and len(nodes) <= _LIMIT:
        _visit(nodes[i], nodes, given)
        i += 1
    return nodes, given


def _visit(x: Any, nodes: list, given: dict[int, int]) -> None:
    """Count the references container `x` gives, adding the objects first met to `nodes` (a
    function of its own: no local of it still holds an object when the counts are read)."""
    for child in tree_children(x) or ():
        if not isinstance(child, torch.Tensor) and not tree_children(child):
            continue  # a leaf the count does not enter (a string, a cache object), or an empty
            # container, which reaches no tensor (the shared `()` has references everywhere)
        n = given.get(id(child))
        if n is None:
            nodes.append(child)
            given[id(child)] = 1
        else:
            given[id(child)] = n + 1


class _Probe(dict):
    """A `ModelOutput`-like dict whose items are also attributes, for the calibration."""


_BASE: list[int | None] = []
_BASE_LOCK = threading.Lock()


def _base() -> int | None:
    """What `_each_extra` reads for an object the tree alone holds, measured once on a probe tree built
    here (a tuple, a list, a dict, a dict subclass with its attributes, tensors); None when the
    probe's objects do not all read the same (then no tree is taken for exclusive)."""
    with _BASE_LOCK:
        if not _BASE:
            owner = {"out": (_Probe(a=torch.zeros(1)), [torch.zeros(1)], {"b": torch.zeros(1)})}
            owner["out"][0].__dict__["a"] = owner["out"][0]["a"]  # an item that is an attribute too
            nodes, given = _counted(owner, "out")
            found = set(_each_extra(nodes, given))
            del nodes
            _BASE.append(found.pop() if len(found) == 1 else None)
        return _BASE[0]


def sole_tree(owner: dict, key: str) -> tuple[list, list] | None:
    """The tensors of the tree at `owner[key]` that nothing but the tree holds, and the others,
    when nothing but that slot holds the tree's containers (see the module docstring); None when
    something else holds one of them (then it can reach every tensor below it). A weak reference
    to an object counts as something else holding it.

    A tensor that C++ owns too (a view made of it holds it as its base) reads one more reference
    than the tree gives it, and is among the others.

    Args:
        owner: a dict (an object's `__dict__`) whose `key` holds the tree.
        key: the slot.
    """
    base = _base()
    if base is None:
        return None
    nodes, given = _counted(owner, key)
    if len(nodes) > _LIMIT:
        return None
    sole: list = []
    others: list = []
    for x, extra in zip(nodes, _each_extra(nodes, given)):
        # a weak reference (a cache keyed weakly by tensors, a callback's `weakref.ref`) reaches
        # the object without counting as a reference
        alone = extra == base and not weakref.getweakrefcount(x)
        if isinstance(x, torch.Tensor):
            (sole if alone else others).append(x)
        elif not alone:
            return None
    return sole, others


def _each_extra(nodes: list, given: dict[int, int]) -> list[int]:
    """The references beyond the tree's own that each object of `nodes` has, as this loop reads
    them (the list's, the loop variable's, the call's argument: one number for every object the
    tree alone holds)."""
    return [sys.getrefcount(x) - given[id(x)] for x in nodes]

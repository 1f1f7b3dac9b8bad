"""Gradient edges: where, in the forward's autograd graph, each tensor a trace keeps was produced.

With `trace(..., grads=loss_fn)` the recorder keeps, next to every tensor it keeps (an op output,
a module input or output a hook kept, a rebuilt op's kept argument), that tensor's gradient edge
(`torch.autograd.graph.get_gradient_edge`): the autograd node that produced it and which of its
outputs it is, taken at the moment the model produced or used it. The one backward that follows
(`_analysis.grads.backward`) asks autograd for the gradient at those edges, so a tensor the model
later wrote in place still gets d loss / d the value the model used there (the write gives the
tensor a new node; the edge kept still names the old one).

A tensor that does not require grad has no edge (nothing it is computed from requires grad: a
mask, a constant, token ids); the gradient of such a site is refused with that reason.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["Edges"]


class Edges:
    """The gradient edges one recorder kept.

    Attributes:
        ops: `(op index, output slot)` -> (the edge of that op output, the tensor kept for it:
            the op record may drop it later, when `save=` keeps only a facet on it).
        aliases: `id(alias)` -> `(alias, edge)` for each module input/output alias a hook kept
            (the alias is held here so its id stays its own; a clone made before a write takes
            the edge over, `moved`).
        args: `(op index, id(kept argument))` -> the edge of that argument of a rebuilt op
            (`OpRecord.extra`), as the op read it.
    """

    __slots__ = ("ops", "aliases", "args", "off")

    def __init__(self) -> None:
        self.ops: dict[tuple[int, int], tuple[GradientEdge, Tensor]] = {}
        self.aliases: dict[int, tuple[Tensor, GradientEdge]] = {}
        self.args: dict[tuple[int, int], GradientEdge] = {}
        #: the ops that ran with autograd off in the model's own forward (inside a custom
        #: `autograd.Function`'s forward, under the model's `torch.no_grad()`): no gradient there
        self.off: set[int] = set()

    @staticmethod
    def of(t: Tensor) -> GradientEdge | None:
        """The gradient edge of `t` as it is now; None where it does not require grad, or where
        autograd has none for it (a view made under no_grad of a tensor that requires grad: a
        custom `autograd.Function` whose forward returns a view of its input)."""
        if not t.requires_grad:
            return None
        try:
            return get_gradient_edge(t)
        except (AssertionError, RuntimeError):  # torch's "Expected gradient function to be set"
            return None

    def keep_op(self, op: int, slot: int, t: Tensor, kept: Tensor) -> None:
        """Note the edge of op output `t` (saved as `kept`), where it has one (`of`)."""
        edge = self.of(t)
        if edge is not None:
            self.ops[op, slot] = (edge, kept)

    def keep_arg(self, op: int, kept: Tensor, t: Tensor) -> None:
        """Note the edge of a rebuilt op's argument `t` (kept as `kept`), as `keep_op`."""
        edge = self.of(t)
        if edge is not None:
            self.args[op, id(kept)] = edge

    def keep_alias(self, alias: Tensor, t: Tensor) -> None:
        """Note the edge of a module input/output `t` the hook kept as `alias`, as `keep_op`."""
        edge = self.of(t)
        if edge is not None:
            self.aliases[id(alias)] = (alias, edge)

    def moved(self, old: Tensor, new: Tensor) -> None:
        """A kept alias was replaced by a copy (before a write): the copy has its edge."""
        entry = self.aliases.get(id(old))
        if entry is not None and entry[0] is old:
            del self.aliases[id(old)]  # the old alias is not held on (a store frees its memory)
            self.aliases[id(new)] = (new, entry[1])

    def moved_op(self, op: int, slot: int, new: Tensor) -> None:
        """An op output the trace keeps was replaced by a copy (before a write): the copy is kept."""
        entry = self.ops.get((op, slot))
        if entry is not None:
            self.ops[op, slot] = (entry[0], new)

    def moved_arg(self, op: int, old: Tensor, new: Tensor) -> None:
        """A rebuilt op's kept argument was replaced by a copy: the copy has its edge."""
        edge = self.args.get((op, id(old)))
        if edge is not None:
            self.args[op, id(new)] = edge

    def alias(self, t: Any) -> GradientEdge | None:
        """The edge of a kept alias `t`, or None."""
        entry = self.aliases.get(id(t))
        return entry[1] if entry is not None and entry[0] is t else None

    def arg(self, op: int, t: Any) -> GradientEdge | None:
        """The edge of the kept argument `t` of op `op`, or None."""
        return self.args.get((op, id(t)))

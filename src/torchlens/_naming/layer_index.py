"""The layer index in a name: how it must be written, which layer it names, and how many layers a
per-layer name can index on a trace (the stack it counts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchlens._naming.finders.calls import stack_of_kind
from torchlens._naming.results import LayerOutOfRange, MalformedAlias
from torchlens._naming.tables import Row, Table

if TYPE_CHECKING:
    from torchlens._trace import Trace

#: Longer digit strings are out of range of any trace, and need not be converted to an int
#: (Python refuses int() on more than 4300 digits).
_MAX_DIGITS = 18


def canonical_index(text: str) -> str:
    """`text` (an optional '-' and Unicode digits) as it must be written: ASCII, no leading zeros, no '-0'."""
    negative = text.startswith("-")
    digits = "".join(str(int(c)) for c in (text[1:] if negative else text)).lstrip("0") or "0"
    return "-" + digits if negative and digits != "0" else digits


def index_value(canonical: str) -> int:
    """The int a canonical index names; a huge one is clamped to a value no trace reaches."""
    if len(canonical.lstrip("-")) > _MAX_DIGITS:
        return -(10**_MAX_DIGITS) if canonical.startswith("-") else 10**_MAX_DIGITS
    return int(canonical)


def layer_value(text: str, table: Table, query: str, trace: Trace, row: Row | None = None) -> int:
    """The layer `text` (the digits of `query`) names, once its spelling, its sign and its range
    on `trace` are checked.

    Raises:
        MalformedAlias: `text` is not written as `canonical_index` writes it, or is negative where
            `table` takes no negative layers.
        LayerOutOfRange: it is no layer of the stack `row` indexes in `trace`.
    """
    n = n_layers(trace, row)
    canonical = canonical_index(text)
    if text != canonical:
        raise MalformedAlias(
            f"{query!r}: write the layer as {canonical} (ASCII digits, no leading zeros)."
        )
    value = index_value(canonical)
    if value < 0:
        if not table.negative_layers:
            raise MalformedAlias(
                f"{query!r}: {table.generation} layer indices are non-negative (0..{n - 1} in this trace)."
            )
        value += n
    if not 0 <= value < n:
        where = _layers_counted(trace, row)
        raise LayerOutOfRange(
            f"{query!r}: layer {text} is out of range: {where}, so layers are 0..{n - 1}"
            if n
            else f"{query!r}: {where}, so no per-layer name resolves"
        )
    return value


def _layers_counted(trace: Trace, row: Row | None) -> str:
    """What a layer index of `row` counts in `trace`, as it is: the stack it indexes and its
    length, or every stack when none can be chosen, or that there is none."""
    s = trace.structure
    stacks = list(s.stacks.values()) if s is not None else []
    listing = ", ".join(
        f"{st.name or '<root>'} ({len(st.layers)} layer{'s' if len(st.layers) != 1 else ''})"
        for st in stacks
    )
    if row is not None and row.stack is not None:
        stack = stack_of_kind(trace, row.stack)
        if stack is None:
            return f"this trace has no single {row.stack} stack (its stacks: {listing or 'none'})"
        return f"a layer index counts the layers of the {row.stack} stack {stack.name} ({len(stack.layers)})"
    if s is not None and s.lm_stack is not None:
        stack = s.stacks[s.lm_stack]
        return (
            f"a layer index counts the layers of the language-model stack {stack.name or '<root>'}, which ran "
            f"{len(stack.layers)} layer{'s' if len(stack.layers) != 1 else ''}"
        )
    if stacks:
        return (
            f"this trace has {len(stacks)} stacks of layers and none feeds a language-model head: {listing}; "
            f"a layer index counts up to the longest"
        )
    return "TorchLens found no stack of layers in this trace"


def n_layers(trace: Trace, row: Row | None = None) -> int:
    """How many layers a per-layer name can index: its own stack's (a row with `stack`), the
    language-model stack's, or, with several stacks and none feeding a language-model head, the
    longest (such names then resolve `ambiguous`)."""
    s = trace.structure
    if row is not None and row.stack is not None:
        stack = stack_of_kind(trace, row.stack)
        return len(stack.layers) if stack is not None else 0
    if s is not None and s.lm_stack is None and len(s.stacks) > 1:
        return max(len(st.layers) for st in s.stacks.values())
    return len(trace.blocks)

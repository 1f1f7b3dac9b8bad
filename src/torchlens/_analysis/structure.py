"""The structure of a traced model: stacks of layers, their sublayers, embeddings, final norm, unembedding.

This module, with `torchlens._analysis.sublayers` for what is inside one layer, decides which
module calls play which role. It is read by the facet code
(`facets.derive` asks it for the final norm and the unembedding) and by the name resolver
(`_naming.finders` asks it for layers and sublayers), so both sides agree on every rule.

Roles are found in two passes:

1. **Before the forward** (`static_roles`): from the module tree alone, a generous guess used
   only to decide which tensors the capture keeps for `save=`. Every module that could be a
   block, attention, MLP or unembedding gets that role.
2. **After the forward** (`find`): from the module tree *and the recorded data flow*:

   - A **stack** is a group of repeated modules: the children of an `nn.ModuleList` /
     `nn.Sequential` (of one class, or of several: a hybrid stack such as Jamba's Mamba and
     attention layers, one stack with per-layer roles), or two or more children of one module that
     share a class. A list of several classes inside another stack's layer is that layer's
     sublayers (T5's `block.N.layer`), not a stack. Its **layers** are the calls of those
    modules in the order they ran, one layer per
     call (a block object run three times gives three layers). A group is a stack when every
     call returns a tensor of the shape it received and each call's input is computed from the
     previous call's output, with no attention kernel and no op reading a weight on the way (a
     sublayer between them: XLM's attention modules, chained through the feed-forward network,
     are no stack). Where a stack's layers contain another stack, the inner one is kept.
   - In each layer, the **attention**, the **cross-attention** (a second attention whose keys do
     not come from the layer's input) and the **MLP** are found from the data flow
     (`torchlens._analysis.sublayers.fill_layer`, where the rules are told).
   - The **token embedding** is the first `nn.Embedding` outside every layer whose input is a
     model input. The **unembedding** is the last linear layer outside every layer whose output
     width is the token embedding's vocabulary and whose output reaches the model output (where
     no token embedding ran, a model given `inputs_embeds=`, the vocabulary is that of the
     embedding modules outside the layers that did not run, when they have one size).
   - The **language-model stack** is the stack whose last layer's output reaches the
     unembedding; without an unembedding, the only stack. A stack's **final norm** is the last
     norm outside every layer that runs after the stack's last layer, reads from its output, and
     runs before what comes next (the unembedding, for the language-model stack, when there is
     one; another stack's first layer, for the others). One rule, with or without an LM head;
     `Structure.final_norm` is the language-model stack's.

`roles=` (the escape hatch of [`trace`][torchlens.trace]) names roles by address or glob
pattern; a named role wins over every rule above.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from torchlens._analysis.graph import Graph
from torchlens._analysis.role_rules import Roles
from torchlens._analysis.role_rules import groups as repeated_groups
from torchlens._analysis.sublayers import fill_layer
from torchlens._core import ops as _ops
from torchlens._core import roles as _roles
from torchlens._core.persisted import persisted
from torchlens._core.records import ModuleCall, OpRecord, Ref


@persisted
@dataclass
class Layer:
    """One layer of a stack: one call of a block, with its sublayer calls.

    Attributes:
        call: the block's call.
        attention: the self-attention call, if any.
        cross_attention: the cross-attention call (keys from outside the layer), if any.
        mlp: the MLP call, if any.
    """

    call: ModuleCall
    attention: ModuleCall | None = None
    cross_attention: ModuleCall | None = None
    mlp: ModuleCall | None = None


@persisted
@dataclass
class Stack:
    """Layers that run one after another, each reading the previous one's output.

    Attributes:
        name: the address of the module holding the repeated layers (`"model.layers"`).
        layers: one `Layer` per call, in run order; the layer index is
            the position here.
        kind: `"decoder"` or `"encoder"` (an encoder-decoder's stacks, or one read by
            cross-attention, or a stack under a class whose name says encoder).
        final_norm: the stack's final norm (see `final_norm`), or None.
        passes: how many times the whole stack ran in the forward (a model calling `generate`
            or a decoding loop inside its forward runs every layer once per step); 1 otherwise.
        repeats: the layers of the passes after the first, in run order (`layers` holds the
            first pass, which a layer index counts).
    """

    name: str
    layers: list[Layer] = field(default_factory=list)
    kind: str = "decoder"
    final_norm: ModuleCall | None = None
    passes: int = 1
    repeats: list[Layer] = field(default_factory=list)

    @property
    def addresses(self) -> list[str]:
        """The block address of each layer (repeated for a block run several times)."""
        return [layer.call.address for layer in self.layers]


@persisted
@dataclass
class Structure:
    """What `find` decided about one traced forward.

    Attributes:
        stacks: every stack, by name, in the order their first layer ran.
        lm_stack: the stack names of decoder-only libraries read (None when none can be chosen).
        kind: `"decoder-only"`, `"encoder-only"`, `"encoder-decoder"`, `"multi-tower"` (several
            stacks, none feeding a language-model head) or `"no-stack"`.
        token_embed, unembed, final_norm: those calls, or None.
        notes: warnings issued while finding the structure.
        children: `id(call)` -> the calls made directly inside it, in run order.
    """

    stacks: dict[str, Stack] = field(default_factory=dict)
    lm_stack: str | None = None
    kind: str = "no-stack"
    token_embed: ModuleCall | None = None
    unembed: ModuleCall | None = None
    final_norm: ModuleCall | None = None
    notes: list[str] = field(default_factory=list)
    children: dict[int, list[ModuleCall]] = field(default_factory=dict, repr=False)

    @property
    def layers(self) -> list[Layer]:
        """The language-model stack's layers (empty when there is none)."""
        return self.stacks[self.lm_stack].layers if self.lm_stack is not None else []

    def describe(self) -> str:
        """`'encoder.block (2 layers), decoder.block (2 layers)'`."""
        return (
            ", ".join(
                f"{s.name or '<root>'} ({len(s.layers)} layers)" for s in self.stacks.values()
            )
            or "no stack"
        )


# -- after the forward -------------------------------------------------------------------------


def _chains(flow: Graph, calls: list[ModuleCall]) -> list[list[ModuleCall]]:
    """Split calls (in run order) into runs where each call reads the previous call's output
    (`Graph.follows`)."""
    runs: list[list[ModuleCall]] = []
    for c in calls:
        same = flow.shape(c.input_ref) is not None and flow.shape(c.input_ref) == flow.shape(
            c.output_ref
        )
        if not same:
            runs.append([])
            continue
        if runs and runs[-1] and flow.follows(runs[-1][-1], c):
            runs[-1].append(c)
        else:
            runs.append([c])
    return [r for r in runs if r]


def _passes(run: list[ModuleCall]) -> int:
    """How many times a run of calls went through the same two or more modules in the same order
    (`a b a b a b` -> 3): each time is one pass through the stack, as a decoding loop makes. A
    single module called repeatedly (ALBERT's shared layer) is one layer per call: 1."""
    order = list(dict.fromkeys(c.address for c in run))
    n = len(order)
    if n < 2 or len(run) % n or len(run) == n:
        return 1
    return len(run) // n if all(c.address == order[i % n] for i, c in enumerate(run)) else 1


def find(
    ops: list[OpRecord],
    calls: list[ModuleCall],
    modules: dict[str, nn.Module],
    roles: Roles,
    model: nn.Module,
    names: dict[nn.Module, str],
    flow: Graph | None = None,
) -> Structure:
    """Find the structure of one recorded forward; set each call's role and `roles` accordingly.

    Args:
        ops, calls: what the capture recorded.
        modules: address -> module.
        roles: address -> role from `static_roles` (with the `roles=` overrides); updated in place
            to the settled roles.
        model: the root module.
        names: module -> canonical address.
        flow: the `Graph` of `ops` and `calls`, when the caller has built it (assembly builds
            one and hands it to `facets.derive` too); else it is built here.

    Returns:
        The `Structure`.
    """
    overrides = roles.overrides
    if flow is None:
        flow = Graph(ops, calls)
    calls_of: dict[str, list[ModuleCall]] = {}
    for c in calls:
        calls_of.setdefault(c.address, []).append(c)
    struct = Structure(children=flow.kids)
    # 1. stacks
    named_blocks = [a for a, r in overrides.items() if r == "block"]
    if named_blocks:
        by_holder: dict[str, list[str]] = {}
        for a in named_blocks:
            by_holder.setdefault(a.rsplit(".", 1)[0] if "." in a else "", []).append(a)
        groups = [(h, [modules[a] for a in addrs]) for h, addrs in by_holder.items()]
    elif roles.groups is not None:
        groups = roles.groups
    else:
        groups = repeated_groups(model, names)
    candidates: list[tuple[str, list[ModuleCall]]] = []
    mixed: set[str] = set()  # candidates whose layers are of several classes
    repeated_unchained: list[str] = []
    for holder, members in groups:
        member_calls = sorted(
            (c for m in members for c in calls_of.get(names[m], [])), key=lambda c: c.first_op
        )
        if not member_calls:
            continue
        if (
            not named_blocks
            and not isinstance(modules.get(holder), (nn.ModuleList, nn.Sequential))
            and any(op.module == c.address for c in member_calls for op in flow.kernels(c))
        ):
            continue  # same-class siblings that run an attention kernel themselves are attentions, not layers
        runs = [member_calls] if named_blocks else _chains(flow, member_calls)
        if len(member_calls) >= 2:  # repeated calls must chain: a lone call among them is no stack
            runs = [r for r in runs if len(r) >= 2]
        if not runs:
            if len(members) >= 2 or len(member_calls) >= 2:
                repeated_unchained.append(holder)
            continue
        for i, run in enumerate(runs):
            candidates.append((holder if i == 0 else f"{holder}#{i}", run))
            if len({type(m) for m in members}) > 1:
                mixed.add(candidates[-1][0])
    # a list of several classes inside another stack's layer is that layer's sublayers (T5's
    # `block.N.layer`: self-attention, cross-attention, feed-forward), not a stack of its own
    inside = {
        id(d) for h, r in candidates if h not in mixed for c in r for d in flow.descendants(c)
    }
    candidates = [(h, r) for h, r in candidates if h not in mixed or id(r[0]) not in inside]
    # keep the innermost: drop a candidate whose first layer contains another candidate's layers
    kept = []
    for holder, run in candidates:
        others = {id(c) for h, r in candidates if h != holder for c in r}
        if named_blocks or not any(id(d) in others for d in flow.descendants(run[0])):
            kept.append((holder, run))
    kept.sort(key=lambda hr: hr[1][0].first_op)
    for holder, run in kept:
        passes = 1 if named_blocks else _passes(run)
        per_pass = len(run) // passes
        stack = Stack(
            holder,
            [Layer(c) for c in run[:per_pass]],
            passes=passes,
            repeats=[Layer(c) for c in run[per_pass:]],
        )
        for layer in stack.layers + stack.repeats:
            fill_layer(flow, layer, roles, modules, overrides)
        struct.stacks[holder] = stack
        if passes > 1:
            note = (
                f"torchlens: the stack {holder or '<root>'} ran {passes} times in this forward (each of its "
                f"{per_pass} layers was called {passes} times: a model calling generate, or a loop); a layer "
                "index counts the layers of one pass and per-layer names read the first pass (their call says "
                "which); read trace.modules[address].calls[i] for the others"
            )
            struct.notes.append(note)
            warnings.warn(note, stacklevel=4)
    if not struct.stacks and repeated_unchained:
        note = (
            f"torchlens: {', '.join(repeated_unchained)} hold repeated modules, but none was taken as a block "
            "(their outputs do not chain, or do not keep the shape of their input), so per-layer names find no "
            "layer; name them with trace(..., roles={'<address>.*': 'block'})"
        )
        struct.notes.append(note)
        warnings.warn(note, stacklevel=4)
    # 2. settle roles: only confirmed blocks/attention/MLP keep those roles
    confirmed: dict[int, str] = {}
    for stack in struct.stacks.values():
        for layer in stack.layers + stack.repeats:
            confirmed[id(layer.call)] = "block"
            for sub, role in (
                (layer.attention, "attention"),
                (layer.cross_attention, "attention"),
                (layer.mlp, "mlp"),
            ):
                if sub is not None:
                    confirmed[id(sub)] = role
    # an attention or MLP the caller named keeps its role outside any layer too (a named role
    # wins over every rule): its facets are found from its own ops, as a sublayer's are
    named = {
        a: ("attention" if r == "cross_attention" else r)
        for a, r in overrides.items()
        if r in ("attention", "cross_attention", "mlp")
    }
    for addr, role in list(roles.items()):
        if role in ("block", "attention", "mlp") and named.get(addr) != role:
            roles[addr] = "other"
    for c in calls:
        if (
            c.role in ("block", "attention", "mlp")
            and id(c) not in confirmed
            and named.get(c.address) != c.role
        ):
            c.role = "other"
    for c in calls:
        if id(c) in confirmed:
            c.role = confirmed[id(c)]
            roles[c.address] = c.role
    # 3. embeddings, unembedding, LM stack, final norm
    in_layer = {
        id(d)
        for s in struct.stacks.values()
        for layer in s.layers + s.repeats
        for d in [layer.call] + flow.descendants(layer.call)
    }
    outside = [c for c in calls if id(c) not in in_layer]
    root = calls[0] if calls else None
    struct.token_embed = next(
        (
            c
            for c in outside
            if isinstance(modules.get(c.address), nn.Embedding)
            and from_model_input(ops, c.input_ref)
        ),
        None,
    )
    vocab = (
        modules[struct.token_embed.address].num_embeddings
        if struct.token_embed
        else _unrun_vocab(modules, calls, struct)
    )
    named_unembed = [c for c in outside if overrides.get(c.address) == "unembed"]
    if named_unembed:
        struct.unembed = named_unembed[-1]
    elif vocab is not None and root is not None:
        heads = [
            c
            for c in outside
            if isinstance(modules.get(c.address), nn.Linear)
            and modules[c.address].out_features == vocab
            and c.role != "embedding"
            and flow.reaches(c.output_ref, root.output_ref)
        ]
        struct.unembed = heads[-1] if heads else None
    for c in calls:
        if c.role == "unembed" and c is not struct.unembed:
            c.role = "other"
            roles[c.address] = "other"
    if struct.unembed is not None:
        struct.unembed.role = roles[struct.unembed.address] = "unembed"
    feeding = [
        s
        for s in struct.stacks.values()
        if struct.unembed is not None
        and flow.reaches(s.layers[-1].call.output_ref, struct.unembed.input_ref)
    ]
    if feeding:
        struct.lm_stack = feeding[-1].name
    elif len(struct.stacks) == 1:
        struct.lm_stack = next(iter(struct.stacks))
    lm = struct.stacks[struct.lm_stack] if struct.lm_stack is not None else None
    if lm is not None and lm.passes > 1 and struct.unembed is not None:
        # the stack ran once per decoding step: the unembedding is its call after the first pass,
        # as the layers are the first pass's
        last = lm.layers[-1].call
        first = next(
            (
                c
                for c in outside
                if c.address == struct.unembed.address
                and c.first_op >= last.end_op
                and flow.reaches(last.output_ref, c.input_ref)
            ),
            None,
        )
        if first is not None and first is not struct.unembed:
            struct.unembed.role = "other"
            struct.unembed = first
            first.role = "unembed"
    # kinds
    read_by_cross = set()
    for s in struct.stacks.values():
        if any(layer.cross_attention is not None for layer in s.layers):
            s.kind = "decoder"
            for other in struct.stacks.values():
                if other is not s and any(
                    layer.cross_attention is not None
                    and _feeds_kernel(flow, other.layers[-1].call, layer.cross_attention)
                    for layer in s.layers
                ):
                    read_by_cross.add(other.name)
    for s in struct.stacks.values():
        if s.name in read_by_cross or (
            not any(layer.cross_attention is not None for layer in s.layers)
            and _encoder_named(model, s, modules)
        ):
            s.kind = "encoder"
    if not struct.stacks:
        struct.kind = "no-stack"
    elif read_by_cross:
        struct.kind = "encoder-decoder"
    elif struct.lm_stack is None:
        struct.kind = "multi-tower"
    else:
        struct.kind = (
            "encoder-only" if struct.stacks[struct.lm_stack].kind == "encoder" else "decoder-only"
        )
    for s in struct.stacks.values():
        s.final_norm = final_norm(flow, struct, outside, s)
    struct.final_norm = struct.stacks[struct.lm_stack].final_norm if struct.lm_stack else None
    return struct


def _feeds_kernel(flow: Graph, producer: ModuleCall, attn: ModuleCall) -> bool:
    return any(
        any(flow.reaches(producer.output_ref, r) for r in k.inputs if type(r) is Ref)
        for k in flow.kernels(attn)
    ) or any(flow.reaches(producer.output_ref, c.input_ref) for c in flow.kids.get(id(attn), []))


def _encoder_named(model: nn.Module, stack: Stack, modules: dict[str, nn.Module]) -> bool:
    """Whether the stack is an encoder by the family data (`_core.roles.ENCODER_MODEL_TYPES`, class names)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in _roles.ENCODER_MODEL_TYPES:
        return True
    parts = stack.name.split(".")
    holders = [".".join(parts[:i]) for i in range(len(parts) + 1)]
    return any(
        any(f in type(modules[h]).__name__ for f in _roles.ENCODER_CLASS_FRAGMENTS)
        for h in holders
        if h in modules
    )


def _unrun_vocab(
    modules: dict[str, nn.Module], calls: list[ModuleCall], struct: Structure
) -> int | None:
    """The vocabulary of a model given embeddings instead of token ids (`inputs_embeds=`): no
    token embedding ran, so the unembedding is known by the size of the one vocabulary among the
    `nn.Embedding` modules outside every layer that did not run in this forward (GPT-2's `wte`
    where its `wpe` ran); None where there is no such module, or several sizes."""
    ran = {c.address for c in calls}
    in_layers = tuple(
        layer.call.address + "." for s in struct.stacks.values() for layer in s.layers + s.repeats
    )
    sizes = {
        m.num_embeddings
        for a, m in modules.items()
        if isinstance(m, nn.Embedding) and a not in ran and not a.startswith(in_layers)
    }
    return sizes.pop() if len(sizes) == 1 else None


def from_model_input(ops: list[OpRecord], ref: Any) -> bool:
    """Whether `ref` is a model input, possibly reshaped (`input_ids.view(...)`), not computed."""
    for _ in range(8):
        if type(ref) is not Ref:
            return False
        op = ops[ref.op]
        if op.name == "input":
            return True
        if (
            op.name
            not in _ops.RESHAPE_OPS | _ops.PASS_THROUGH_OPS | _ops.INDEX_OPS | _ops.INT_CAST_OPS
            or not op.inputs
        ):
            return False
        ref = op.inputs[0]
    return False


def final_norm(
    flow: Graph, struct: Structure, outside: list[ModuleCall], stack: Stack
) -> ModuleCall | None:
    """The one final-norm rule: the last norm outside every layer that runs after the stack's last
    layer, reads from its output, and runs before whatever comes next: the unembedding for the
    language-model stack (when there is one), the first layer of a stack that starts later for
    any other (T5's encoder.final_layer_norm runs before the decoder's first block)."""
    last = stack.layers[-1].call
    if stack.name == struct.lm_stack:
        end = struct.unembed.first_op if struct.unembed is not None else None
    else:
        later = [
            s.layers[0].call.first_op
            for s in struct.stacks.values()
            if s.layers[0].call.first_op >= last.end_op
        ]
        end = (
            min(later)
            if later
            else (
                struct.unembed.first_op
                if struct.unembed is not None and struct.unembed.first_op >= last.end_op
                else None
            )
        )
    norms = [
        c
        for c in outside
        if c.role == "norm"
        and c.first_op >= last.end_op
        and (end is None or c.end_op <= end)
        and flow.reaches(last.output_ref, c.input_ref)
    ]
    return norms[-1] if norms else None

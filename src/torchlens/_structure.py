"""The structure of a traced model: stacks of layers, their sublayers, embeddings, final norm, unembedding.

This one module decides which module calls play which role. It is read by the facet code
(`facets.derive` asks it for the final norm and the unembedding) and by the name resolver
(`mechinterp.targets` asks it for layers and sublayers), so both sides agree on every rule.

Roles are found in two passes:

1. **Before the forward** (`static_roles`): from the module tree alone, a generous guess used
   only to decide which tensors the capture keeps for `save=`. Every module that could be a
   block, attention, MLP or unembedding gets that role.
2. **After the forward** (`find`): from the module tree *and the recorded data flow*:

   - A **stack** is a group of repeated modules: the children of an `nn.ModuleList` /
     `nn.Sequential` that are all of one class, or two or more children of one module that share
     a class. Its **layers** are the calls of those modules in the order they ran, one layer per
     call (a block object run three times gives three layers). A group is a stack when every
     call returns a tensor of the shape it received and each call's input is computed from the
     previous call's output. Where a stack's layers contain another stack, the inner one is kept.
   - In a layer, the **attention** is found from an attention kernel (a softmax over a
     `[batch, heads, query, key]` tensor, or a fused attention op): it is the layer's child call
     that ran the kernel, or, when that child adds its own input back (a residual inside it, as in
     T5's `T5LayerSelfAttention` or BERT's `BertAttention`), its child that ran the kernel. A second
     attention whose keys do not come from the layer's input is the **cross-attention**.
   - The **MLP** is a child call of a layer that has attention: not a norm, no kernel, at least
     two ops reading weights outside norms, found with the same descent through residual
     wrappers (T5's `T5LayerFF` -> `DenseReluDense`).
   - The **token embedding** is the first `nn.Embedding` outside every layer whose input is a
     model input. The **unembedding** is the last linear layer outside every layer whose output
     width is the token embedding's vocabulary and whose output reaches the model output.
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

import re
import warnings
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from . import _ops, _roles
from ._errors import RoleSpecError
from ._records import ModuleCall, OpRecord, Ref

#: The roles `roles=` accepts.
OVERRIDABLE_ROLES = ("block", "attention", "cross_attention", "mlp", "norm", "embedding", "unembed", "other")

#: Op names that are an attention kernel (`softmax` counts only over a >= 3-d tensor: a router's
#: softmax over experts is 2-d).
_KERNEL_OPS = _ops.SOFTMAX_OPS | _ops.FUSED_ATTENTION_OPS


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
    """

    name: str
    layers: list[Layer] = field(default_factory=list)
    kind: str = "decoder"
    final_norm: ModuleCall | None = None

    @property
    def addresses(self) -> list[str]:
        """The block address of each layer (repeated for a block run several times)."""
        return [layer.call.address for layer in self.layers]


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
        return self.stacks[self.lm_stack].layers if self.lm_stack else []

    def describe(self) -> str:
        """`'encoder.block (2 layers), decoder.block (2 layers)'`."""
        return ", ".join(f"{s.name or '<root>'} ({len(s.layers)} layers)" for s in self.stacks.values()) or "no stack"


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
    from ._errors import close_matches

    out: dict[str, str] = {}
    for key, role in roles.items():
        if not isinstance(key, str):
            raise RoleSpecError(f"roles= key {key!r} is not a string (a module address or a glob pattern).")
        if role not in OVERRIDABLE_ROLES:
            hits = close_matches(str(role), OVERRIDABLE_ROLES)
            hint = f" Did you mean {', '.join(repr(h) for h in hits)}?" if hits else ""
            raise RoleSpecError(f"roles={{{key!r}: {role!r}}}: {role!r} is not a role.{hint} "
                                f"Roles: {', '.join(OVERRIDABLE_ROLES)}.")
        rx = _glob(key)
        hit = [a for a in addresses if a == key or rx.fullmatch(a)]
        if not hit:
            hits = close_matches(key, addresses)
            hint = f" Did you mean {', '.join(repr(h) for h in hits)}?" if hits else ""
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


def _groups(model: nn.Module, names: dict[nn.Module, str]) -> list[tuple[str, list[nn.Module]]]:
    """Groups of repeated non-leaf modules, as (holder address, distinct modules in order)."""
    out = []
    for holder in names:  # every module of `model`, once each, in `model.modules()` order
        kids = []
        for m in holder._modules.values():
            if m is not None and m not in kids:
                kids.append(m)
        nonleaf = [m for m in kids if any(c is not None for c in m._modules.values())]
        if not nonleaf:
            continue
        if isinstance(holder, (nn.ModuleList, nn.Sequential)):
            if len({type(m) for m in kids}) == 1 and len(nonleaf) == len(kids):
                out.append((names[holder], nonleaf))
            continue
        by_class: dict[type, list[nn.Module]] = {}
        for m in nonleaf:
            by_class.setdefault(type(m), []).append(m)
        for group in by_class.values():
            if len(group) >= 2:
                out.append((names[holder], group))  # `find` drops siblings that are attentions (BART's two)
    return out


def _vocab_sizes(names: dict[nn.Module, str]) -> set[int]:
    return {m.num_embeddings for m in names if isinstance(m, nn.Embedding)}


class Roles(dict):
    """address -> role, carrying the user's `roles=` (after `parse_roles`) as `overrides`."""

    def __init__(self, roles: dict[str, str], overrides: dict[str, str]):
        super().__init__(roles)
        self.overrides = overrides
        #: `_groups(model, names)` as `static_roles` found it (`find` reads it instead of walking
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
        elif isinstance(module, nn.Linear) and (module.out_features in vocab or addr.rsplit(".", 1)[-1] in _roles.UNEMBED_ATTRS):
            roles[addr] = "unembed"
        elif isinstance(module, nn.MultiheadAttention) or any(f in type(module).__name__ for f in _roles.ATTENTION_CLASS_FRAGMENTS):
            roles[addr] = "attention"
    roles.groups = _groups(model, names)
    for _, group in roles.groups:
        for block in group:
            roles[names[block]] = "block"
            for attr, child in block.named_children():
                role = _roles.child_role(attr, child)
                if role and roles[names[child]] == "other":
                    roles[names[child]] = role
    for addr, role in overrides.items():
        roles[addr] = "attention" if role == "cross_attention" else role
    return roles


# -- after the forward -------------------------------------------------------------------------


class _Flow:
    """Data-flow helpers over the recorded ops."""

    def __init__(self, ops: list[OpRecord], calls: list[ModuleCall]):
        self.ops = ops
        self.kids: dict[int, list[ModuleCall]] = {}
        for c in calls:
            if c.parent is not None:
                self.kids.setdefault(id(c.parent), []).append(c)

    def ancestors(self, ref: Any, lo: int) -> set[int]:
        seen: set[int] = set()
        todo = [ref]
        while todo:
            r = todo.pop()
            if type(r) is not Ref or r.op < lo or r.op in seen:
                continue
            seen.add(r.op)
            todo.extend(self.ops[r.op].inputs)
        return seen

    def reaches(self, src: Any, dst: Any) -> bool:
        """Whether the tensor `dst` is computed from the tensor `src` (or is it)."""
        if type(src) is not Ref or type(dst) is not Ref:
            return False
        return src == dst or src.op in self.ancestors(dst, src.op)

    def shape(self, ref: Any):
        return tuple(self.ops[ref.op].shapes[ref.slot]) if type(ref) is Ref else None

    def kernels(self, call: ModuleCall) -> list[OpRecord]:
        return [op for op in self.ops[call.first_op : call.end_op] if self.is_kernel(op)]

    def is_kernel(self, op: OpRecord) -> bool:
        """An attention kernel: a fused attention op, or a matmul-like op over 3 or more dimensions."""
        return op.name in _KERNEL_OPS and (op.name in _ops.FUSED_ATTENTION_OPS or len(op.shape) >= 3)

    def follows(self, prev: ModuleCall, call: ModuleCall) -> bool:
        """Whether `call` reads `prev`'s output as the next layer would: computed from it, with no
        attention kernel on the way. The query/value and output projections of one attention (same
        class, same width, wrapped as TransformerLens's bridge wraps them) are linked through the
        attention kernel, so they do not chain as layers do."""
        src, dst = prev.output_ref, call.input_ref
        if type(src) is not Ref or type(dst) is not Ref:
            return False
        if src == dst:
            return True
        upstream = self.ancestors(dst, src.op)  # one walk answers both questions (`reaches` would walk it again)
        if src.op not in upstream:
            return False
        return not any(self.is_kernel(self.ops[i]) for i in upstream if prev.end_op <= i < call.first_op)

    def adds_own_input(self, call: ModuleCall) -> bool:
        """Whether the call adds its own input back (a residual connection inside it)."""
        if type(call.input_ref) is not Ref:
            return False
        same = {call.input_ref}  # the input, and casts of it that return the same values (`x.to(float32)`)
        for op in self.ops[call.first_op : call.end_op]:
            if op.name in _ops.ADD_OPS and same.intersection(op.inputs):
                return True
            if op.name in _ops.PASS_THROUGH_OPS and op.inputs and op.inputs[0] in same:
                same.add(Ref(op.index, 0))
        return False

    def descendants(self, call: ModuleCall) -> list[ModuleCall]:
        out, todo = [], list(self.kids.get(id(call), []))
        while todo:
            c = todo.pop(0)
            out.append(c)
            todo.extend(self.kids.get(id(c), []))
        return out


def _chains(flow: _Flow, calls: list[ModuleCall]) -> list[list[ModuleCall]]:
    """Split calls (in run order) into runs where each call reads the previous call's output
    (`_Flow.follows`)."""
    runs: list[list[ModuleCall]] = []
    for c in calls:
        same = flow.shape(c.input_ref) is not None and flow.shape(c.input_ref) == flow.shape(c.output_ref)
        if not same:
            runs.append([])
            continue
        if runs and runs[-1] and flow.follows(runs[-1][-1], c):
            runs[-1].append(c)
        else:
            runs.append([c])
    return [r for r in runs if r]


def _sublayer(flow: _Flow, layer: ModuleCall, pick) -> list[ModuleCall]:
    """Calls under `layer` that `pick` accepts, descending through residual wrappers.

    A picked child that adds its own input back (a residual inside it) is replaced by its picked
    children, when it has any; so is one that only wraps a picked child returning the same output.
    """
    out: list[ModuleCall] = []
    todo = list(flow.kids.get(id(layer), []))  # iterative: a recursive closure would make a reference cycle
    while todo:
        node = todo.pop(0)
        if not pick(node):
            continue
        inner = [k for k in flow.kids.get(id(node), []) if pick(k)]
        if inner and flow.adds_own_input(node):
            todo[:0] = inner
            continue
        if len(inner) == 1 and type(node.output_ref) is Ref and inner[0].output_ref == node.output_ref:
            todo.insert(0, inner[0])  # a pure wrapper (GPT-Neo's attn around attn.attention): take the inner one
            continue
        out.append(node)
    return out


def _param_ops(flow: _Flow, call: ModuleCall, roles: dict[str, str]) -> int:
    return sum(
        1 for op in flow.ops[call.first_op : call.end_op]
        if roles.get(op.module) != "norm" and any(isinstance(r, str) for r in op.inputs)
    )


def _fill_layer(flow: _Flow, layer: Layer, roles: dict[str, str], modules: dict[str, nn.Module],
                overrides: dict[str, str]) -> None:
    below = flow.descendants(layer.call)
    named = {c.address: overrides[c.address] for c in below if c.address in overrides}
    if named:
        attns = [c for c in below if named.get(c.address) in ("attention", "cross_attention")]
    else:
        attns = _sublayer(flow, layer.call, lambda c: bool(flow.kernels(c)) or isinstance(
            modules.get(c.address), nn.MultiheadAttention))
    for a in attns:
        if named.get(a.address) == "cross_attention" or (layer.attention is not None and _keys_outside(flow, layer.call, a)):
            layer.cross_attention = layer.cross_attention or a
        elif layer.attention is None:
            layer.attention = a
    if named:
        mlps = [c for c in below if named.get(c.address) == "mlp"]
    elif layer.attention is None:
        mlps = []  # no attention (an SSM mixer, say): no MLP is looked for either
    else:
        mlps = _sublayer(flow, layer.call, lambda c: (
            roles.get(c.address) not in ("norm", "embedding")
            and not flow.kernels(c)
            and bool(flow.kids.get(id(c)))
            and _param_ops(flow, c, roles) >= 2
        ))
    layer.mlp = mlps[0] if mlps else None


def _keys_outside(flow: _Flow, layer: ModuleCall, attn: ModuleCall) -> bool:
    """Whether the attention's keys are not computed from the layer's input (cross-attention)."""
    kernel = next(iter(flow.kernels(attn)), None)
    if kernel is None or type(layer.input_ref) is not Ref:
        return False
    if kernel.name in _ops.FUSED_ATTENTION_OPS:
        return len(kernel.inputs) > 1 and not flow.reaches(layer.input_ref, kernel.inputs[1])
    r = kernel.inputs[0] if kernel.inputs else None  # eager: walk back from the scores to their matmul
    for _ in range(12):
        if type(r) is not Ref:
            return False
        op = flow.ops[r.op]
        if op.name in _ops.MATMUL_OPS:
            k = _ops.MATMUL_OPERANDS.get(op.name, (0, 1))[1]
            return k < len(op.inputs) and not flow.reaches(layer.input_ref, op.inputs[k])
        r = next((x for x in op.inputs if type(x) is Ref), None)
    return False


def find(ops: list[OpRecord], calls: list[ModuleCall], modules: dict[str, nn.Module], roles: Roles,
         model: nn.Module, names: dict[nn.Module, str]) -> Structure:
    """Find the structure of one recorded forward; set each call's role and `roles` accordingly.

    Args:
        ops, calls: what the capture recorded.
        modules: address -> module.
        roles: address -> role from `static_roles` (with the `roles=` overrides); updated in place
            to the settled roles.
        model: the root module.
        names: module -> canonical address.

    Returns:
        The `Structure`.
    """
    overrides = roles.overrides
    flow = _Flow(ops, calls)
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
    else:
        groups = roles.groups if getattr(roles, "groups", None) is not None else _groups(model, names)
    candidates: list[tuple[str, list[ModuleCall]]] = []
    repeated_unchained: list[str] = []
    for holder, members in groups:
        member_calls = sorted((c for m in members for c in calls_of.get(names[m], [])), key=lambda c: c.first_op)
        if not member_calls:
            continue
        if not named_blocks and not isinstance(modules.get(holder), (nn.ModuleList, nn.Sequential)) and any(
            op.module == c.address for c in member_calls for op in flow.kernels(c)
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
    # keep the innermost: drop a candidate whose first layer contains another candidate's layers
    kept = []
    for holder, run in candidates:
        others = {id(c) for h, r in candidates if h != holder for c in r}
        if named_blocks or not any(id(d) in others for d in flow.descendants(run[0])):
            kept.append((holder, run))
    kept.sort(key=lambda hr: hr[1][0].first_op)
    for holder, run in kept:
        stack = Stack(holder, [Layer(c) for c in run])
        for layer in stack.layers:
            _fill_layer(flow, layer, roles, modules, overrides)
        struct.stacks[holder] = stack
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
        for layer in stack.layers:
            confirmed[id(layer.call)] = "block"
            for sub, role in ((layer.attention, "attention"), (layer.cross_attention, "attention"), (layer.mlp, "mlp")):
                if sub is not None:
                    confirmed[id(sub)] = role
    for addr, role in list(roles.items()):
        if role in ("block", "attention", "mlp"):
            roles[addr] = "other"
    for c in calls:
        if c.role in ("block", "attention", "mlp") and id(c) not in confirmed:
            c.role = "other"
    for c in calls:
        if id(c) in confirmed:
            c.role = confirmed[id(c)]
            roles[c.address] = c.role
    # 3. embeddings, unembedding, LM stack, final norm
    in_layer = {id(d) for s in struct.stacks.values() for layer in s.layers for d in [layer.call] + flow.descendants(layer.call)}
    outside = [c for c in calls if id(c) not in in_layer]
    root = calls[0] if calls else None
    struct.token_embed = next(
        (c for c in outside if isinstance(modules.get(c.address), nn.Embedding) and from_model_input(ops, c.input_ref)), None
    )
    vocab = modules[struct.token_embed.address].num_embeddings if struct.token_embed else None
    named_unembed = [c for c in outside if overrides.get(c.address) == "unembed"]
    if named_unembed:
        struct.unembed = named_unembed[-1]
    elif vocab is not None and root is not None:
        heads = [
            c for c in outside
            if isinstance(modules.get(c.address), nn.Linear) and modules[c.address].out_features == vocab
            and c.role != "embedding" and flow.reaches(c.output_ref, root.output_ref)
        ]
        struct.unembed = heads[-1] if heads else None
    for c in calls:
        if c.role == "unembed" and c is not struct.unembed:
            c.role = "other"
            roles[c.address] = "other"
    if struct.unembed is not None:
        struct.unembed.role = roles[struct.unembed.address] = "unembed"
    feeding = [
        s for s in struct.stacks.values()
        if struct.unembed is not None and flow.reaches(s.layers[-1].call.output_ref, struct.unembed.input_ref)
    ]
    if feeding:
        struct.lm_stack = feeding[-1].name
    elif len(struct.stacks) == 1:
        struct.lm_stack = next(iter(struct.stacks))
    # kinds
    read_by_cross = set()
    for s in struct.stacks.values():
        if any(layer.cross_attention is not None for layer in s.layers):
            s.kind = "decoder"
            for other in struct.stacks.values():
                if other is not s and any(
                    layer.cross_attention is not None and _feeds_kernel(flow, other.layers[-1].call, layer.cross_attention)
                    for layer in s.layers
                ):
                    read_by_cross.add(other.name)
    for s in struct.stacks.values():
        if s.name in read_by_cross or (
            not any(layer.cross_attention is not None for layer in s.layers) and _encoder_named(model, s, modules)
        ):
            s.kind = "encoder"
    if not struct.stacks:
        struct.kind = "no-stack"
    elif read_by_cross:
        struct.kind = "encoder-decoder"
    elif struct.lm_stack is None:
        struct.kind = "multi-tower"
    else:
        struct.kind = "encoder-only" if struct.stacks[struct.lm_stack].kind == "encoder" else "decoder-only"
    for s in struct.stacks.values():
        s.final_norm = final_norm(flow, struct, outside, s)
    struct.final_norm = struct.stacks[struct.lm_stack].final_norm if struct.lm_stack else None
    return struct


def _feeds_kernel(flow: _Flow, producer: ModuleCall, attn: ModuleCall) -> bool:
    return any(
        any(flow.reaches(producer.output_ref, r) for r in k.inputs if type(r) is Ref) for k in flow.kernels(attn)
    ) or any(flow.reaches(producer.output_ref, c.input_ref) for c in flow.kids.get(id(attn), []))


def _encoder_named(model: nn.Module, stack: Stack, modules: dict[str, nn.Module]) -> bool:
    """Whether the stack is an encoder by the family data (`_roles.ENCODER_MODEL_TYPES`, class names)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in _roles.ENCODER_MODEL_TYPES:
        return True
    parts = stack.name.split(".")
    holders = [".".join(parts[:i]) for i in range(len(parts) + 1)]
    return any(
        any(f in type(modules[h]).__name__ for f in _roles.ENCODER_CLASS_FRAGMENTS) for h in holders if h in modules
    )


def from_model_input(ops: list[OpRecord], ref: Any) -> bool:
    """Whether `ref` is a model input, possibly reshaped (`input_ids.view(...)`), not computed."""
    for _ in range(8):
        if type(ref) is not Ref:
            return False
        op = ops[ref.op]
        if op.name == "input":
            return True
        if op.name not in _ops.RESHAPE_OPS | _ops.PASS_THROUGH_OPS | _ops.INDEX_OPS | _ops.INT_CAST_OPS or not op.inputs:
            return False
        ref = op.inputs[0]
    return False


def final_norm(flow: _Flow, struct: Structure, outside: list[ModuleCall], stack: Stack) -> ModuleCall | None:
    """The one final-norm rule: the last norm outside every layer that runs after the stack's last
    layer, reads from its output, and runs before whatever comes next: the unembedding for the
    language-model stack (when there is one), the first layer of a stack that starts later for
    any other (T5's encoder.final_layer_norm runs before the decoder's first block)."""
    last = stack.layers[-1].call
    if stack.name == struct.lm_stack:
        end = struct.unembed.first_op if struct.unembed is not None else None
    else:
        later = [s.layers[0].call.first_op for s in struct.stacks.values() if s.layers[0].call.first_op >= last.end_op]
        end = min(later) if later else (struct.unembed.first_op if struct.unembed is not None
                                        and struct.unembed.first_op >= last.end_op else None)
    norms = [
        c for c in outside
        if c.role == "norm" and c.first_op >= last.end_op
        and (end is None or c.end_op <= end)
        and flow.reaches(last.output_ref, c.input_ref)
    ]
    return norms[-1] if norms else None

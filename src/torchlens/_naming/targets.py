"""Targets: which module of a trace a table row reads, one `Target` row each, checked on import.

A row of a naming table says *what* it reads (`target="ln2"`, `facet="scale"`); this module
says *where* that is in a given trace. Each target is found from module roles and from which
module's output feeds which module's input (the finders, `torchlens._naming.finders`), so the
same row reads the right module on GPT-2 (`transformer.h.0.ln_2`), Llama
(`model.layers.0.post_attention_layernorm`) or Gemma-2 (`model.layers.0.pre_feedforward_layernorm`).
Layers, sublayers, embeddings, final norm and unembedding come from the trace's structure
(`torchlens._analysis.structure`), so a layer index counts the calls of the language-model
stack's blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchlens._core.errors import TorchLensError
from torchlens._core.facet_spec import absent_reason
from torchlens._core.records import ModuleCall
from torchlens._core.roles import ROLES
from torchlens._naming.finders.block_children import (
    attn_out_proj,
    post_ln,
    post_ln_block,
    post_ln_of,
    pre_ln_mlp,
    split_mlp,
)
from torchlens._naming.finders.calls import layer_of, own_output, stack_of_kind, sublayer
from torchlens._naming.finders.embeddings import (
    embed_norm,
    embedded,
    pos_embed,
    scaled_embed_block,
    token_embed,
    type_embed,
)
from torchlens._naming.finders.sublayers import (
    GATED_BY,
    attn_o,
    feeds,
    mlp_gated,
    norm_where,
    out_final,
    residual_wrapper,
    sandwich_norm,
)

if TYPE_CHECKING:
    from torchlens._trace import Trace


def _root(trace: Trace, layer: int) -> ModuleCall | None:
    """The root module's call (the model's forward)."""
    return trace.modules[""].calls[0] if trace.modules[""].calls else None


#: Why a target read from the token embedding is absent: no embedding module read the input ids.
_NO_TOKEN_EMBEDDING = (
    "no embedding module read the model's input ids (a model given inputs_embeds= runs no token "
    "embedding: call it with input_ids for this site)"
)


#: Why a decoder layer has no norm after one of its sublayers (`post_ln_of`), either.
_NOT_POST_LN = "the block is not post-LN with a norm after each of its three sublayers"


@dataclass(frozen=True)
class Target:
    """What a naming row's `target` names: one kind of module a trace may have.

    Attributes:
        name: the key a row uses (`"ln2"`, `"attn_o"`).
        find: `find(trace, layer) -> ModuleCall | None`: the call in that trace (`layer` is a layer
            index of the language-model stack, or a `Layer` of another stack; ignored when not
            `per_layer`).
        per_layer: whether there is one per layer (a sublayer, a norm in the block) or one per
            model (an embedding, the final norm).
        roles: the roles the module it finds can have: a row may read only facets of those
            roles, or the `input`/`output` every module has.
        absent: why a trace may have none.
    """

    name: str
    find: Callable
    per_layer: bool
    roles: tuple[str, ...]
    absent: str


def check_targets(rows: tuple[Target, ...]) -> dict[str, Target]:
    """The rows by name, once each is checked: a unique name, and roles TorchLens has.

    Raises:
        TorchLensError: a name appears twice, or a row names a role `_core.roles.ROLES` lacks.
    """
    by_name: dict[str, Target] = {}
    for t in rows:
        if t.name in by_name:
            raise TorchLensError(f"two targets are named {t.name!r}")
        bad = [r for r in t.roles if r not in ROLES]
        if not t.roles or bad:
            raise TorchLensError(
                f"target {t.name!r} names roles {list(t.roles)}; each must be one of {', '.join(ROLES)}"
            )
        by_name[t.name] = t
    return by_name


#: target name -> its `Target` row, checked on import.
TARGETS: dict[str, Target] = check_targets(
    (
        Target(
            name="block",
            find=lambda t, i: layer_of(t, i).call,
            per_layer=True,
            roles=("block",),
            absent="no block",
        ),
        Target(
            name="attention",
            find=lambda t, i: sublayer(t, i, "attention"),
            per_layer=True,
            roles=("attention",),
            absent="the block has no attention sublayer",
        ),
        Target(
            name="attention_own",
            find=lambda t, i: own_output(t, i, "attention"),
            per_layer=True,
            roles=("attention",),
            absent="the block has no attention sublayer, or its attention module adds the residual itself (BLOOM), "
            "so its output is the residual stream after attention, not the attention's own output (the output "
            "projection's is blocks.<L>.attn.o.hook_out in generation='4.x')",
        ),
        Target(
            name="mlp_own",
            find=lambda t, i: own_output(t, i, "mlp"),
            per_layer=True,
            roles=("mlp",),
            absent="the block has no MLP sublayer, or its MLP module adds the residual itself (BLOOM), so its "
            "output is the residual stream after the MLP, not the MLP's own output (the down projection's is "
            "blocks.<L>.mlp.out.hook_out in generation='4.x')",
        ),
        Target(
            name="cross_attention",
            find=lambda t, i: sublayer(t, i, "cross_attention"),
            per_layer=True,
            roles=("attention",),
            absent="the block has no cross-attention sublayer",
        ),
        Target(
            name="mlp",
            find=lambda t, i: sublayer(t, i, "mlp"),
            per_layer=True,
            roles=("mlp",),
            absent="the block has no MLP sublayer: no single module of it maps each position through a nonlinearity "
            "after its token mixer (none does, or several do, such as a dense and a shared MLP side by side)",
        ),
        Target(
            name="ln1",
            find=lambda t, i: norm_where(t, i, feeds, "attention"),
            per_layer=True,
            roles=("norm",),
            absent="no norm feeds the attention input (the block normalizes after its sublayers)",
        ),
        Target(
            name="ln2",
            find=lambda t, i: norm_where(t, i, feeds, "mlp") or pre_ln_mlp(0)(t, i),
            per_layer=True,
            roles=("norm",),
            absent="no norm feeds the MLP input (the block normalizes after its sublayers)",
        ),
        Target(
            name="attn_post_norm",
            find=lambda t, i: sandwich_norm(t, i, "attention"),
            per_layer=True,
            roles=("norm",),
            absent="no norm is applied to the attention output before it joins the residual stream (no sandwich norm)",
        ),
        Target(
            name="mlp_post_norm",
            find=lambda t, i: sandwich_norm(t, i, "mlp"),
            per_layer=True,
            roles=("norm",),
            absent="no norm is applied to the MLP output before it joins the residual stream (no sandwich norm)",
        ),
        Target(
            name="attn_out_final",
            find=out_final("attention"),
            per_layer=True,
            roles=("norm", "attention"),
            absent="no attention sublayer whose output the layer adds to the residual stream, as it is or "
            "changed on the way (times a constant, through a sandwich norm) into one operand TorchLens "
            "found (Falcon-H1 scales its attention's output and sums it with its mixer's first)",
        ),
        Target(
            name="mlp_out_final",
            find=out_final("mlp"),
            per_layer=True,
            roles=("norm", "mlp"),
            absent="no MLP sublayer whose output the layer adds to the residual stream, as it is or "
            "changed on the way (times a constant, through a sandwich norm) into one operand TorchLens "
            "found (a layer may scale its MLP's output and sum it with another branch first)",
        ),
        Target(
            name="attn_o",
            find=attn_o,
            per_layer=True,
            roles=("other",),
            absent="the attention has no output projection module",
        ),
        Target(
            name="mlp_gated",
            find=mlp_gated,
            per_layer=True,
            roles=("mlp",),
            absent=absent_reason(GATED_BY),
        ),
        Target(
            name="token_embed",
            find=lambda t, i: token_embed(t),
            per_layer=False,
            roles=("embedding",),
            absent=_NO_TOKEN_EMBEDDING,
        ),
        Target(
            name="embedded_tokens",
            find=lambda t, i: embedded(t, alone=True),
            per_layer=False,
            roles=("embedding", "norm"),
            absent=_NO_TOKEN_EMBEDDING,
        ),
        Target(
            name="embedded_sum",
            find=lambda t, i: embedded(t, alone=False),
            per_layer=False,
            roles=("embedding", "norm"),
            absent=_NO_TOKEN_EMBEDDING,
        ),
        Target(
            name="pos_embed",
            find=lambda t, i: pos_embed(t),
            per_layer=False,
            roles=("embedding",),
            absent="no learned position embedding module ran (positions are rotary or absent), or it cannot be "
            "told from the other embeddings",
        ),
        Target(
            name="final_norm",
            find=lambda t, i: t.structure.final_norm,
            per_layer=False,
            roles=("norm",),
            absent="no norm runs between the last block and the unembedding",
        ),
        Target(
            name="unembed",
            find=lambda t, i: t.structure.unembed,
            per_layer=False,
            roles=("unembed",),
            absent="the model has no unembedding (lm_head) module",
        ),
        Target(
            name="post_ln1",
            find=lambda t, i: post_ln(t, i, 0),
            per_layer=True,
            roles=("norm",),
            absent="the block is not post-LN (no norm after the attention's residual add)",
        ),
        Target(
            name="post_ln2",
            find=lambda t, i: post_ln(t, i, -1),
            per_layer=True,
            roles=("norm",),
            absent="the block is not post-LN (its output is not a norm's output)",
        ),
        Target(
            name="post_ln_block",
            find=post_ln_block,
            per_layer=True,
            roles=("block",),
            absent="the block is not post-LN (its output is not a norm's output)",
        ),
        Target(
            name="attn_out_proj",
            find=attn_out_proj,
            per_layer=True,
            roles=("other",),
            absent="no output projection reads the attention's output outside it",
        ),
        Target(
            name="split_mlp_in",
            find=lambda t, i: split_mlp(t, i, 0),
            per_layer=True,
            roles=("other",),
            absent="no MLP split over two modules between the block's two norms",
        ),
        Target(
            name="split_mlp_out",
            find=lambda t, i: split_mlp(t, i, -1),
            per_layer=True,
            roles=("other",),
            absent="no MLP split over two modules between the block's two norms",
        ),
        Target(
            name="pre_ln_mlp_in",
            find=pre_ln_mlp(1),
            per_layer=True,
            roles=("other",),
            absent="the block is not pre-LN with an MLP held by no module of its own (a norm, then two "
            "weighted layers, all children of the block)",
        ),
        Target(
            name="pre_ln_mlp_out",
            find=pre_ln_mlp(2),
            per_layer=True,
            roles=("other",),
            absent="the block is not pre-LN with an MLP held by no module of its own",
        ),
        Target(
            name="type_embed",
            find=lambda t, i: type_embed(t),
            per_layer=False,
            roles=("embedding",),
            absent="no token-type embedding module ran",
        ),
        Target(
            name="embed_norm",
            find=lambda t, i: embed_norm(t),
            per_layer=False,
            roles=("norm",),
            absent="no norm outside the layers feeds the first block",
        ),
        Target(
            name="scaled_embed_block",
            find=lambda t, i: scaled_embed_block(t),
            per_layer=False,
            roles=("block",),
            absent="the first block does not read the token embedding scaled outside its module",
        ),
        Target(
            name="ln_cross",
            find=lambda t, i: norm_where(t, i, feeds, "cross_attention"),
            per_layer=True,
            roles=("norm",),
            absent="no norm feeds the cross-attention input",
        ),
        Target(
            name="dec_ln1",
            find=lambda t, i: post_ln_of(t, i, 0) or norm_where(t, i, feeds, "attention"),
            per_layer=True,
            roles=("norm",),
            absent=f"no norm feeds the self-attention input, and {_NOT_POST_LN}",
        ),
        Target(
            name="dec_ln2",
            find=lambda t, i: post_ln_of(t, i, 1) or norm_where(t, i, feeds, "cross_attention"),
            per_layer=True,
            roles=("norm",),
            absent=f"no norm feeds the cross-attention input, and {_NOT_POST_LN}",
        ),
        Target(
            name="dec_ln3",
            find=lambda t, i: (
                post_ln_of(t, i, 2) or norm_where(t, i, feeds, "mlp") or pre_ln_mlp(0)(t, i)
            ),
            per_layer=True,
            roles=("norm",),
            absent=f"no norm feeds the MLP input, and {_NOT_POST_LN}",
        ),
        Target(
            name="cross_kv_source",
            find=lambda t, i: None,
            per_layer=True,
            roles=("attention",),
            absent="the cross-attention's keys and values are projected from the encoder's output, which is not "
            "an input TorchLens records for the cross-attention module (its input is the decoder's stream); the "
            "projected keys and values are cross_attn.k.hook_out and cross_attn.v.hook_out",
        ),
        Target(
            name="first_block",
            find=lambda t, i: layer_of(t, 0).call if t.structure.layers else None,
            per_layer=False,
            roles=("block",),
            absent="no block ran",
        ),
        Target(
            name="attn_residual",
            find=residual_wrapper("attention"),
            per_layer=True,
            roles=("other",),
            absent="no module between the block and its attention adds the residual",
        ),
        Target(
            name="cross_residual",
            find=residual_wrapper("cross_attention"),
            per_layer=True,
            roles=("other",),
            absent="no module between the block and its cross-attention adds the residual",
        ),
        Target(name="root", find=_root, per_layer=False, roles=("root",), absent=""),
    )
)


def find_call(
    trace: Trace, target: str, layer: int | None, stack: str | None = None
) -> tuple[ModuleCall | None, str]:
    """The module call `target` names in `trace` at `layer` of the language-model stack (or of the
    stack of kind `stack`), or None and the reason."""
    row = TARGETS[target]
    finder, why = row.find, row.absent
    if stack is not None:
        st = stack_of_kind(trace, stack)
        if st is None:
            return None, f"the model has no single {stack} stack"
        if layer is not None:
            layer = st.layers[layer]
        if (
            target == "final_norm"
        ):  # the stack's own, by `_analysis.structure`'s one final-norm rule
            return st.final_norm, "no norm reads the last layer's output"
    elif target == "final_norm" and (trace.structure is None or trace.structure.lm_stack is None):
        return None, (
            "TorchLens found no language-model stack of layers in this trace, so no norm is the one "
            "between the last block and the unembedding"
        )
    return finder(trace, layer), why


def find(trace: Trace, target: str, layer: int | None) -> tuple[str | None, str]:
    """The module address `target` names in `trace` at `layer`, or None and the reason."""
    call, why = find_call(trace, target, layer)
    return (call.address if call is not None else None), why

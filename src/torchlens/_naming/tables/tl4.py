"""TransformerLens 4.x `TransformerBridge` canonical (component-path) hook names (checked against 4.3)."""

from torchlens._naming.tables import Row, Table
from torchlens._naming.tables.tl4_encdec import encoder_decoder_rows

_PER_HEAD_RESID = (
    "a per-head copy of the pre-norm residual; read blocks.{L}.hook_in and broadcast it over heads"
)
_ROTARY = (
    "rotary cos/sin tables; TorchLens has no facet for them (they are op outputs in trace.ops)"
)

ROWS = (
    Row(
        name="embed.hook_in",
        target="token_embed",
        facet="indices",
        meaning="token ids entering the embedding",
    ),
    Row(name="embed.hook_out", target="token_embed", facet="output", meaning="token embedding"),
    Row(
        name="pos_embed.hook_in",
        target="pos_embed",
        facet="input",
        meaning="position ids",
        note="absent on rotary models",
    ),
    Row(
        name="pos_embed.hook_out",
        target="pos_embed",
        facet="output",
        meaning="learned position embedding",
        note="absent on rotary models",
    ),
    Row(
        name="rotary_emb.hook_in",
        target=None,
        facet=None,
        meaning="rotary module input",
        note=_ROTARY,
    ),
    Row(
        name="rotary_emb.hook_out",
        target=None,
        facet=None,
        meaning="rotary module output (cos, sin)",
        note=_ROTARY,
    ),
    Row(
        name="rotary_emb.hook_cos",
        target=None,
        facet=None,
        meaning="rotary cos table",
        note=_ROTARY,
    ),
    Row(
        name="rotary_emb.hook_sin",
        target=None,
        facet=None,
        meaning="rotary sin table",
        note=_ROTARY,
    ),
    Row(
        name="blocks.{L}.hook_in",
        target="block",
        facet="resid_pre",
        meaning="residual entering the block",
    ),
    Row(
        name="blocks.{L}.ln1.hook_in",
        target="ln1",
        facet="input",
        meaning="pre-attention norm input (= resid_pre)",
    ),
    Row(
        name="blocks.{L}.ln1.hook_scale",
        target="ln1",
        facet="scale",
        meaning="pre-attention norm divisor",
    ),
    Row(
        name="blocks.{L}.ln1.hook_normalized",
        target="ln1",
        facet="normalized",
        meaning="pre-attention norm output before the gain",
    ),
    Row(
        name="blocks.{L}.ln1.hook_out",
        target="ln1",
        facet="output",
        meaning="pre-attention norm output",
    ),
    Row(
        name="blocks.{L}.attn.hook_in",
        target="attention",
        facet="input",
        meaning="attention input (normed residual)",
    ),
    Row(
        name="blocks.{L}.attn.hook_attn_in",
        target=None,
        facet=None,
        meaning="pre-norm residual repeated per head (set_use_attn_in)",
        note=_PER_HEAD_RESID,
    ),
    Row(
        name="blocks.{L}.attn.hook_q_input",
        target=None,
        facet=None,
        meaning="pre-norm residual per head, q path (set_use_split_qkv_input)",
        note=_PER_HEAD_RESID,
    ),
    Row(
        name="blocks.{L}.attn.hook_k_input",
        target=None,
        facet=None,
        meaning="pre-norm residual per kv head, k path",
        note=_PER_HEAD_RESID,
    ),
    Row(
        name="blocks.{L}.attn.hook_v_input",
        target=None,
        facet=None,
        meaning="pre-norm residual per kv head, v path",
        note=_PER_HEAD_RESID,
    ),
    Row(
        name="blocks.{L}.attn.qkv.hook_in",
        target=None,
        facet=None,
        meaning="fused qkv projection input",
        note="registered on GPT-2's bridge but never fires; read attn.hook_in",
    ),
    Row(
        name="blocks.{L}.attn.qkv.hook_out",
        target=None,
        facet=None,
        meaning="fused qkv projection output",
        note="registered on GPT-2's bridge but never fires; read attn.q/k/v.hook_out",
    ),
    Row(
        name="blocks.{L}.attn.q.hook_in",
        target="attention",
        facet="input",
        meaning="query projection input",
        note="the attention input",
    ),
    Row(
        name="blocks.{L}.attn.q.hook_out",
        target="attention",
        facet="q",
        meaning="queries per head, before RoPE",
    ),
    Row(
        name="blocks.{L}.attn.k.hook_in",
        target="attention",
        facet="input",
        meaning="key projection input",
        note="the attention input",
    ),
    Row(
        name="blocks.{L}.attn.k.hook_out",
        target="attention",
        facet="k",
        meaning="keys per head, before RoPE",
        note="kv heads under GQA",
    ),
    Row(
        name="blocks.{L}.attn.v.hook_in",
        target="attention",
        facet="input",
        meaning="value projection input",
        note="the attention input",
    ),
    Row(
        name="blocks.{L}.attn.v.hook_out",
        target="attention",
        facet="v",
        meaning="values per head",
        note="kv heads under GQA",
    ),
    Row(
        name="blocks.{L}.attn.hook_rot_q",
        target="attention",
        facet="rot_q",
        meaning="queries after RoPE",
        note="absent without rotary embeddings",
    ),
    Row(
        name="blocks.{L}.attn.hook_rot_k",
        target="attention",
        facet="rot_k",
        meaning="keys after RoPE",
        note="absent without rotary embeddings",
    ),
    Row(
        name="blocks.{L}.attn.hook_cos",
        target=None,
        facet=None,
        meaning="rotary cos seen by this layer",
        note=_ROTARY,
    ),
    Row(
        name="blocks.{L}.attn.hook_sin",
        target=None,
        facet=None,
        meaning="rotary sin seen by this layer",
        note=_ROTARY,
    ),
    Row(
        name="blocks.{L}.attn.hook_attn_scores",
        target="attention",
        facet="scores",
        meaning="attention logits entering softmax",
        note="masked entries hold the dtype minimum on both sides",
    ),
    Row(
        name="blocks.{L}.attn.hook_pattern",
        target="attention",
        facet="pattern",
        meaning="softmax of the scores",
    ),
    Row(
        name="blocks.{L}.attn.o.hook_in",
        target="attention",
        facet="z",
        meaning="output projection input per head",
        note="the bridge is token-major; TorchLens z is head-major: z.transpose(1, 2)",
    ),
    Row(
        name="blocks.{L}.attn.hook_result",
        target="attention",
        facet="result",
        meaning="each head's output contribution, bias excluded",
        note="needs set_use_attn_result on the bridge",
    ),
    Row(
        name="blocks.{L}.attn.o.hook_out",
        target="attn_o",
        facet="output",
        meaning="output projection output, before dropout",
    ),
    Row(
        name="blocks.{L}.attn.hook_out",
        target="attention",
        facet="output",
        meaning="attention module output (element 0)",
    ),
    Row(
        name="blocks.{L}.attn.hook_hidden_states",
        target="attention",
        facet="output",
        meaning="attention module output, element 0 (the bridge fires it on joint-QKV attention: GPT-2, BLOOM)",
        note="the attention module's output as the bridge's joint-QKV attention returns it: the output "
        "projection's on GPT-2, and with the residual already added on BLOOM, whose attention adds it",
    ),
    Row(
        name="blocks.{L}.ln2.hook_in",
        target="ln2",
        facet="input",
        meaning="pre-MLP norm input (= resid_mid)",
    ),
    Row(
        name="blocks.{L}.hook_mlp_in",
        target="ln2",
        facet="input",
        meaning="pre-norm residual feeding the MLP (set_use_hook_mlp_in)",
        note="TL 3.0.0 pointed this name at the MLP input (post-norm); 3.9 and 4.x at the pre-norm residual (resid_pre "
        "on a parallel attention+MLP block); an edit here reaches the MLP branch, not the residual stream",
        or_else=("block", "resid_mid"),
    ),
    Row(
        name="blocks.{L}.ln2.hook_scale",
        target="ln2",
        facet="scale",
        meaning="pre-MLP norm divisor",
    ),
    Row(
        name="blocks.{L}.ln2.hook_normalized",
        target="ln2",
        facet="normalized",
        meaning="pre-MLP norm output before the gain",
    ),
    Row(
        name="blocks.{L}.ln2.hook_out", target="ln2", facet="output", meaning="pre-MLP norm output"
    ),
    Row(
        name="blocks.{L}.mlp.hook_in",
        target="mlp",
        facet="input",
        meaning="MLP input (normed residual)",
        or_else=("pre_ln_mlp_in", "input"),
    ),
    Row(
        name="blocks.{L}.mlp.gate.hook_in",
        target="mlp_gated",
        facet="input",
        meaning="gate projection input",
        note="gated MLPs only",
    ),
    Row(
        name="blocks.{L}.mlp.gate.hook_out",
        target="mlp_gated",
        facet="pre",
        meaning="gate projection output (the activated branch)",
        note="gated MLPs only",
    ),
    Row(
        name="blocks.{L}.mlp.in.hook_in",
        target="mlp",
        facet="input",
        meaning="input projection input",
        or_else=("pre_ln_mlp_in", "input"),
    ),
    Row(
        name="blocks.{L}.mlp.in.hook_out",
        target="mlp",
        facet=("pre_linear", "pre"),
        meaning="input projection output",
        note="the linear (up) branch on a gated MLP, the activation input on a plain one",
        or_else=("pre_ln_mlp_in", "output"),
    ),
    Row(
        name="blocks.{L}.mlp.out.hook_in",
        target="mlp",
        facet="post",
        meaning="down projection input",
        or_else=("pre_ln_mlp_out", "input"),
    ),
    Row(
        name="blocks.{L}.mlp.out.hook_out",
        target="mlp",
        facet="down_out",
        meaning="down projection output, before dropout",
        or_else=("pre_ln_mlp_out", "output"),
    ),
    Row(
        name="blocks.{L}.mlp.hook_out",
        target="mlp",
        facet="output",
        meaning="MLP module output",
        or_else=("pre_ln_mlp_out", "output"),
    ),
    Row(
        name="blocks.{L}.hook_out",
        target="block",
        facet="resid_post",
        meaning="residual leaving the block",
    ),
    Row(
        name="ln_final.hook_in",
        target="final_norm",
        facet="input",
        meaning="final norm input (= last resid_post)",
    ),
    Row(
        name="ln_final.hook_scale", target="final_norm", facet="scale", meaning="final norm divisor"
    ),
    Row(
        name="ln_final.hook_normalized",
        target="final_norm",
        facet="normalized",
        meaning="final norm output before the gain",
    ),
    Row(name="ln_final.hook_out", target="final_norm", facet="output", meaning="final norm output"),
    Row(
        name="unembed.hook_in",
        target="unembed",
        facet="input",
        meaning="unembedding input (= final norm output)",
    ),
    Row(name="unembed.hook_out", target="unembed", facet="output", meaning="logits"),
)

ENCODER_DECODER = Table(
    "4.x",
    "TransformerLens 4.x TransformerBridge names on an encoder-decoder (T5 adapter)",
    encoder_decoder_rows(ROWS),
)

TABLE = Table(
    "4.x",
    "TransformerLens 4.x TransformerBridge canonical hook names",
    ROWS,
    by_kind=(("encoder-decoder", ENCODER_DECODER),),
    heading="TransformerLens 4.x",
    slug="tl-4x",
    library="transformer-lens",
    checked="4.3",
    names="canonical names",
)

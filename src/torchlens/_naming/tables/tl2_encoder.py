"""TransformerLens 2.x `HookedEncoder` (BERT) hook names.

`HookedEncoder` blocks are post-LN: `ln1` normalizes the sum after the attention, `ln2` the sum
after the MLP, and the block returns `ln2`'s output (`hook_normalized_resid_post`), which is the
next block's `hook_resid_pre`. Its `LayerNorm` hooks `hook_normalized` after the gain and bias
(the norm's output). The resolver uses this table for generation `"2.x"` on an encoder-only trace.
"""

from torchlens._naming.tables import Row, Table

_POST_GAIN = "HookedEncoder's LayerNorm hooks this after the gain and bias: the norm's output"
_HEADS = "a per-head copy of the residual; TorchLens keeps it once: read blocks.{L}.hook_resid_pre"

ROWS = (
    Row(name="embed.hook_embed", target="token_embed", facet="output", meaning="token embedding"),
    Row(
        name="embed.hook_pos_embed",
        target="pos_embed",
        facet="output",
        meaning="learned position embedding",
    ),
    Row(
        name="embed.hook_token_type_embed",
        target="type_embed",
        facet="output",
        meaning="token-type embedding",
    ),
    Row(
        name="embed.ln.hook_scale",
        target="embed_norm",
        facet="scale",
        meaning="embedding LayerNorm divisor sqrt(var+eps)",
    ),
    Row(
        name="embed.ln.hook_normalized",
        target="embed_norm",
        facet="output",
        meaning="embedding LayerNorm output",
        note=_POST_GAIN,
    ),
    Row(
        name="hook_full_embed",
        target="first_block",
        facet="resid_pre",
        meaning="sum of the embeddings after the embedding LayerNorm",
        note="the first block's input",
    ),
    Row(
        name="blocks.{L}.hook_resid_pre",
        target="block",
        facet="resid_pre",
        meaning="residual entering the block (the previous block's output)",
    ),
    Row(
        name="blocks.{L}.hook_q_input",
        target=None,
        facet=None,
        meaning="residual repeated per head, q path (cfg.use_split_qkv_input)",
        note=_HEADS,
    ),
    Row(
        name="blocks.{L}.hook_k_input",
        target=None,
        facet=None,
        meaning="residual repeated per head, k path",
        note=_HEADS,
    ),
    Row(
        name="blocks.{L}.hook_v_input",
        target=None,
        facet=None,
        meaning="residual repeated per head, v path",
        note=_HEADS,
    ),
    Row(
        name="blocks.{L}.attn.hook_q",
        target="attention",
        facet="q",
        meaning="queries per head",
        note="[batch, pos, heads, d_head]",
    ),
    Row(name="blocks.{L}.attn.hook_k", target="attention", facet="k", meaning="keys per head"),
    Row(name="blocks.{L}.attn.hook_v", target="attention", facet="v", meaning="values per head"),
    Row(
        name="blocks.{L}.attn.hook_attn_scores",
        target="attention",
        facet="scores",
        meaning="attention logits entering softmax",
        note="masked entries hold the model's fill",
    ),
    Row(
        name="blocks.{L}.attn.hook_pattern",
        target="attention",
        facet="pattern",
        meaning="softmax of the scores",
    ),
    Row(
        name="blocks.{L}.attn.hook_z",
        target="attention",
        facet="z",
        meaning="pattern @ v per head",
        note="TL is token-major [batch, pos, heads, d_head]; TorchLens z is head-major: z.transpose(1, 2)",
    ),
    Row(
        name="blocks.{L}.attn.hook_result",
        target="attention",
        facet="result",
        meaning="each head's output contribution (cfg.use_attn_result)",
        note="BERT's output projection lies outside its self-attention module",
    ),
    Row(
        name="blocks.{L}.hook_attn_out",
        target="attn_out_proj",
        facet="output",
        meaning="attention output projection (bias included)",
    ),
    Row(
        name="blocks.{L}.hook_resid_mid",
        target="post_ln1",
        facet="input",
        meaning="residual plus attention output, before ln1",
    ),
    Row(
        name="blocks.{L}.ln1.hook_scale",
        target="post_ln1",
        facet="scale",
        meaning="ln1 divisor sqrt(var+eps)",
    ),
    Row(
        name="blocks.{L}.ln1.hook_normalized",
        target="post_ln1",
        facet="output",
        meaning="ln1 output",
        note=_POST_GAIN,
    ),
    Row(
        name="blocks.{L}.hook_mlp_in",
        target="post_ln1",
        facet="input",
        meaning="residual plus attention output (cfg.use_hook_mlp_in)",
        note="HookedEncoder hooks it before ln1, so it is the same tensor as hook_resid_mid",
    ),
    Row(
        name="blocks.{L}.mlp.hook_pre",
        target="split_mlp_in",
        facet="output",
        meaning="MLP input projection output (BERT intermediate.dense)",
    ),
    Row(
        name="blocks.{L}.mlp.hook_post",
        target="split_mlp_out",
        facet="input",
        meaning="activation output, the MLP output projection's input",
    ),
    Row(
        name="blocks.{L}.hook_mlp_out",
        target="split_mlp_out",
        facet="output",
        meaning="MLP output projection (BERT output.dense)",
    ),
    Row(
        name="blocks.{L}.hook_resid_post",
        target="post_ln2",
        facet="input",
        meaning="ln1 output plus the MLP output, before ln2",
    ),
    Row(name="blocks.{L}.ln2.hook_scale", target="post_ln2", facet="scale", meaning="ln2 divisor"),
    Row(
        name="blocks.{L}.ln2.hook_normalized",
        target="post_ln2",
        facet="output",
        meaning="ln2 output",
        note=_POST_GAIN,
    ),
    Row(
        name="blocks.{L}.hook_normalized_resid_post",
        target="post_ln_block",
        facet="resid_post",
        meaning="the block output (ln2's output)",
    ),
    Row(
        name="mlm_head.ln.hook_scale",
        target="final_norm",
        facet="scale",
        meaning="MLM head LayerNorm divisor",
    ),
    Row(
        name="mlm_head.ln.hook_normalized",
        target="final_norm",
        facet="output",
        meaning="MLM head LayerNorm output",
        note=_POST_GAIN,
    ),
)

TABLE = Table("2.x", "TransformerLens 2.x HookedEncoder hook names", ROWS)

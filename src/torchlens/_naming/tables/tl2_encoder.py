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
    Row("embed.hook_embed", "token_embed", "output", "token embedding"),
    Row("embed.hook_pos_embed", "pos_embed", "output", "learned position embedding"),
    Row("embed.hook_token_type_embed", "type_embed", "output", "token-type embedding"),
    Row("embed.ln.hook_scale", "embed_norm", "scale", "embedding LayerNorm divisor sqrt(var+eps)"),
    Row("embed.ln.hook_normalized", "embed_norm", "output", "embedding LayerNorm output", _POST_GAIN),
    Row("hook_full_embed", "first_block", "resid_pre", "sum of the embeddings after the embedding LayerNorm",
        "the first block's input"),
    Row("blocks.{L}.hook_resid_pre", "block", "resid_pre", "residual entering the block (the previous block's output)"),
    Row("blocks.{L}.hook_q_input", None, None, "residual repeated per head, q path (cfg.use_split_qkv_input)",
        _HEADS),
    Row("blocks.{L}.hook_k_input", None, None, "residual repeated per head, k path", _HEADS),
    Row("blocks.{L}.hook_v_input", None, None, "residual repeated per head, v path", _HEADS),
    Row("blocks.{L}.attn.hook_q", "attention", "q", "queries per head", "[batch, pos, heads, d_head]"),
    Row("blocks.{L}.attn.hook_k", "attention", "k", "keys per head"),
    Row("blocks.{L}.attn.hook_v", "attention", "v", "values per head"),
    Row("blocks.{L}.attn.hook_attn_scores", "attention", "scores", "attention logits entering softmax",
        "masked entries hold the model's fill"),
    Row("blocks.{L}.attn.hook_pattern", "attention", "pattern", "softmax of the scores"),
    Row("blocks.{L}.attn.hook_z", "attention", "z", "pattern @ v per head",
        "TL is token-major [batch, pos, heads, d_head]; TorchLens z is head-major: z.transpose(1, 2)"),
    Row("blocks.{L}.attn.hook_result", "attention", "result", "each head's output contribution (cfg.use_attn_result)",
        "BERT's output projection lies outside its self-attention module"),
    Row("blocks.{L}.hook_attn_out", "attn_out_proj", "output", "attention output projection (bias included)"),
    Row("blocks.{L}.hook_resid_mid", "post_ln1", "input", "residual plus attention output, before ln1"),
    Row("blocks.{L}.ln1.hook_scale", "post_ln1", "scale", "ln1 divisor sqrt(var+eps)"),
    Row("blocks.{L}.ln1.hook_normalized", "post_ln1", "output", "ln1 output", _POST_GAIN),
    Row("blocks.{L}.hook_mlp_in", "post_ln1", "input", "residual plus attention output (cfg.use_hook_mlp_in)",
        "HookedEncoder hooks it before ln1, so it is the same tensor as hook_resid_mid"),
    Row("blocks.{L}.mlp.hook_pre", "split_mlp_in", "output", "MLP input projection output (BERT intermediate.dense)"),
    Row("blocks.{L}.mlp.hook_post", "split_mlp_out", "input", "activation output, the MLP output projection's input"),
    Row("blocks.{L}.hook_mlp_out", "split_mlp_out", "output", "MLP output projection (BERT output.dense)"),
    Row("blocks.{L}.hook_resid_post", "post_ln2", "input", "ln1 output plus the MLP output, before ln2"),
    Row("blocks.{L}.ln2.hook_scale", "post_ln2", "scale", "ln2 divisor"),
    Row("blocks.{L}.ln2.hook_normalized", "post_ln2", "output", "ln2 output", _POST_GAIN),
    Row("blocks.{L}.hook_normalized_resid_post", "post_ln_block", "resid_post", "the block output (ln2's output)"),
    Row("mlm_head.ln.hook_scale", "final_norm", "scale", "MLM head LayerNorm divisor"),
    Row("mlm_head.ln.hook_normalized", "final_norm", "output", "MLM head LayerNorm output", _POST_GAIN),
)

TABLE = Table("2.x", "TransformerLens 2.x HookedEncoder hook names", ROWS)

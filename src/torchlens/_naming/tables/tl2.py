"""TransformerLens 2.x `HookedTransformer` hook names (checked against 2.18)."""

from torchlens._naming.tables import Row, Table, tl2_encdec, tl2_encoder

_HEADS_OF_RESID = (
    "a per-head copy of the pre-norm residual; TorchLens keeps resid_pre once: read "
    "blocks.{L}.hook_resid_pre and broadcast it over heads"
)

_UNFOLDED_LN = (
    "TL hooks this after the gain and bias on an unfolded LayerNorm (fold_ln=False): that tensor is the "
    "norm's output (ln*.hook_out in 4.x). A folded model (fold_ln=True, from_pretrained's default) and "
    "RMSNorm hook it before the gain, like TorchLens's normalized"
)

_QK_NORM = ("QK-norm internals: TorchLens has no facet for the query/key norm's statistics; rot_q and rot_k "
            "hold the queries and keys after it (and after RoPE)")

ROWS = (
    Row("hook_tokens", "token_embed", "indices", "token ids (cfg.use_hook_tokens)"),
    Row("hook_embed", "scaled_embed_block", "resid_pre", "token embedding as it enters the residual stream",
        "after any constant scaling (TransformerLens folds Gemma's sqrt(d_model) into W_E), before a position "
        "embedding is added: the embedding module's output, or where the model scales outside that module, "
        "the first block's input",
        or_else=("token_embed", "output")),
    Row("hook_pos_embed", "pos_embed", "output", "learned position embedding",
        "absent on rotary models: they have no position embedding module"),
    Row("blocks.{L}.hook_resid_pre", "block", "resid_pre", "residual entering the block"),
    Row("blocks.{L}.hook_attn_in", None, None, "pre-norm residual repeated per head", _HEADS_OF_RESID),
    Row("blocks.{L}.hook_q_input", None, None, "pre-norm residual repeated per head (q path)", _HEADS_OF_RESID),
    Row("blocks.{L}.hook_k_input", None, None, "pre-norm residual repeated per head (k path)", _HEADS_OF_RESID),
    Row("blocks.{L}.hook_v_input", None, None, "pre-norm residual repeated per head (v path)", _HEADS_OF_RESID),
    Row("blocks.{L}.ln1.hook_scale", "ln1", "scale", "pre-attention norm divisor sqrt(var+eps) or sqrt(mean(x^2)+eps)",
        "TorchLens also offers its reciprocal, inv_std / inv_rms"),
    Row("blocks.{L}.ln1.hook_normalized", "ln1", "normalized", "pre-attention norm output before the gain",
        _UNFOLDED_LN),
    Row("blocks.{L}.attn.hook_q", "attention", "q", "queries per head, before RoPE", "[batch, pos, heads, d_head]"),
    Row("blocks.{L}.attn.hook_k", "attention", "k", "keys per head, before RoPE", "kv heads under GQA"),
    Row("blocks.{L}.attn.hook_v", "attention", "v", "values per head", "kv heads under GQA"),
    Row("blocks.{L}.attn.hook_rot_q", "attention", "rot_q", "queries after RoPE", "absent without rotary embeddings"),
    Row("blocks.{L}.attn.hook_rot_k", "attention", "rot_k", "keys after RoPE", "absent without rotary embeddings"),
    Row("blocks.{L}.attn.hook_attn_input", None, None, "residual plus position embedding fed to q and k",
        "shortformer positional embeddings only; TorchLens has no facet for it"),
    Row("blocks.{L}.attn.hook_attn_scores", "attention", "scores", "attention logits entering softmax",
        "TL 2.x masks with -inf; TorchLens keeps the model's fill (HF: the dtype minimum): compare visible entries"),
    Row("blocks.{L}.attn.q_norm.hook_scale", None, None, "query QK-norm divisor, per head (cfg.use_qk_norm)",
        _QK_NORM),
    Row("blocks.{L}.attn.q_norm.hook_normalized", None, None, "query QK-norm output before the gain, per head",
        _QK_NORM),
    Row("blocks.{L}.attn.k_norm.hook_scale", None, None, "key QK-norm divisor, per head (cfg.use_qk_norm)",
        _QK_NORM),
    Row("blocks.{L}.attn.k_norm.hook_normalized", None, None, "key QK-norm output before the gain, per head",
        _QK_NORM),
    Row("blocks.{L}.attn.hook_pattern", "attention", "pattern", "softmax of the scores"),
    Row("blocks.{L}.attn.hook_z", "attention", "z", "pattern @ v per head, before W_O",
        "TL is token-major [batch, pos, heads, d_head]; TorchLens z is head-major: z.transpose(1, 2)"),
    Row("blocks.{L}.attn.hook_result", "attention", "result", "each head's output contribution, bias excluded",
        "TL needs cfg.use_attn_result"),
    Row("blocks.{L}.hook_attn_out", "attn_out_final", "output", "attention's contribution to the residual",
        "after the post-attention norm on sandwich-norm families (Gemma-2, OLMo-2)"),
    Row("blocks.{L}.hook_resid_mid", "block", "resid_mid", "residual between attention and MLP",
        "absent on parallel attention+MLP blocks"),
    Row("blocks.{L}.hook_mlp_in", "ln2", "input", "pre-norm residual feeding the MLP branch (cfg.use_hook_mlp_in)",
        "the same tensor as hook_resid_mid (resid_pre on a parallel attention+MLP block); TL hooks a copy that only "
        "the MLP branch reads, so an edit here reaches the MLP, not the residual stream",
        or_else=("block", "resid_mid")),
    Row("blocks.{L}.ln2.hook_scale", "ln2", "scale", "pre-MLP norm divisor"),
    Row("blocks.{L}.ln2.hook_normalized", "ln2", "normalized", "pre-MLP norm output before the gain", _UNFOLDED_LN),
    Row("blocks.{L}.mlp.hook_pre", "mlp", "pre", "activation input (GPT-2 c_fc, Llama gate_proj output)",
        or_else=("pre_ln_mlp_in", "output")),
    Row("blocks.{L}.mlp.hook_pre_linear", "mlp", "pre_linear", "linear branch of a gated MLP (Llama up_proj)",
        "absent on a non-gated MLP"),
    Row("blocks.{L}.mlp.hook_mid", None, None, "SoLU activation before its layer norm",
        "only SoLU models have it; TorchLens has no SoLU facet"),
    Row("blocks.{L}.mlp.hook_post", "mlp", "post", "down projection input",
        or_else=("pre_ln_mlp_out", "input")),
    Row("blocks.{L}.hook_mlp_out", "mlp_out_final", "output", "MLP's contribution to the residual",
        "after the post-MLP norm on sandwich-norm families",
        or_else=("pre_ln_mlp_out", "output")),
    Row("blocks.{L}.hook_resid_post", "block", "resid_post", "residual leaving the block"),
    Row("blocks.{L}.ln1_post.hook_scale", "attn_post_norm", "scale", "post-attention norm divisor (sandwich norms)",
        "absent where no norm follows the attention"),
    Row("blocks.{L}.ln1_post.hook_normalized", "attn_post_norm", "normalized", "post-attention norm output before the gain",
        "absent where no norm follows the attention"),
    Row("blocks.{L}.ln2_post.hook_scale", "mlp_post_norm", "scale", "post-MLP norm divisor (sandwich norms)",
        "absent where no norm follows the MLP"),
    Row("blocks.{L}.ln2_post.hook_normalized", "mlp_post_norm", "normalized", "post-MLP norm output before the gain",
        "absent where no norm follows the MLP"),
    Row("blocks.{L}.mlp.hook_gate", None, None, "MoE router logits", "TorchLens has no MoE routing facets"),
    Row("blocks.{L}.mlp.hook_expert_weights", None, None, "MoE softmax over all experts", "TorchLens has no MoE routing facets"),
    Row("blocks.{L}.mlp.hook_expert_indices", None, None, "MoE chosen experts", "TorchLens has no MoE routing facets"),
    Row("ln_final.hook_scale", "final_norm", "scale", "final norm divisor"),
    Row("ln_final.hook_normalized", "final_norm", "normalized", "final norm output before the gain", _UNFOLDED_LN),
)

TABLE = Table("2.x", "TransformerLens 2.x HookedTransformer hook names", ROWS,
              by_kind=(("encoder-only", tl2_encoder.TABLE), ("encoder-decoder", tl2_encdec.TABLE)))

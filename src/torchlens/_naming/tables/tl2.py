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

_QK_NORM = (
    "QK-norm internals: TorchLens has no facet for the query/key norm's statistics; rot_q and rot_k "
    "hold the queries and keys after it (and after RoPE)"
)

ROWS = (
    Row(
        name="hook_tokens",
        target="token_embed",
        facet="indices",
        meaning="token ids (cfg.use_hook_tokens)",
    ),
    Row(
        name="hook_embed",
        target="scaled_embed_block",
        facet="resid_pre",
        meaning="token embedding as it enters the residual stream",
        note="after any constant scaling (TransformerLens folds Gemma's sqrt(d_model) into W_E) and a norm over the "
        "token embedding alone (BLOOM's post-embedding LayerNorm), before a position embedding is added: the "
        "embedding module's output, that norm's output, or where the model scales outside the embedding "
        "module, the first block's input",
        or_else=("embedded_tokens", "output"),
    ),
    Row(
        name="hook_pos_embed",
        target="pos_embed",
        facet="output",
        meaning="learned position embedding",
        note="absent on rotary models: they have no position embedding module",
    ),
    Row(
        name="blocks.{L}.hook_resid_pre",
        target="block",
        facet="resid_pre",
        meaning="residual entering the block",
    ),
    Row(
        name="blocks.{L}.hook_attn_in",
        target=None,
        facet=None,
        meaning="pre-norm residual repeated per head",
        note=_HEADS_OF_RESID,
    ),
    Row(
        name="blocks.{L}.hook_q_input",
        target=None,
        facet=None,
        meaning="pre-norm residual repeated per head (q path)",
        note=_HEADS_OF_RESID,
    ),
    Row(
        name="blocks.{L}.hook_k_input",
        target=None,
        facet=None,
        meaning="pre-norm residual repeated per head (k path)",
        note=_HEADS_OF_RESID,
    ),
    Row(
        name="blocks.{L}.hook_v_input",
        target=None,
        facet=None,
        meaning="pre-norm residual repeated per head (v path)",
        note=_HEADS_OF_RESID,
    ),
    Row(
        name="blocks.{L}.ln1.hook_scale",
        target="ln1",
        facet="scale",
        meaning="pre-attention norm divisor sqrt(var+eps) or sqrt(mean(x^2)+eps)",
        note="TorchLens also offers its reciprocal, inv_std / inv_rms",
    ),
    Row(
        name="blocks.{L}.ln1.hook_normalized",
        target="ln1",
        facet="normalized",
        meaning="pre-attention norm output before the gain",
        note=_UNFOLDED_LN,
    ),
    Row(
        name="blocks.{L}.attn.hook_q",
        target="attention",
        facet="q",
        meaning="queries per head, before RoPE",
        note="[batch, pos, heads, d_head]",
    ),
    Row(
        name="blocks.{L}.attn.hook_k",
        target="attention",
        facet="k",
        meaning="keys per head, before RoPE",
        note="kv heads under GQA",
    ),
    Row(
        name="blocks.{L}.attn.hook_v",
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
        name="blocks.{L}.attn.hook_attn_input",
        target=None,
        facet=None,
        meaning="residual plus position embedding fed to q and k",
        note="shortformer positional embeddings only; TorchLens has no facet for it",
    ),
    Row(
        name="blocks.{L}.attn.hook_attn_scores",
        target="attention",
        facet="scores",
        meaning="attention logits entering softmax",
        note="TL 2.x masks with -inf; TorchLens keeps the model's fill (HF: the dtype minimum): compare visible entries",
    ),
    Row(
        name="blocks.{L}.attn.q_norm.hook_scale",
        target=None,
        facet=None,
        meaning="query QK-norm divisor, per head (cfg.use_qk_norm)",
        note=_QK_NORM,
    ),
    Row(
        name="blocks.{L}.attn.q_norm.hook_normalized",
        target=None,
        facet=None,
        meaning="query QK-norm output before the gain, per head",
        note=_QK_NORM,
    ),
    Row(
        name="blocks.{L}.attn.k_norm.hook_scale",
        target=None,
        facet=None,
        meaning="key QK-norm divisor, per head (cfg.use_qk_norm)",
        note=_QK_NORM,
    ),
    Row(
        name="blocks.{L}.attn.k_norm.hook_normalized",
        target=None,
        facet=None,
        meaning="key QK-norm output before the gain, per head",
        note=_QK_NORM,
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
        meaning="pattern @ v per head, before W_O",
        note="TL is token-major [batch, pos, heads, d_head]; TorchLens z is head-major: z.transpose(1, 2)",
    ),
    Row(
        name="blocks.{L}.attn.hook_result",
        target="attention",
        facet="result",
        meaning="each head's output contribution, bias excluded",
        note="TL needs cfg.use_attn_result",
    ),
    Row(
        name="blocks.{L}.hook_attn_out",
        target="attn_out_final",
        facet=("contribution", "output"),
        meaning="attention's contribution to the residual",
        note="after the post-attention norm on sandwich-norm families (Gemma-2, OLMo-2); times the "
        "residual multiplier where the block scales it (Granite, MiniCPM3)",
    ),
    Row(
        name="blocks.{L}.hook_resid_mid",
        target="block",
        facet="resid_mid",
        meaning="residual between attention and MLP",
        note="absent on parallel attention+MLP blocks",
    ),
    Row(
        name="blocks.{L}.hook_mlp_in",
        target="ln2",
        facet="input",
        meaning="pre-norm residual feeding the MLP branch (cfg.use_hook_mlp_in)",
        note="the same tensor as hook_resid_mid (resid_pre on a parallel attention+MLP block); TL hooks a copy that only "
        "the MLP branch reads, so an edit here reaches the MLP, not the residual stream",
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
        note=_UNFOLDED_LN,
    ),
    Row(
        name="blocks.{L}.mlp.hook_pre",
        target="mlp",
        facet="pre",
        meaning="activation input (GPT-2 c_fc, Llama gate_proj output)",
        or_else=("pre_ln_mlp_in", "output"),
    ),
    Row(
        name="blocks.{L}.mlp.hook_pre_linear",
        target="mlp",
        facet="pre_linear",
        meaning="linear branch of a gated MLP (Llama up_proj)",
        note="absent on a non-gated MLP",
    ),
    Row(
        name="blocks.{L}.mlp.hook_mid",
        target=None,
        facet=None,
        meaning="SoLU activation before its layer norm",
        note="only SoLU models have it; TorchLens has no SoLU facet",
    ),
    Row(
        name="blocks.{L}.mlp.hook_post",
        target="mlp",
        facet="post",
        meaning="down projection input",
        or_else=("pre_ln_mlp_out", "input"),
    ),
    Row(
        name="blocks.{L}.hook_mlp_out",
        target="mlp_out_final",
        facet=("contribution", "output"),
        meaning="MLP's contribution to the residual",
        note="after the post-MLP norm on sandwich-norm families; times the residual multiplier, or "
        "reshaped, where the block changes it before the add (Granite, Llama-4)",
        or_else=("pre_ln_mlp_out", "output"),
    ),
    Row(
        name="blocks.{L}.hook_resid_post",
        target="block",
        facet="resid_post",
        meaning="residual leaving the block",
    ),
    Row(
        name="blocks.{L}.ln1_post.hook_scale",
        target="attn_post_norm",
        facet="scale",
        meaning="post-attention norm divisor (sandwich norms)",
        note="absent where no norm follows the attention",
    ),
    Row(
        name="blocks.{L}.ln1_post.hook_normalized",
        target="attn_post_norm",
        facet="normalized",
        meaning="post-attention norm output before the gain",
        note="absent where no norm follows the attention",
    ),
    Row(
        name="blocks.{L}.ln2_post.hook_scale",
        target="mlp_post_norm",
        facet="scale",
        meaning="post-MLP norm divisor (sandwich norms)",
        note="absent where no norm follows the MLP",
    ),
    Row(
        name="blocks.{L}.ln2_post.hook_normalized",
        target="mlp_post_norm",
        facet="normalized",
        meaning="post-MLP norm output before the gain",
        note="absent where no norm follows the MLP",
    ),
    Row(
        name="blocks.{L}.mlp.hook_gate",
        target=None,
        facet=None,
        meaning="MoE router logits",
        note="TorchLens has no MoE routing facets",
    ),
    Row(
        name="blocks.{L}.mlp.hook_expert_weights",
        target=None,
        facet=None,
        meaning="MoE softmax over all experts",
        note="TorchLens has no MoE routing facets",
    ),
    Row(
        name="blocks.{L}.mlp.hook_expert_indices",
        target=None,
        facet=None,
        meaning="MoE chosen experts",
        note="TorchLens has no MoE routing facets",
    ),
    Row(
        name="ln_final.hook_scale", target="final_norm", facet="scale", meaning="final norm divisor"
    ),
    Row(
        name="ln_final.hook_normalized",
        target="final_norm",
        facet="normalized",
        meaning="final norm output before the gain",
        note=_UNFOLDED_LN,
    ),
)

TABLE = Table(
    "2.x",
    "TransformerLens 2.x HookedTransformer hook names",
    ROWS,
    by_kind=(("encoder-only", tl2_encoder.TABLE), ("encoder-decoder", tl2_encdec.TABLE)),
    heading="TransformerLens 2.x",
    slug="tl-2x",
    library="transformer-lens",
    checked="2.18",
    names="HookedTransformer",
)

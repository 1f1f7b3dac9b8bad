"""nnterp `StandardizedTransformer` accessor and property names (checked against nnterp 1.3.0).

The table holds nnterp's seven per-layer accessors and the global names that read a forward
tensor on a non-norm module. nnterp standardizes no norm names: its module-level spellings of
the final norm (`ln_final.input`, `ln_final.output`, and `lm_head.input`, which is the final
norm's output) have no row, and resolving one says where to read the tensor instead.
"""

from torchlens._naming.tables import Row, Table

ROWS = (
    Row(name="layers_input[{L}]", target="block", facet="resid_pre", meaning="decoder layer input"),
    Row(
        name="attentions_input[{L}]",
        target="attention",
        facet="input",
        meaning="attention input (normed residual)",
        note="nnterp reads the first keyword tensor when the attention is called with keywords only",
    ),
    Row(
        name="attention_probabilities[{L}]",
        target="attention",
        facet="pattern",
        meaning="attention softmax output",
        note="nnterp needs enable_attention_probs=True (eager attention) to read it",
    ),
    Row(
        name="attentions_output[{L}]",
        target="attention",
        facet="output",
        meaning="attention output (element 0)",
    ),
    Row(name="mlps_input[{L}]", target="mlp", facet="input", meaning="MLP input (normed residual)"),
    Row(name="mlps_output[{L}]", target="mlp", facet="output", meaning="MLP output"),
    Row(
        name="layers_output[{L}]",
        target="block",
        facet="resid_post",
        meaning="decoder layer output (element 0)",
    ),
    Row(
        name="input_ids",
        target="token_embed",
        facet="indices",
        meaning="token ids entering the embedding",
    ),
    Row(
        name="token_embeddings",
        target="token_embed",
        facet="output",
        meaning="token embedding (no position embedding)",
    ),
    Row(
        name="embed_tokens.output",
        target="token_embed",
        facet="output",
        meaning="token embedding module output",
    ),
    Row(
        name="logits",
        target="root",
        facet="logits",
        meaning="logits the model returns (nnterp reads output.logits)",
        note="after any step that follows the unembedding (Gemma-2's final logit softcap); lm_head.output is "
        "the unembedding's own output",
    ),
    Row(
        name="lm_head.output", target="unembed", facet="output", meaning="unembedding module output"
    ),
)

_FINAL_NORM = "nnterp standardizes no norm names, so the nnterp table has no row for {name}. "

UNMAPPED = {
    "ln_final.input": _FINAL_NORM.format(name="ln_final.input")
    + "The tensor is the final norm's input: trace.modules[''].facets['final_norm_input'], "
    "or the 4.x name ln_final.hook_in.",
    "ln_final.output": _FINAL_NORM.format(name="ln_final.output")
    + "No facet names the final norm's output: read final_norm_input and apply the norm, address the "
    "norm module directly (trace.modules[<final norm address>].facets['output']), or use the 4.x name "
    "ln_final.hook_out.",
    "lm_head.input": _FINAL_NORM.format(name="lm_head.input")
    + "It is the final norm's output: use the 4.x name unembed.hook_in, or the lm_head module's 'input' facet.",
    "next_token_probs": "next_token_probs is derived (softmax of the last position's logits), not a forward "
    "tensor: compute it from logits.",
    "attention_mask": "attention_mask is a model input, not a captured site: it is what you passed to the forward.",
}

TABLE = Table(
    "nnterp",
    "nnterp 1.3 StandardizedTransformer accessors",
    ROWS,
    unmapped=UNMAPPED,
    negative_layers=True,
    decoder_only=True,
    heading="nnterp",
    slug="nnterp",
    library="nnterp",
    checked="1.3.0",
    names="accessors",
)

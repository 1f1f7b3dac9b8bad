"""TransformerLens 3.x `TransformerBridge` cache names (checked against 3.9).

A 3.x bridge cache holds every canonical component-path name (the 4.x table: 3.9 and 4.3
register the same hook points) plus the legacy 2.x spellings it keeps as aliases. The legacy
names mean on the bridge what they meant in 2.x, so their rows are taken from the 2.x table
rather than written twice.
"""

from torchlens._naming.tables import Row, Table, tl2, tl4

#: 2.x names a 3.x bridge keeps as aliases of its canonical hook points.
LEGACY_ALIASES = frozenset(
    {
        "hook_pos_embed",
        "blocks.{L}.hook_resid_pre",
        "blocks.{L}.hook_resid_mid",
        "blocks.{L}.hook_resid_post",
        "blocks.{L}.hook_attn_out",
        "blocks.{L}.hook_mlp_out",
        "blocks.{L}.hook_attn_in",
        "blocks.{L}.hook_q_input",
        "blocks.{L}.hook_k_input",
        "blocks.{L}.hook_v_input",
        "blocks.{L}.attn.hook_q",
        "blocks.{L}.attn.hook_k",
        "blocks.{L}.attn.hook_v",
        "blocks.{L}.attn.hook_z",
        "blocks.{L}.mlp.hook_pre",
        "blocks.{L}.mlp.hook_pre_linear",
        "blocks.{L}.mlp.hook_post",
    }
)

ROWS = (
    tl4.ROWS
    + tuple(r for r in tl2.ROWS if r.name in LEGACY_ALIASES)
    + (
        Row(
            name="hook_embed",
            target="embedded_sum",
            facet="output",
            meaning="token embedding (alias of embed_ln.hook_out where the model has an embedding norm, else of "
            "embed.hook_out)",
            note="the embedding norm's output where a norm outside the layers feeds the first block (BLOOM's "
            "post-embedding LayerNorm, BERT's and BART's over the summed embeddings), else the embedding "
            "module's output: after Gemma's sqrt(d_model) scaling where that module applies it",
        ),
        Row(
            name="hook_unembed",
            target="unembed",
            facet="output",
            meaning="logits (alias of unembed.hook_out)",
        ),
    )
)

TABLE = Table(
    "3.x",
    "TransformerLens 3.x TransformerBridge cache names (canonical and legacy)",
    ROWS,
    heading="TransformerLens 3.x",
    slug="tl-3x",
    library="transformer-lens",
    checked="3.9",
)

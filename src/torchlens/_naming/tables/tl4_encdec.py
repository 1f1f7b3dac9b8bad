"""TransformerLens 4.x `TransformerBridge` names on an encoder-decoder (T5): built from the 4.x rows.

The bridge's T5 adapter names the stacks `encoder_blocks` and `decoder_blocks` (each with its own
layer numbering), the decoder's self-attention `self_attn`, its cross-attention `cross_attn`, the
norms `ln1` (before self-attention), `ln2` (decoder: before cross-attention; encoder: before the
MLP) and `ln3` (decoder: before the MLP), and the final norms `encoder_ln_final` and
`decoder_ln_final`. Blocks also answer to `hook_resid_pre`, `hook_resid_post`, `hook_attn_out`,
`hook_cross_attn_out` and `hook_mlp_out`: T5 adds the residual inside each sublayer wrapper, so a
sublayer's output is its contribution. The resolver uses this table for generation `"4.x"` on an
encoder-decoder trace.
"""

from __future__ import annotations

from torchlens._naming.tables import Row

_ALIASES = (
    ("hook_resid_pre", "block", "resid_pre", "residual entering the block"),
    ("hook_resid_post", "block", "resid_post", "residual leaving the block"),
    (
        "hook_attn_out",
        "attention",
        "output",
        "self-attention output (its contribution to the residual)",
    ),
    ("hook_mlp_out", "mlp", "output", "MLP output (its contribution to the residual)"),
)


def _moved(row: Row, name: str, stack: str | None, target: str | None = None) -> Row:
    facet = (
        "output" if target in ("attn_residual", "cross_residual") else row.facet
    )  # a wrapper's output
    return Row(
        name=name,
        target=target or row.target,
        facet=facet,
        meaning=row.meaning,
        note=row.note,
        in_report=row.in_report,
        stack=stack,
    )


def encoder_decoder_rows(rows: tuple[Row, ...]) -> tuple[Row, ...]:
    """The 4.x decoder-model rows rewritten for the encoder and decoder stacks of an encoder-decoder."""
    out: list[Row] = []
    layer_rows = [r for r in rows if r.name.startswith("blocks.{L}.")]
    for r in rows:
        if r.name.startswith("ln_final."):
            out.append(_moved(r, "encoder_" + r.name, "encoder"))
            out.append(_moved(r, "decoder_" + r.name, None))
        elif not r.per_layer:
            out.append(r)
    for r in layer_rows:  # encoder: ln1, attn, ln2, mlp as in a decoder-only block
        out.append(
            _moved(
                r,
                r.name.replace("blocks.{L}.", "encoder_blocks.{L}."),
                "encoder",
                "attn_residual" if r.name.endswith(".hook_mlp_in") else None,
            )
        )
    for r in layer_rows:
        rest = r.name[len("blocks.{L}.") :]
        if rest.startswith("attn."):
            out.append(_moved(r, "decoder_blocks.{L}.self_attn." + rest[len("attn.") :], "decoder"))
            if r.target == "attention":
                # the key and value projections read the encoder's output, not the module's input
                kv_in = rest in ("attn.k.hook_in", "attn.v.hook_in")
                out.append(
                    _moved(
                        r,
                        "decoder_blocks.{L}.cross_attn." + rest[len("attn.") :],
                        "decoder",
                        "cross_kv_source" if kv_in else "cross_attention",
                    )
                )
        elif rest.startswith("ln1."):  # the norms by the sublayer they go with: before it
            # (pre-LN, T5), or after it (post-LN, BART), as the bridge's adapters number them
            out.append(
                _moved(r, "decoder_blocks.{L}.ln1." + rest[len("ln1.") :], "decoder", "dec_ln1")
            )
        elif rest.startswith("ln2."):
            out.append(
                _moved(r, "decoder_blocks.{L}.ln2." + rest[len("ln2.") :], "decoder", "dec_ln2")
            )
            out.append(
                _moved(r, "decoder_blocks.{L}.ln3." + rest[len("ln2.") :], "decoder", "dec_ln3")
            )
        else:  # T5 adds each residual inside the sublayer wrapper: the MLP's input residual is its output
            out.append(
                _moved(
                    r,
                    "decoder_blocks.{L}." + rest,
                    "decoder",
                    "cross_residual" if rest == "hook_mlp_in" else None,
                )
            )
    for prefix, stack in (("encoder_blocks", "encoder"), ("decoder_blocks", "decoder")):
        for name, target, facet, meaning in _ALIASES:
            out.append(
                Row(
                    name=f"{prefix}.{{L}}.{name}",
                    target=target,
                    facet=facet,
                    meaning=meaning,
                    note="a block alias of the bridge",
                    stack=stack,
                )
            )
    out.append(
        Row(
            name="decoder_blocks.{L}.hook_cross_attn_out",
            target="cross_attention",
            facet="output",
            meaning="cross-attention output (its contribution to the residual)",
            note="a block alias of the bridge",
            stack="decoder",
        )
    )
    return tuple(out)

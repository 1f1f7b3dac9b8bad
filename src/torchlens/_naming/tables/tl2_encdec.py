"""TransformerLens 2.x `HookedEncoderDecoder` (T5) hook names.

`HookedEncoderDecoder` keeps two stacks, `encoder` and `decoder`, each numbered from 0. Its
`T5Block` hooks `hook_resid_mid` after the self-attention's residual add and, in the decoder,
`hook_resid_mid_cross` after the cross-attention's; Hugging Face's T5 adds each residual inside the
sublayer wrapper (`T5LayerSelfAttention`, `T5LayerCrossAttention`), so those are the wrappers'
outputs. `ln1` normalizes before the self-attention, `ln2` before the MLP (encoder) or the
cross-attention (decoder), `ln3` before the decoder's MLP; its `RMSNorm` hooks `hook_normalized`
before the gain. The resolver uses this table for generation `"2.x"` on an encoder-decoder trace.
"""

from torchlens._naming.tables import Row, Table

_HEADS = (
    "a per-head copy of the residual (cfg.use_split_qkv_input / use_attn_in); TorchLens keeps the "
    "residual once: read hook_resid_pre and broadcast it over heads"
)


def _attn(prefix: str, target: str, stack: str) -> tuple[Row, ...]:
    return (
        Row(
            name=f"{prefix}.hook_q",
            target=target,
            facet="q",
            meaning="queries per head",
            note="[batch, pos, heads, d_head]",
            stack=stack,
        ),
        Row(
            name=f"{prefix}.hook_k", target=target, facet="k", meaning="keys per head", stack=stack
        ),
        Row(
            name=f"{prefix}.hook_v",
            target=target,
            facet="v",
            meaning="values per head",
            stack=stack,
        ),
        Row(
            name=f"{prefix}.hook_attn_scores",
            target=target,
            facet="scores",
            meaning="attention logits entering softmax (with T5's position bias)",
            note="masked entries hold the model's fill: compare visible entries",
            stack=stack,
        ),
        Row(
            name=f"{prefix}.hook_pattern",
            target=target,
            facet="pattern",
            meaning="softmax of the scores",
            stack=stack,
        ),
        Row(
            name=f"{prefix}.hook_z",
            target=target,
            facet="z",
            meaning="pattern @ v per head",
            note="TL is token-major [batch, pos, heads, d_head]; TorchLens z is head-major: z.transpose(1, 2)",
            stack=stack,
        ),
        Row(
            name=f"{prefix}.hook_result",
            target=target,
            facet="result",
            meaning="each head's output contribution (cfg.use_attn_result)",
            stack=stack,
        ),
    )


def _norm(prefix: str, target: str, stack: str, what: str) -> tuple[Row, ...]:
    return (
        Row(
            name=f"{prefix}.hook_scale",
            target=target,
            facet="scale",
            meaning=f"{what} divisor sqrt(mean(x^2)+eps)",
            stack=stack,
        ),
        Row(
            name=f"{prefix}.hook_normalized",
            target=target,
            facet="normalized",
            meaning=f"{what} output before the gain",
            stack=stack,
        ),
    )


def _block(stack: str) -> tuple[Row, ...]:
    p = f"{stack}.{{L}}"
    rows = [
        Row(
            name=f"{p}.hook_resid_pre",
            target="block",
            facet="resid_pre",
            meaning="residual entering the block",
            stack=stack,
        ),
        Row(
            name=f"{p}.hook_q_input",
            target=None,
            facet=None,
            meaning="residual repeated per head (q path)",
            note=_HEADS,
            stack=stack,
        ),
        Row(
            name=f"{p}.hook_k_input",
            target=None,
            facet=None,
            meaning="residual repeated per head (k path)",
            note=_HEADS,
            stack=stack,
        ),
        Row(
            name=f"{p}.hook_v_input",
            target=None,
            facet=None,
            meaning="residual repeated per head (v path)",
            note=_HEADS,
            stack=stack,
        ),
        Row(
            name=f"{p}.hook_attn_in",
            target=None,
            facet=None,
            meaning="residual repeated per head (cfg.use_attn_in)",
            note=_HEADS,
            stack=stack,
        ),
        *_norm(f"{p}.ln1", "ln1", stack, "pre-attention norm"),
        *_attn(f"{p}.attn", "attention", stack),
        Row(
            name=f"{p}.hook_attn_out",
            target="attention",
            facet="output",
            meaning="self-attention output",
            stack=stack,
        ),
        Row(
            name=f"{p}.hook_resid_mid",
            target="attn_residual",
            facet="output",
            meaning="residual after the self-attention add",
            note="the output of T5LayerSelfAttention, which adds the residual",
            stack=stack,
        ),
    ]
    if stack == "decoder":
        rows += [
            Row(
                name=f"{p}.hook_cross_attn_in",
                target="attn_residual",
                facet="output",
                meaning="cross-attention input residual (cfg.use_attn_in)",
                note="the same tensor as hook_resid_mid",
                stack=stack,
            ),
            *_norm(f"{p}.ln2", "ln_cross", stack, "pre-cross-attention norm"),
            *_attn(f"{p}.cross_attn", "cross_attention", stack),
            Row(
                name=f"{p}.hook_cross_attn_out",
                target="cross_attention",
                facet="output",
                meaning="cross-attention output",
                stack=stack,
            ),
            Row(
                name=f"{p}.hook_resid_mid_cross",
                target="cross_residual",
                facet="output",
                meaning="residual after the cross-attention add",
                note="the output of T5LayerCrossAttention, which adds the residual",
                stack=stack,
            ),
            Row(
                name=f"{p}.hook_mlp_in",
                target="cross_residual",
                facet="output",
                meaning="MLP input residual (cfg.use_hook_mlp_in)",
                note="the same tensor as hook_resid_mid_cross",
                stack=stack,
            ),
            *_norm(f"{p}.ln3", "ln2", stack, "pre-MLP norm"),
        ]
    else:
        rows += [
            Row(
                name=f"{p}.hook_mlp_in",
                target="attn_residual",
                facet="output",
                meaning="MLP input residual (cfg.use_hook_mlp_in)",
                note="the same tensor as hook_resid_mid",
                stack=stack,
            ),
            *_norm(f"{p}.ln2", "ln2", stack, "pre-MLP norm"),
        ]
    rows += [
        Row(
            name=f"{p}.mlp.hook_pre",
            target="mlp",
            facet="pre",
            meaning="activation input (T5 wi output)",
            stack=stack,
        ),
        Row(
            name=f"{p}.mlp.hook_post",
            target="mlp",
            facet="post",
            meaning="down projection input",
            stack=stack,
        ),
        Row(
            name=f"{p}.hook_mlp_out",
            target="mlp",
            facet="output",
            meaning="MLP output",
            stack=stack,
        ),
        Row(
            name=f"{p}.hook_resid_post",
            target="block",
            facet="resid_post",
            meaning="residual leaving the block",
            stack=stack,
        ),
    ]
    return tuple(rows)


ROWS = (
    Row(name="hook_embed", target="token_embed", facet="output", meaning="encoder token embedding"),
    *_block("encoder"),
    *_norm("encoder_final_ln", "final_norm", "encoder", "encoder final norm"),
    *_block("decoder"),
    *_norm("decoder_final_ln", "final_norm", "decoder", "decoder final norm"),
)

TABLE = Table("2.x", "TransformerLens 2.x HookedEncoderDecoder hook names", ROWS)

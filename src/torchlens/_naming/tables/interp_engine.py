"""interp-engine canonical point addresses (pinned to interp-engine 1.14.3, commit 2afe000d).

The tests run against 1.14.2, the newest release on PyPI; its point table has the same 34
points.

An address is `name[.layer][.stream-K]`. `layer` is interp-engine's flattened forward order,
which is the block index on single-stack decoders (GPT-2, Llama-style models), the only
layouts this table was checked on. `path.<module address>` reads any module's output.

interp-engine's point table is closed: the report accounts for every point, and a point
with no TorchLens site is listed once, without a layer, with the reason.
"""

from torchlens._naming.tables import Row, Table

_QK_NORM = "QK-norm internals: TorchLens has no facet for the query/key norm's input or output"
_HYPER = "hyper-connection residual streams: TorchLens models have a single residual stream"
_MOE = "MoE routing: TorchLens has no router or expert facets"

ROWS = (
    Row(
        name="embeddings",
        target="token_embed",
        facet="output",
        meaning="token embedding module output",
        note="GPT-2's position embedding (transformer.wpe) has no point: use path.transformer.wpe",
    ),
    Row(
        name="resid_pre.{L}", target="block", facet="resid_pre", meaning="residual entering block L"
    ),
    Row(
        name="attn_in.{L}",
        target="attention",
        facet="input",
        meaning="attention input (pre-attention norm output)",
    ),
    Row(name="q_norm_in.{L}", target=None, facet=None, meaning="query-norm input", note=_QK_NORM),
    Row(name="q_norm_out.{L}", target=None, facet=None, meaning="query-norm output", note=_QK_NORM),
    Row(name="k_norm_in.{L}", target=None, facet=None, meaning="key-norm input", note=_QK_NORM),
    Row(name="k_norm_out.{L}", target=None, facet=None, meaning="key-norm output", note=_QK_NORM),
    Row(
        name="value.{L}",
        target="attention",
        facet="v",
        meaning="value projection output, kv heads",
        note="interp-engine flattens heads: v[0].reshape(n_tokens, -1)",
    ),
    Row(
        name="attn_scores.{L}",
        target="attention",
        facet="scores",
        meaning="attention logits entering softmax",
        note="[heads, query, key] per prompt; masked entries hold the dtype minimum on both sides",
    ),
    Row(
        name="attn_probs.{L}",
        target="attention",
        facet="pattern",
        meaning="attention softmax output",
        note="[heads, query, key] per prompt",
    ),
    Row(
        name="z.{L}",
        target="attention",
        facet="z",
        meaning="per-head attention output before the output projection",
        note="interp-engine is token-major with heads flattened: z[0].permute(1, 0, 2).reshape(n_tokens, -1)",
    ),
    Row(
        name="attn_gate.{L}",
        target=None,
        facet=None,
        meaning="gate on the attention output",
        note="gated-attention families only; TorchLens has no attention-gate facet",
    ),
    Row(
        name="attn_out.{L}",
        target="attention_own",
        facet="output",
        meaning="raw attention sublayer output",
    ),
    Row(
        name="attn_out_post.{L}",
        target=None,
        facet=None,
        meaning="attention's residual contribution (after a post-attention norm, times a residual multiplier)",
        note="no site under this name; the tensor is what blocks.{L}.hook_attn_out reads in generation='2.x' "
        "(checked equal to interp-engine's capture, bit for bit, on every decoder family tested)",
    ),
    Row(
        name="resid_mid.{L}",
        target="block",
        facet="resid_mid",
        meaning="residual between attention and MLP",
        note="absent on parallel attention+MLP blocks",
    ),
    Row(
        name="mlp_in.{L}",
        target="mlp",
        facet="input",
        meaning="MLP input (pre-MLP norm output)",
        or_else=("pre_ln_mlp_in", "input"),
    ),
    Row(
        name="mlp_pre.{L}",
        target="mlp",
        facet="pre",
        meaning="activation input",
        or_else=("pre_ln_mlp_in", "output"),
    ),
    Row(
        name="mlp_pre_linear.{L}",
        target="mlp",
        facet="pre_linear",
        meaning="linear branch of a gated MLP",
        note="absent on a non-gated MLP",
    ),
    Row(
        name="mlp_act.{L}",
        target="mlp",
        facet="post",
        meaning="down projection input (activation output, times the linear branch if gated)",
        or_else=("pre_ln_mlp_out", "input"),
    ),
    Row(name="router_logits.{L}", target=None, facet=None, meaning="MoE router logits", note=_MOE),
    Row(
        name="expert_weights.{L}",
        target=None,
        facet=None,
        meaning="MoE routing weights applied",
        note=_MOE,
    ),
    Row(
        name="expert_indices.{L}", target=None, facet=None, meaning="MoE chosen experts", note=_MOE
    ),
    Row(
        name="mlp_out.{L}",
        target="mlp_own",
        facet="output",
        meaning="raw MLP sublayer output",
        or_else=("pre_ln_mlp_out", "output"),
    ),
    Row(
        name="mlp_out_post.{L}",
        target=None,
        facet=None,
        meaning="MLP's residual contribution (after a post-MLP norm, times a residual multiplier)",
        note="no site under this name; the tensor is what blocks.{L}.hook_mlp_out reads in generation='2.x' "
        "(checked equal to interp-engine's capture, bit for bit, on every decoder family tested)",
    ),
    Row(
        name="resid_post.{L}",
        target="block",
        facet="resid_post",
        meaning="residual leaving block L",
    ),
    Row(
        name="final_norm",
        target=None,
        facet=None,
        meaning="final norm output",
        note="no site under this name; the tensor is the final norm module's output facet (its input is "
        "the root's final_norm_input)",
    ),
    Row(name="lm_head", target="unembed", facet="output", meaning="logits"),
    Row(
        name="resid_streams.{L}",
        target=None,
        facet=None,
        meaning="all residual streams of block L",
        note=_HYPER,
    ),
    Row(
        name="attn_stream_collapse.{L}",
        target=None,
        facet=None,
        meaning="collapsed stream the attention reads",
        note=_HYPER,
    ),
    Row(
        name="attn_stream_write.{L}",
        target=None,
        facet=None,
        meaning="attention's per-stream write weights",
        note=_HYPER,
    ),
    Row(
        name="attn_stream_mix.{L}",
        target=None,
        facet=None,
        meaning="stream mixing matrix at the attention",
        note=_HYPER,
    ),
    Row(
        name="mlp_stream_collapse.{L}",
        target=None,
        facet=None,
        meaning="collapsed stream the MLP reads",
        note=_HYPER,
    ),
    Row(
        name="mlp_stream_write.{L}",
        target=None,
        facet=None,
        meaning="MLP's per-stream write weights",
        note=_HYPER,
    ),
    Row(
        name="mlp_stream_mix.{L}",
        target=None,
        facet=None,
        meaning="stream mixing matrix at the MLP",
        note=_HYPER,
    ),
)

#: Points that may carry a `.stream-K` coordinate.
STREAM_POINTS = frozenset({"resid_pre", "resid_mid", "resid_post"})

TABLE = Table(
    "interp-engine",
    "interp-engine 1.14.3 point addresses",
    ROWS,
    absent_once=True,
    decoder_only=True,
    heading="interp-engine",
    slug="interp-engine",
    library="interp-engine",
    checked="1.14.3",
    names="point addresses",
)

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
    Row("embeddings", "token_embed", "output", "token embedding module output",
        "GPT-2's position embedding (transformer.wpe) has no point: use path.transformer.wpe"),
    Row("resid_pre.{L}", "block", "resid_pre", "residual entering block L"),
    Row("attn_in.{L}", "attention", "input", "attention input (pre-attention norm output)"),
    Row("q_norm_in.{L}", None, None, "query-norm input", _QK_NORM),
    Row("q_norm_out.{L}", None, None, "query-norm output", _QK_NORM),
    Row("k_norm_in.{L}", None, None, "key-norm input", _QK_NORM),
    Row("k_norm_out.{L}", None, None, "key-norm output", _QK_NORM),
    Row("value.{L}", "attention", "v", "value projection output, kv heads",
        "interp-engine flattens heads: v[0].reshape(n_tokens, -1)"),
    Row("attn_scores.{L}", "attention", "scores", "attention logits entering softmax",
        "[heads, query, key] per prompt; masked entries hold the dtype minimum on both sides"),
    Row("attn_probs.{L}", "attention", "pattern", "attention softmax output", "[heads, query, key] per prompt"),
    Row("z.{L}", "attention", "z", "per-head attention output before the output projection",
        "interp-engine is token-major with heads flattened: z[0].permute(1, 0, 2).reshape(n_tokens, -1)"),
    Row("attn_gate.{L}", None, None, "gate on the attention output",
        "gated-attention families only; TorchLens has no attention-gate facet"),
    Row("attn_out.{L}", "attention", "output", "raw attention sublayer output"),
    Row("attn_out_post.{L}", None, None, "attention's residual contribution after a post-attention norm",
        "TorchLens has no facet for the post-sublayer norm output (on GPT-2 and Llama it equals attn_out)"),
    Row("resid_mid.{L}", "block", "resid_mid", "residual between attention and MLP",
        "absent on parallel attention+MLP blocks"),
    Row("mlp_in.{L}", "mlp", "input", "MLP input (pre-MLP norm output)"),
    Row("mlp_pre.{L}", "mlp", "pre", "activation input"),
    Row("mlp_pre_linear.{L}", "mlp", "pre_linear", "linear branch of a gated MLP", "absent on a non-gated MLP"),
    Row("mlp_act.{L}", "mlp", "post", "down projection input (activation output, times the linear branch if gated)"),
    Row("router_logits.{L}", None, None, "MoE router logits", _MOE),
    Row("expert_weights.{L}", None, None, "MoE routing weights applied", _MOE),
    Row("expert_indices.{L}", None, None, "MoE chosen experts", _MOE),
    Row("mlp_out.{L}", "mlp", "output", "raw MLP sublayer output"),
    Row("mlp_out_post.{L}", None, None, "MLP's residual contribution after a post-MLP norm",
        "TorchLens has no facet for the post-sublayer norm output (on GPT-2 and Llama it equals mlp_out)"),
    Row("resid_post.{L}", "block", "resid_post", "residual leaving block L"),
    Row("final_norm", None, None, "final norm output",
        "no facet names the final norm's output; TorchLens has final_norm_input instead (no interp-engine point)"),
    Row("lm_head", "unembed", "output", "logits"),
    Row("resid_streams.{L}", None, None, "all residual streams of block L", _HYPER),
    Row("attn_stream_collapse.{L}", None, None, "collapsed stream the attention reads", _HYPER),
    Row("attn_stream_write.{L}", None, None, "attention's per-stream write weights", _HYPER),
    Row("attn_stream_mix.{L}", None, None, "stream mixing matrix at the attention", _HYPER),
    Row("mlp_stream_collapse.{L}", None, None, "collapsed stream the MLP reads", _HYPER),
    Row("mlp_stream_write.{L}", None, None, "MLP's per-stream write weights", _HYPER),
    Row("mlp_stream_mix.{L}", None, None, "stream mixing matrix at the MLP", _HYPER),
)

#: Points that may carry a `.stream-K` coordinate.
STREAM_POINTS = frozenset({"resid_pre", "resid_mid", "resid_post"})

TABLE = Table("interp-engine", "interp-engine 1.14.3 point addresses", ROWS, absent_once=True, decoder_only=True)

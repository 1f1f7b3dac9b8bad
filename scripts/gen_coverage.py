"""The model zoo: tiny random-init transformers models, each traced and checked against ground truth
from outside TorchLens; and the "Model coverage" page (docs/guides/coverage.md) generated from the run.

Every architecture is built from a small config (2 layers, width 32, fixed seed, no download). For
each attention implementation the model supports (eager, sdpa) and each dtype (float32, bfloat16)
it is traced on a batch of two sequences (left-padded with an attention mask where the model is a
decoder-only language model), and these checks compare the trace with values TorchLens did not
produce:

- `structure`: the stacks, their layer counts, the model kind, the language-model stack, the
  attention / cross-attention / MLP sublayer of every layer, the final norm and the unembedding are
  the modules written in this file's table (read off the transformers source by hand).
- `hooks`: every layer's `resid_pre` / `resid_post`, and the `output` of its attention,
  cross-attention and MLP, equal what plain `register_forward_hook`s saw on those modules during the
  traced forward, bit for bit.
- `hidden_states`: `resid_pre` of layer i equals `output_hidden_states[i]` of the same forward
  (`resid_post` for Mamba, whose `hidden_states[i]` is layer i's output).
- `attentions`: the attention `pattern` equals `output_attentions` (eager: the same forward; sdpa: the
  rebuilt pattern against an eager copy of the model with the same weights), on every query row
  that sees a key; cross-attention patterns against `cross_attentions`.
- `qkv`: where q, k, v have projections of their own, the `q`/`k`/`v` facets equal those
  projections' hooked outputs viewed per head.
- `logits`: the root's `logits` facet equals the logits the model returned.

Usage:
    python scripts/gen_coverage.py          # run the zoo, rewrite docs/guides/coverage.md
    python scripts/gen_coverage.py --check  # exit 1 if the committed page differs from this run

`tests/test_zoo.py` runs the zoo once, asserts every check, and runs the staleness check on the
same results.
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers as tf

import torchlens as tl
from torchlens import testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _outputs import write_or_check  # noqa: E402  (a sibling of this script)

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "guides" / "coverage.md"
V = 64  # vocabulary
_D = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=48, vocab_size=V,
          max_position_embeddings=32)
_GQA = dict(_D, num_key_value_heads=2)
_VISION = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=48, image_size=16,
               patch_size=8)
_QKV = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class StackSpec:
    """What a stack must look like: its layer count and its layers' sublayers (relative addresses)."""

    n: int = 2
    attention: str | None = "self_attn"
    cross: str | None = None
    mlp: str | None = "mlp"
    qkv: tuple[str, str, str] | None = None  # q/k/v projections under the attention, if separate
    qkv_served: bool = True  # False: TorchLens is known not to find q/k/v here (checked only if served)
    fused: tuple[str, str, int] | None = None  # (fused qkv projection under the attention, HF layout, kv groups)
    not_served: tuple[str, ...] = ()  # of q, k, v: known not to be found (checked if they ever are)
    kv_heads: int = 4


@dataclass(frozen=True)
class Arch:
    """One zoo entry: how to build it, what it takes, and the structure it must be found to have."""

    name: str
    config: Callable[[], Any]
    model: type
    kind: str
    stacks: dict[str, StackSpec]
    lm_stack: str | None
    final_norm: str | None
    unembed: str | None
    inputs: str = "text"  # text | seq2seq | image | text+image | llava
    hidden: Callable[[Any], dict[str, tuple]] | None = None
    attentions: Callable[[Any], dict[str, tuple]] | None = None
    cross_attentions: Callable[[Any], dict[str, tuple]] | None = None
    pad: bool = False  # decoder-only LM: a left-padded batch
    hidden_is_output: bool = False  # output_hidden_states[i] is layer i's output (Mamba), not its input
    note: str = ""


def _dec(out):
    return out.hidden_states


def _hs(stack):
    return lambda out: {stack: out.hidden_states}


def _at(stack):
    return lambda out: {stack: out.attentions}


def _lm(name, cfg_cls, model_cls, stack, final_norm, kw, attn="self_attn", mlp="mlp", qkv=_QKV, kv=2, note="",
        unembed="lm_head", qkv_served=True, fused=None, not_served=(), **extra):
    return Arch(name, lambda: cfg_cls(**kw), model_cls, "decoder-only",
                {stack: StackSpec(attention=attn, mlp=mlp, qkv=qkv, kv_heads=kv, qkv_served=qkv_served, fused=fused,
                                  not_served=not_served)},
                stack,
                final_norm, unembed,
                hidden=_hs(stack), attentions=_at(stack), pad=True, note=note, **extra)


def _seq2seq(out, enc, dec):
    return {enc: out.encoder_hidden_states, dec: out.decoder_hidden_states}


ZOO: tuple[Arch, ...] = (
    _lm("GPT-2", tf.GPT2Config, tf.GPT2LMHeadModel, "transformer.h", "transformer.ln_f",
        dict(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=32, bos_token_id=0, eos_token_id=0),
        attn="attn", qkv=None, kv=4),
    _lm("GPT-Neo", tf.GPTNeoConfig, tf.GPTNeoForCausalLM, "transformer.h", "transformer.ln_f",
        dict(num_layers=2, hidden_size=32, num_heads=4, vocab_size=V, max_position_embeddings=32,
             attention_types=[[["global", "local"], 1]], window_size=4, bos_token_id=0, eos_token_id=0),
        attn="attn.attention", kv=4, qkv_served=False,
        note="q, k, v not served (the scores are not traced back through the causal `where`)"),
    _lm("GPT-J", tf.GPTJConfig, tf.GPTJForCausalLM, "transformer.h", "transformer.ln_f",
        dict(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=32, rotary_dim=4, bos_token_id=0,
             eos_token_id=0), attn="attn", qkv=None, kv=4, note="parallel attention and MLP"),
    _lm("GPT-NeoX", tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, "gpt_neox.layers", "gpt_neox.final_layer_norm",
        dict(_D, rotary_pct=0.5, bos_token_id=0, eos_token_id=0), attn="attention", qkv=None, kv=4,
        note="parallel attention and MLP"),
    _lm("OPT", tf.OPTConfig, tf.OPTForCausalLM, "model.decoder.layers", "model.decoder.final_layer_norm",
        dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=48, vocab_size=V,
             max_position_embeddings=32, word_embed_proj_dim=32, pad_token_id=1, bos_token_id=0, eos_token_id=0),
        mlp=None, kv=4, note="no MLP module: fc1 and fc2 sit directly in the layer"),
    _lm("Llama", tf.LlamaConfig, tf.LlamaForCausalLM, "model.layers", "model.norm", _GQA),
    _lm("Mistral", tf.MistralConfig, tf.MistralForCausalLM, "model.layers", "model.norm", _GQA),
    _lm("Qwen2", tf.Qwen2Config, tf.Qwen2ForCausalLM, "model.layers", "model.norm", _GQA),
    _lm("Qwen3", tf.Qwen3Config, tf.Qwen3ForCausalLM, "model.layers", "model.norm", dict(_GQA, head_dim=8),
        note="QK-norm"),
    _lm("Gemma", tf.GemmaConfig, tf.GemmaForCausalLM, "model.layers", "model.norm", dict(_GQA, head_dim=8)),
    _lm("Gemma-2", tf.Gemma2Config, tf.Gemma2ForCausalLM, "model.layers", "model.norm", dict(_GQA, head_dim=8),
        note="sandwich norms, softcaps"),
    _lm("Phi", tf.PhiConfig, tf.PhiForCausalLM, "model.layers", "model.final_layernorm", _D, kv=4,
        note="parallel attention and MLP"),
    _lm("Phi-3", tf.Phi3Config, tf.Phi3ForCausalLM, "model.layers", "model.norm", dict(_GQA, pad_token_id=0),
        qkv=None, note="fused qkv_proj"),
    _lm("Falcon (multi-query)", tf.FalconConfig, tf.FalconForCausalLM, "transformer.h", "transformer.ln_f",
        dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V, multi_query=True,
             new_decoder_architecture=False, parallel_attn=True, bos_token_id=0, eos_token_id=0),
        attn="self_attention", qkv=None, kv=1, fused=("query_key_value", "queries_then_k_v", 1),
        note="q, k, v fused with one kv head; parallel attention"),
    _lm("Falcon (new layout)", tf.FalconConfig, tf.FalconForCausalLM, "transformer.h", "transformer.ln_f",
        dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, vocab_size=V,
             new_decoder_architecture=True, bos_token_id=0, eos_token_id=0),
        attn="self_attention", qkv=None, fused=("query_key_value", "grouped", 2), note="grouped fused qkv"),
    _lm("OLMo", tf.OlmoConfig, tf.OlmoForCausalLM, "model.layers", "model.norm", _GQA),
    _lm("OLMo-2", tf.Olmo2Config, tf.Olmo2ForCausalLM, "model.layers", "model.norm", _GQA,
        note="post-sublayer norms, QK-norm"),
    _lm("StableLM", tf.StableLmConfig, tf.StableLmForCausalLM, "model.layers", "model.norm", _GQA),
    _lm("BLOOM", tf.BloomConfig, tf.BloomForCausalLM, "transformer.h", "transformer.ln_f",
        dict(n_layer=2, hidden_size=32, n_head=4, vocab_size=V, bos_token_id=0, eos_token_id=0),
        attn="self_attention", qkv=None, kv=4, fused=("query_key_value", "per_head_qkv", 4),
        note="ALiBi; scores from baddbmm, z from a bmm over merged heads (v found through it)"),
    _lm("CodeGen", tf.CodeGenConfig, tf.CodeGenForCausalLM, "transformer.h", "transformer.ln_f",
        dict(n_layer=2, n_embd=32, n_head=4, vocab_size=V, n_positions=32, n_ctx=32, rotary_dim=4,
             bos_token_id=0, eos_token_id=0), attn="attn", qkv=None, kv=4, note="parallel attention and MLP"),
    _lm("Mixtral", tf.MixtralConfig, tf.MixtralForCausalLM, "model.layers", "model.norm",
        dict(_GQA, num_local_experts=4, num_experts_per_tok=2), note="mixture of experts"),
    _lm("Qwen2-MoE", tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, "model.layers", "model.norm",
        dict(_GQA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
             shared_expert_intermediate_size=24), note="mixture of experts with a shared expert"),
    Arch("Mamba", lambda: tf.MambaConfig(num_hidden_layers=2, hidden_size=32, state_size=4, vocab_size=V, expand=2,
                                         conv_kernel=2, bos_token_id=0, eos_token_id=0, pad_token_id=0),
         tf.MambaForCausalLM, "decoder-only", {"backbone.layers": StackSpec(attention=None, mlp=None)},
         "backbone.layers", "backbone.norm_f", "lm_head", hidden=_hs("backbone.layers"), hidden_is_output=True,
         note="SSM: layers and their inputs/outputs; no attention or MLP facets"),
    Arch("BERT", lambda: tf.BertConfig(**_D), tf.BertForMaskedLM, "encoder-only",
         {"bert.encoder.layer": StackSpec(attention="attention.self", mlp=None, qkv=("query", "key", "value"))},
         "bert.encoder.layer", "cls.predictions.transform.LayerNorm", "cls.predictions.decoder",
         hidden=_hs("bert.encoder.layer"), attentions=_at("bert.encoder.layer"),
         note="post-LN; the MLP is split over two modules (no MLP facets)"),
    Arch("RoBERTa", lambda: tf.RobertaConfig(**_D, pad_token_id=1), tf.RobertaForMaskedLM, "encoder-only",
         {"roberta.encoder.layer": StackSpec(attention="attention.self", mlp=None, qkv=("query", "key", "value"))},
         "roberta.encoder.layer", "lm_head.layer_norm", "lm_head.decoder",
         hidden=_hs("roberta.encoder.layer"), attentions=_at("roberta.encoder.layer")),
    Arch("DistilBERT", lambda: tf.DistilBertConfig(n_layers=2, dim=32, n_heads=4, hidden_dim=48, vocab_size=V,
                                                   max_position_embeddings=32),
         tf.DistilBertForMaskedLM, "encoder-only",
         {"distilbert.transformer.layer": StackSpec(attention="attention", mlp="ffn",
                                                    qkv=("q_lin", "k_lin", "v_lin"))},
         "distilbert.transformer.layer", "vocab_layer_norm", "vocab_projector",
         hidden=_hs("distilbert.transformer.layer"), attentions=_at("distilbert.transformer.layer")),
    Arch("ALBERT", lambda: tf.AlbertConfig(**_D, embedding_size=16), tf.AlbertForMaskedLM, "encoder-only",
         {"albert.encoder.albert_layer_groups.0.albert_layers": StackSpec(
             attention="attention", mlp=None, qkv=("query", "key", "value"))},
         "albert.encoder.albert_layer_groups.0.albert_layers", "predictions.LayerNorm", "predictions.decoder",
         hidden=_hs("albert.encoder.albert_layer_groups.0.albert_layers"),
         attentions=_at("albert.encoder.albert_layer_groups.0.albert_layers"),
         note="one layer object run twice: two layers, one per call"),
    Arch("ELECTRA", lambda: tf.ElectraConfig(**_D, embedding_size=32), tf.ElectraForMaskedLM, "encoder-only",
         {"electra.encoder.layer": StackSpec(attention="attention.self", mlp=None, qkv=("query", "key", "value"))},
         "electra.encoder.layer", "generator_predictions.LayerNorm", "generator_lm_head",
         hidden=_hs("electra.encoder.layer"), attentions=_at("electra.encoder.layer")),
    Arch("T5", lambda: tf.T5Config(num_layers=2, d_model=32, d_ff=48, num_heads=4, d_kv=8, vocab_size=V),
         tf.T5ForConditionalGeneration, "encoder-decoder",
         {"encoder.block": StackSpec(attention="layer.0.SelfAttention", mlp="layer.1.DenseReluDense",
                                     qkv=("q", "k", "v")),
          "decoder.block": StackSpec(attention="layer.0.SelfAttention", cross="layer.1.EncDecAttention",
                                     mlp="layer.2.DenseReluDense", qkv=("q", "k", "v"))},
         "decoder.block", "decoder.final_layer_norm", "lm_head", inputs="seq2seq",
         hidden=lambda o: _seq2seq(o, "encoder.block", "decoder.block"),
         attentions=lambda o: {"encoder.block": o.encoder_attentions, "decoder.block": o.decoder_attentions},
         cross_attentions=lambda o: {"decoder.block": o.cross_attentions}),
    Arch("BART", lambda: tf.BartConfig(encoder_layers=2, decoder_layers=2, d_model=32, encoder_attention_heads=4,
                                       decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
                                       vocab_size=V, max_position_embeddings=32),
         tf.BartForConditionalGeneration, "encoder-decoder",
         {"model.encoder.layers": StackSpec(mlp=None, qkv=_QKV),
          "model.decoder.layers": StackSpec(cross="encoder_attn", mlp=None, qkv=_QKV)},
         "model.decoder.layers", None, "lm_head", inputs="seq2seq",
         hidden=lambda o: _seq2seq(o, "model.encoder.layers", "model.decoder.layers"),
         attentions=lambda o: {"model.encoder.layers": o.encoder_attentions,
                               "model.decoder.layers": o.decoder_attentions},
         cross_attentions=lambda o: {"model.decoder.layers": o.cross_attentions},
         note="post-LN; fc1/fc2 directly in the layer (no MLP module)"),
    Arch("ViT", lambda: tf.ViTConfig(**_VISION, num_labels=3), tf.ViTForImageClassification, "encoder-only",
         {"vit.layers": StackSpec(attention="attention", mlp="mlp", qkv=None)},
         "vit.layers", "vit.layernorm", None, inputs="image",
         hidden=_hs("vit.layers"), attentions=_at("vit.layers"),
         note="classifier head: no unembedding, no logits facet"),
    Arch("CLIP", lambda: tf.CLIPConfig(
        text_config=dict(_D, max_position_embeddings=32), vision_config=_VISION, projection_dim=16),
         tf.CLIPModel, "multi-tower",
         {"text_model.encoder.layers": StackSpec(qkv=_QKV), "vision_model.encoder.layers": StackSpec(qkv=_QKV)},
         None, None, None, inputs="text+image",
         hidden=lambda o: {"text_model.encoder.layers": o.text_model_output.hidden_states,
                           "vision_model.encoder.layers": o.vision_model_output.hidden_states},
         attentions=lambda o: {"text_model.encoder.layers": o.text_model_output.attentions,
                               "vision_model.encoder.layers": o.vision_model_output.attentions},
         note="two towers, no language-model head: per-layer names resolve `ambiguous`"),
    Arch("LLaVA", lambda: tf.LlavaConfig(
        vision_config=dict(_VISION, model_type="clip_vision_model"),
        text_config=dict(_GQA, model_type="llama"), image_token_index=V - 1, projector_hidden_act="gelu"),
         tf.LlavaForConditionalGeneration, "decoder-only",
         {"model.vision_tower.encoder.layers": StackSpec(qkv=_QKV),
          "model.language_model.layers": StackSpec(qkv=_QKV, kv_heads=2)},
         "model.language_model.layers", "model.language_model.norm", "lm_head", inputs="llava",
         hidden=_hs("model.language_model.layers"), attentions=_at("model.language_model.layers"),
         note="a vision tower feeding a Llama: decoder-only names read the language model"),
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CHECKS = ("structure", "hooks", "hidden_states", "attentions", "qkv", "logits")


@dataclass
class ArchResult:
    """What one architecture's run found: the variants run, the checks passed, the failures."""

    name: str
    kind: str = ""
    stacks: str = ""
    facets: dict[str, list[str]] = field(default_factory=dict)
    variants: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    note: str = ""

    def ok(self, check: str, n: int = 1) -> None:
        self.counts[check] = self.counts.get(check, 0) + n

    def fail(self, where: str, msg: str) -> None:
        self.failures.append(f"{self.name} [{where}]: {msg}")


def build(arch: Arch, attn: str) -> torch.nn.Module:
    """The model with random weights (seed 0) and norm gains/biases perturbed (seed 1), float32:
    `torchlens.testing.from_config`, with the attention implementation set on the sub-configs of
    a multimodal config too."""
    cfg = arch.config()
    for sub in ("text_config", "vision_config"):
        if getattr(cfg, sub, None) is not None:
            getattr(cfg, sub)._attn_implementation = attn
    return testing.from_config(cfg, arch.model, attn)


def make_inputs(arch: Arch) -> tuple[tuple, dict, torch.Tensor | None]:
    """(args, kwargs, the attention mask or None) for a batch of two."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, V, (2, 6), generator=g)
    pixels = torch.randn(2, 3, 16, 16, generator=g)
    if arch.inputs == "image":
        return (pixels,), {}, None
    if arch.inputs == "text+image":
        return (), {"input_ids": ids, "pixel_values": pixels}, None
    if arch.inputs == "llava":  # four image tokens: one per 8x8 patch of the 16x16 image
        ids = ids.clone()
        ids[:, 1:5] = V - 1
        return (), {"input_ids": ids, "pixel_values": pixels}, None
    if arch.inputs == "seq2seq":
        return (ids,), {"decoder_input_ids": ids[:, :4]}, None
    if arch.pad:
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        ids = ids.clone()
        ids[0, :2] = 0
        return (ids,), {"attention_mask": mask}, mask
    return (ids,), {}, None


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for v in x:
            t = _first_tensor(v)
            if t is not None:
                return t
    if isinstance(x, dict):
        for v in x.values():
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


def _hooked_run(model, modules: dict[str, torch.nn.Module], args, kwargs, **flags):
    """Run the model with plain hooks: address -> [(input, output)] per call, and the output."""
    seen: dict[str, list] = {a: [] for a in modules}
    handles = []
    for addr, m in modules.items():
        def pre(mod, a, kw, addr=addr):
            t = a[0] if a and isinstance(a[0], torch.Tensor) else (
                None if a else next((v for v in kw.values() if isinstance(v, torch.Tensor)), None))
            seen[addr].append([None if t is None else t.detach().clone(), None])

        def post(mod, a, kw, out, addr=addr):
            t = _first_tensor(out)
            seen[addr][-1][1] = None if t is None else t.detach().clone()

        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            out = model(*args, **kwargs, **flags)
    finally:
        for h in handles:
            h.remove()
    return seen, out


def _split_fused(flat: torch.Tensor, layout: str, groups: int, heads: int) -> dict[str, torch.Tensor]:
    """q, k, v per head from a fused projection output, by the layouts the transformers source uses."""
    b, t, width = flat.shape
    d = width // {"queries_then_k_v": heads + 2, "grouped": heads + 2 * groups, "per_head_qkv": 3 * heads}[layout]
    if layout == "queries_then_k_v":  # Falcon multi-query: heads query slices, then one key, one value
        x = flat.view(b, t, heads + 2, d)
        return {"q": x[:, :, :heads], "k": x[:, :, heads:heads + 1], "v": x[:, :, heads + 1:]}
    if layout == "grouped":  # Falcon's new layout: per kv group, its queries, then its key and value
        x = flat.view(b, t, groups, heads // groups + 2, d)
        return {"q": x[:, :, :, :-2].reshape(b, t, heads, d), "k": x[:, :, :, -2], "v": x[:, :, :, -1]}
    if layout == "per_head_qkv":  # BLOOM: per head, its q, k, v
        x = flat.view(b, t, heads, 3, d)
        return {"q": x[..., 0, :], "k": x[..., 1, :], "v": x[..., 2, :]}
    raise ValueError(layout)


def _equal(a, b) -> bool:
    return a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _close_visible(pattern: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype,
                   query_mask: torch.Tensor | None = None) -> float:
    """Largest difference over query rows that see at least one key: rows of all zeros are skipped,
    and so are the padding queries of a left-padded batch (`query_mask` 0), which see no key. There
    the sdpa kernel uses no weights (its output row is zero, and TorchLens serves a zero row) while
    eager attention spreads them uniformly, so the eager model is no ground truth for those rows."""
    rows = truth.float().abs().sum(-1, keepdim=True) > 0
    if query_mask is not None and truth.dim() == 4 and truth.shape[-2] == query_mask.shape[-1]:
        rows = rows & query_mask.bool().view(query_mask.shape[0], 1, -1, 1)
    diff = torch.where(rows, (pattern.float() - truth.float()).abs(), torch.zeros(()))
    return float(diff.max()) if diff.numel() else 0.0


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


def check_variant(arch: Arch, res: ArchResult, model, eager_model, attn: str, dname: str) -> None:
    dtype = DTYPES[dname]
    where = f"{attn}/{dname}"
    args, kwargs, mask = make_inputs(arch)
    if dtype != torch.float32:
        args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
        kwargs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in kwargs.items()}
    all_mods = dict(model.named_modules())
    # the modules plain hooks watch: each stack's distinct layer modules and their sublayers
    watch: dict[str, torch.nn.Module] = {}
    layer_addrs: dict[str, list[str]] = {}
    for sname, spec in arch.stacks.items():
        holder = all_mods[sname]
        distinct = []
        for child_name, child in holder.named_children():
            if child not in distinct:
                distinct.append(child)
                layer_addrs.setdefault(sname, []).append(f"{sname}.{child_name}")
        for addr in layer_addrs[sname]:
            watch[addr] = all_mods[addr]
            for rel in (spec.attention, spec.cross, spec.mlp) + tuple(
                    f"{spec.attention}.{p}" for p in (spec.qkv or ())) + (
                    (f"{spec.attention}.{spec.fused[0]}",) if spec.fused else ()):
                if rel is not None:
                    watch[f"{addr}.{rel}"] = all_mods[f"{addr}.{rel}"]
    flags = {"output_hidden_states": True} if arch.hidden else {}
    if arch.attentions and attn == "eager":
        flags["output_attentions"] = True
    # The plain hooks watch the traced forward itself: ground truth for the values that forward used.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        seen, trace = _hooked_run(lambda *a, **k: tl.trace(model, *a, **k), watch, args, kwargs, **flags)
    out = trace.output
    s = trace.structure
    # structure
    problems = []
    if s.kind != arch.kind:
        problems.append(f"kind {s.kind!r}, expected {arch.kind!r}")
    if {n: len(st.layers) for n, st in s.stacks.items()} != {n: sp.n for n, sp in arch.stacks.items()}:
        problems.append(f"stacks {s.describe()}, expected {', '.join(f'{n} ({sp.n})' for n, sp in arch.stacks.items())}")
    if s.lm_stack != arch.lm_stack:
        problems.append(f"lm_stack {s.lm_stack!r}, expected {arch.lm_stack!r}")
    for got, want, what in ((s.final_norm, arch.final_norm, "final norm"), (s.unembed, arch.unembed, "unembed")):
        if (got.address if got else None) != want:
            problems.append(f"{what} {got.address if got else None!r}, expected {want!r}")
    for sname, spec in arch.stacks.items():
        stack = s.stacks.get(sname)
        if stack is None:
            continue
        for i, layer in enumerate(stack.layers):
            base = layer.call.address
            for got, rel, what in ((layer.attention, spec.attention, "attention"),
                                   (layer.cross_attention, spec.cross, "cross-attention"), (layer.mlp, spec.mlp, "mlp")):
                want = f"{base}.{rel}" if rel else None
                if (got.address if got else None) != want:
                    problems.append(f"{sname}[{i}] {what} {got.address if got else None!r}, expected {want!r}")
    if problems:
        res.fail(where, "structure: " + "; ".join(problems))
        return
    res.ok("structure")
    # hooks: resid_pre/post of every layer call, sublayer outputs, q/k/v
    for sname, spec in arch.stacks.items():
        calls = [(a, k) for a in layer_addrs[sname] for k in range(len(seen[a]))]
        calls.sort(key=lambda ak: trace.modules[ak[0]].calls[ak[1]].first_op)
        layers = s.stacks[sname].layers
        for i, (layer, (addr, k)) in enumerate(zip(layers, calls)):
            f = layer.call.facets
            hin, hout = seen[addr][k]
            for facet, truth in (("resid_pre", hin), ("resid_post", hout)):
                if not _equal(f.sites[facet].tensor, truth):
                    res.fail(where, f"hooks: {sname}[{i}] {facet} differs from the plain hook")
                else:
                    res.ok("hooks")
            for sub, rel in ((layer.attention, spec.attention), (layer.cross_attention, spec.cross), (layer.mlp, spec.mlp)):
                if sub is None:
                    continue
                truth = seen[f"{addr}.{rel}"][k][1]
                if not _equal(sub.facets.sites["output"].tensor, truth):
                    res.fail(where, f"hooks: {sub.address} output differs from the plain hook")
                else:
                    res.ok("hooks")
            if spec.qkv and layer.attention is not None:
                sites = layer.attention.facets.sites
                for name, proj in zip("qkv", spec.qkv):
                    flat = seen[f"{addr}.{spec.attention}.{proj}"][k][1]
                    site = sites.get(name)
                    if site is None or site.tensor is None:
                        if spec.qkv_served:
                            res.fail(where, f"qkv: {layer.attention.address} has no {name}")
                        continue
                    b, t = flat.shape[:2]
                    truth = flat.reshape(b, t, -1, site.tensor.shape[-1])
                    if not _equal(site.tensor.contiguous(), truth):
                        res.fail(where, f"qkv: {layer.attention.address} {name} differs from its projection")
                    else:
                        res.ok("qkv")
            if spec.fused and layer.attention is not None:
                sites = layer.attention.facets.sites
                truth = _split_fused(seen[f"{addr}.{spec.attention}.{spec.fused[0]}"][k][1], spec.fused[1],
                                     spec.fused[2], sites["pattern"].shape[1])
                for name in "qkv":
                    site = sites.get(name)
                    if name in spec.not_served and site is None:
                        continue
                    if site is None or site.tensor is None or not _equal(site.tensor.contiguous(), truth[name]):
                        res.fail(where, f"qkv: {layer.attention.address} {name} differs from the fused projection split "
                                        f"by the {spec.fused[1]} layout")
                    else:
                        res.ok("qkv")
    # hidden states, attentions, logits from the model's own outputs (of the traced forward)
    if arch.hidden:
        facet = "resid_post" if arch.hidden_is_output else "resid_pre"
        for sname, states in arch.hidden(out).items():
            for i, layer in enumerate(s.stacks[sname].layers):
                if not _equal(layer.call.facets.sites[facet].tensor, states[i]):
                    res.fail(where, f"hidden_states: {sname}[{i}] {facet} differs from output_hidden_states[{i}]")
                else:
                    res.ok("hidden_states")
    if arch.attentions:
        ref_model = model if attn == "eager" else eager_model
        if ref_model is not None:
            if attn == "eager":
                ref_out = out
            else:
                with torch.no_grad():
                    ref_out = ref_model(*args, **kwargs, output_attentions=True)
            tol = _tolerance(dtype) * (1 if attn == "eager" else 5)
            pairs = [(arch.attentions, "attention")] + ([(arch.cross_attentions, "cross_attention")]
                                                        if arch.cross_attentions else [])
            for getter, which in pairs:
                for sname, atts in getter(ref_out).items():
                    for i, layer in enumerate(s.stacks[sname].layers):
                        sub = getattr(layer, which)
                        site = sub.facets.sites.get("pattern") if sub is not None else None
                        if site is None or site.tensor is None:
                            res.fail(where, f"attentions: {sname}[{i}] {which} has no pattern")
                            continue
                        err = _close_visible(site.tensor, atts[i], dtype, mask)
                        if site.tensor.shape != atts[i].shape or err > tol:
                            res.fail(where, f"attentions: {sname}[{i}] {which} pattern off by {err:.3g} (> {tol:g})")
                        else:
                            res.ok("attentions")
    if arch.unembed:
        logits = trace.modules[""].facets.sites.get("logits")
        if logits is None or not _equal(logits.tensor, out.logits):
            res.fail(where, "logits: the root's logits differ from the model's")
        else:
            res.ok("logits")
    if not res.facets:
        trace.check()  # checks run on first read: run them all, so the page lists only facets that hold
        first = {n: st.layers[0] for n, st in s.stacks.items()}
        for sname, layer in first.items():
            for label, call in (("block", layer.call), ("attention", layer.attention),
                                ("cross-attention", layer.cross_attention), ("mlp", layer.mlp)):
                if call is not None:
                    res.facets[f"{sname} {label}"] = sorted(call.facets.sites)
        res.facets["root"] = sorted(trace.modules[""].facets.sites)
        res.kind, res.stacks = s.kind, s.describe()
    res.variants.append(where + (" left-padded" if mask is not None else ""))


def run_arch(arch: Arch) -> ArchResult:
    """Every variant of one architecture; failures are collected, not raised."""
    res = ArchResult(arch.name, note=arch.note)
    eager_model = None
    for attn in ("eager", "sdpa"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                base = build(arch, attn)
        except (ValueError, NotImplementedError) as e:
            res.unsupported.append(f"{attn}: {str(e).splitlines()[0][:90]}")
            continue
        if attn == "eager":
            eager_model = base
        for dname, dtype in DTYPES.items():
            model = base if dtype == torch.float32 else copy.deepcopy(base).to(dtype)
            ref = None if eager_model is None else (
                eager_model if dtype == torch.float32 else copy.deepcopy(eager_model).to(dtype))
            try:
                check_variant(arch, res, model, ref, attn, dname)
            except Exception as e:  # a crash is a failure of this variant, reported with the others
                res.fail(f"{attn}/{dname}", f"raised {type(e).__name__}: {e}")
    return res


def run_zoo(names: list[str] | None = None) -> list[ArchResult]:
    return [run_arch(a) for a in ZOO if names is None or a.name in names]


def render(results: list[ArchResult]) -> str:
    """The coverage page (deterministic: no timings)."""
    lines = [
        "# Model coverage",
        "",
        "<!-- Generated by scripts/gen_coverage.py from a run of the model zoo; do not edit. -->",
        "",
        f"Each of these {len(results)} architectures is built from a tiny `transformers` "
        f"{tf.__version__} config (2 layers, width 32, random weights, fixed seed), traced in every "
        "variant it supports (attention implementation × dtype, on a batch of two; decoder-only "
        "language models get a left-padded batch with an attention mask), and checked against values "
        "TorchLens did not compute. `tests/test_zoo.py` runs the same zoo and fails on any check.",
        "",
        "| check | compared with |",
        "|---|---|",
        "| structure | the stacks, layer counts, model kind, language-model stack, attention / cross-attention / "
        "MLP of every layer, final norm and unembedding written by hand in `scripts/gen_coverage.py` |",
        "| hooks | every layer's `resid_pre`/`resid_post` and its sublayers' `output`: plain forward hooks on the "
        "traced forward, bit for bit |",
        "| hidden_states | layer i's `resid_pre` (Mamba: `resid_post`): `output_hidden_states[i]` of the same forward, "
        "bit for bit |",
        "| attentions | `pattern` (and cross-attention's): `output_attentions` of an eager run with the same weights, "
        "on rows that see a key |",
        "| qkv | `q`, `k`, `v`: the hooked q/k/v projection outputs viewed per head, bit for bit |",
        "| logits | the root's `logits`: the logits the model returned |",
        "",
        "## How the structure is found",
        "",
        "No family is special-cased. A *stack* is a group of repeated modules (the children of a "
        "`ModuleList` or `Sequential`, of one class or several as in a hybrid stack such as Jamba's, or "
        "same-class siblings) whose calls keep their input's "
        "shape and each read the previous call's output; its layers are those calls, one per call (ALBERT's "
        "single layer object run twice is two layers). In a layer, the attention is the child that ran the "
        "attention kernel (looking inside wrappers that add their own input, like T5's `T5LayerSelfAttention`), "
        "a second attention whose keys come from outside the layer is the cross-attention, and the MLP is the "
        "one child with two or more weight-reading ops and no kernel that mixes no positions (no convolution), "
        "applies a nonlinearity and keeps its input's width, read after the token mixer, whatever that mixer "
        "is (attention, SSM, conv); a side module beside the mixer or the MLP is never taken for it. The unembedding is the linear layer as wide as "
        "the token embedding's vocabulary whose output reaches the model output; the language-model stack is "
        "the one feeding it; the final norm is the last norm after that stack's last layer, before the "
        "unembedding. `trace.structure` holds the result (`stacks`, `kind`, `lm_stack`, `final_norm`, `unembed`).",
        "",
        "Decoder-only naming generations read the language-model stack; with several stacks and none feeding a "
        "language-model head (CLIP) a per-layer name resolves `ambiguous`. On BERT-like encoders TransformerLens "
        "2.x names follow `HookedEncoder` (post-LN blocks), and on T5 TransformerLens 2.x names follow "
        "`HookedEncoderDecoder` (`encoder.{L}`, `decoder.{L}`) and 4.x names the bridge's `encoder_blocks` / "
        "`decoder_blocks`, each stack numbered from 0; nnterp and interp-engine serve decoder-only models and say "
        "so on any other kind. Where the rules cannot tell, `tl.trace(model, ..., roles={\"body.*\": \"block\", "
        "\"body.*.mix\": \"attention\"})` names blocks, attention, cross-attention, MLP, norms and the "
        "unembedding (`*` is one address part); a model with repeated modules and no block found gets a warning "
        "saying so.",
        "",
        "## Summary",
        "",
        "| architecture | kind | stacks | variants | checks passed | notes |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        checks = ", ".join(f"{c} {r.counts[c]}" for c in CHECKS if c in r.counts)
        variants = sorted({v.split(" ")[0] for v in r.variants})
        extra = "; ".join(([r.note] if r.note else []) + [f"not run: {u}" for u in r.unsupported]).replace("|", "/")
        status = "" if not r.failures else f" **{len(r.failures)} failed**"
        lines.append(f"| {r.name} | {r.kind} | {r.stacks} | {', '.join(variants)} | {checks}{status} | {extra} |")
    lines += ["", "## Facets per architecture", "",
              "The facets found on layer 0 of each stack (and on the root).", ""]
    for r in results:
        lines += [f"### {r.name}", ""]
        for where, names in r.facets.items():
            lines.append(f"- **{where}**: {', '.join(f'`{n}`' for n in names)}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/guides/coverage.md is stale")
    args = parser.parse_args(argv)
    results = run_zoo()
    failed = [f for r in results for f in r.failures]
    for f in failed:
        print(f, file=sys.stderr)
    status = write_or_check({PAGE: render(results)}, args.check, ROOT, "python scripts/gen_coverage.py")
    return 1 if failed else status


if __name__ == "__main__":
    sys.exit(main())

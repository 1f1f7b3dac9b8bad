"""The registry of model families: the config settings the rows share, one `Family` row per
family (`_ROWS`), checked on import and served as `FAMILIES`, and `SUITE`, the families the tests
over every family run."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from torchlens.testing._family import Family, OpGraph, Stack, Structure, check_families

#: Vocabulary size of every model [`build`][torchlens.testing.build] makes.
VOCAB = 64
#: Position limit of the suite's models (the zoo's models with learned positions take 32).
MAX_POSITIONS = 16

#: The shape the Llama-like families share: 2 layers, d_model 32, 4 query heads over 2 key/value
#: heads (grouped-query attention), d_head 8, d_mlp 48. Config keyword arguments.
LLAMA_LIKE: Mapping[str, int] = MappingProxyType(
    {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 48,
        "vocab_size": VOCAB,
        "max_position_embeddings": MAX_POSITIONS,
    }
)

_SPECIAL = {"bos_token_id": 0, "eos_token_id": 0}
_GPT2 = {
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "vocab_size": VOCAB,
    "n_positions": MAX_POSITIONS,
    **_SPECIAL,
}
_NEOX = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "intermediate_size": 48,
    "vocab_size": VOCAB,
    "max_position_embeddings": MAX_POSITIONS,
    "rotary_pct": 0.5,
    **_SPECIAL,
}
#: Multi-head (no grouped-query) models with learned positions: 32 of them.
_SMALL = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "intermediate_size": 48,
    "vocab_size": VOCAB,
    "max_position_embeddings": 32,
}
_VISION = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "intermediate_size": 48,
    "image_size": 16,
    "patch_size": 8,
}
_QKV = ("q_proj", "k_proj", "v_proj")


def _decoder(
    stack: str,
    final_norm: str,
    embed: str,
    *,
    attention: str = "self_attn",
    mlp: str | None = "mlp",
    qkv: tuple[str, str, str] | None = _QKV,
    qkv_served: bool = True,
    fused: tuple[str, str, int] | None = None,
    not_served: tuple[str, ...] = (),
    note: str = "",
) -> Structure:
    """The structure of a decoder-only language model with one stack and an `lm_head`."""
    return Structure(
        "decoder-only",
        {
            stack: Stack(
                attention=attention,
                mlp=mlp,
                qkv=qkv,
                qkv_served=qkv_served,
                fused=fused,
                not_served=not_served,
            )
        },
        stack,
        final_norm,
        "lm_head",
        embed,
        hidden={stack: "hidden_states"},
        attentions={stack: "attentions"},
        pad=True,
        note=note,
    )


def _llama_like(note: str = "", **kw: Any) -> Structure:
    return _decoder("model.layers", "model.norm", "model.embed_tokens", note=note, **kw)


def _encoder(
    stack: str,
    final_norm: str,
    unembed: str,
    embed: str,
    attention: str,
    qkv: tuple[str, str, str],
    mlp: str | None = None,
    note: str = "",
) -> Structure:
    """The structure of a masked language model (BERT-like: one stack, a prediction head)."""
    return Structure(
        "encoder-only",
        {stack: Stack(attention=attention, mlp=mlp, qkv=qkv)},
        stack,
        final_norm,
        unembed,
        embed,
        hidden={stack: "hidden_states"},
        attentions={stack: "attentions"},
        note=note,
    )


def _seq2seq(
    encoder: str,
    decoder: str,
    stacks: tuple[Stack, Stack],
    final_norm: str | None,
    embed: str,
    note: str = "",
) -> Structure:
    """The structure of an encoder-decoder language model."""
    return Structure(
        "encoder-decoder",
        {encoder: stacks[0], decoder: stacks[1]},
        decoder,
        final_norm,
        "lm_head",
        embed,
        inputs="seq2seq",
        hidden={encoder: "encoder_hidden_states", decoder: "decoder_hidden_states"},
        attentions={encoder: "encoder_attentions", decoder: "decoder_attentions"},
        cross_attentions={decoder: "cross_attentions"},
        note=note,
    )


_EAGER_ONLY = ("eager",)
_BERT_QKV = ("query", "key", "value")

_ROWS = (
    Family(
        name="gpt2",
        title="GPT-2",
        config="GPT2Config",
        model="GPT2LMHeadModel",
        settings=_GPT2,
        suite=True,
        structure=_decoder(
            "transformer.h", "transformer.ln_f", "transformer.wte", attention="attn", qkv=None
        ),
        diagram=True,
        engines=True,
        op_graph=OpGraph(
            "`testing.build('gpt2')`: two GPT-2 blocks, d_model 32", "transformer.h.0"
        ),
    ),
    Family(
        name="gpt2_upcast",
        title="GPT-2 (upcast attention)",
        config="GPT2Config",
        model="GPT2LMHeadModel",
        settings=dict(_GPT2, reorder_and_upcast_attn=True),
        attn_implementations=_EAGER_ONLY,
        suite=True,
        why="`reorder_and_upcast_attn` (eager scores from a float32 `baddbmm`) changes only the eager attention",
    ),
    Family(
        name="gpt_neo",
        title="GPT-Neo",
        config="GPTNeoConfig",
        model="GPTNeoForCausalLM",
        settings=dict(
            num_layers=2,
            hidden_size=32,
            num_heads=4,
            vocab_size=VOCAB,
            max_position_embeddings=32,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
            **_SPECIAL,
        ),
        attn_implementations=_EAGER_ONLY,
        why="transformers has no sdpa attention for GPT-Neo",
        structure=_decoder(
            "transformer.h",
            "transformer.ln_f",
            "transformer.wte",
            attention="attn.attention",
            qkv_served=False,
            note="q, k, v not served (the scores are not traced back through the causal `where`)",
        ),
    ),
    Family(
        name="gptj",
        title="GPT-J",
        config="GPTJConfig",
        model="GPTJForCausalLM",
        settings=dict(
            n_layer=2,
            n_embd=32,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=32,
            rotary_dim=4,
            **_SPECIAL,
        ),
        structure=_decoder(
            "transformer.h",
            "transformer.ln_f",
            "transformer.wte",
            attention="attn",
            qkv=None,
            note="parallel attention and MLP",
        ),
    ),
    Family(
        name="gpt_neox",
        title="GPT-NeoX",
        config="GPTNeoXConfig",
        model="GPTNeoXForCausalLM",
        settings=dict(_NEOX, use_parallel_residual=True),
        suite=True,
        diagram=True,
        structure=_decoder(
            "gpt_neox.layers",
            "gpt_neox.final_layer_norm",
            "gpt_neox.embed_in",
            attention="attention",
            qkv=None,
            note="parallel attention and MLP",
        ),
    ),
    Family(
        name="gpt_neox_sequential",
        title="GPT-NeoX (sequential residual)",
        config="GPTNeoXConfig",
        model="GPTNeoXForCausalLM",
        settings=dict(_NEOX, use_parallel_residual=False),
        suite=True,
    ),
    Family(
        name="opt",
        title="OPT",
        config="OPTConfig",
        model="OPTForCausalLM",
        settings=dict(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            ffn_dim=48,
            vocab_size=VOCAB,
            max_position_embeddings=32,
            word_embed_proj_dim=32,
            pad_token_id=1,
            **_SPECIAL,
        ),
        structure=_decoder(
            "model.decoder.layers",
            "model.decoder.final_layer_norm",
            "model.decoder.embed_tokens",
            mlp=None,
            note="no MLP module: fc1 and fc2 sit directly in the layer",
        ),
    ),
    Family(
        name="llama",
        title="Llama",
        config="LlamaConfig",
        model="LlamaForCausalLM",
        settings=LLAMA_LIKE,
        suite=True,
        structure=_llama_like(),
        diagram=True,
        engines=True,
        op_graph=OpGraph(
            "`testing.build('llama')`: two Llama layers, d_model 32, grouped-query attention",
            "model.layers.0",
        ),
    ),
    Family(
        name="mistral",
        title="Mistral",
        config="MistralConfig",
        model="MistralForCausalLM",
        settings=dict(LLAMA_LIKE, sliding_window=None, **_SPECIAL),
        suite=True,
        structure=_llama_like(),
        diagram=True,
    ),
    Family(
        name="qwen2",
        title="Qwen2",
        config="Qwen2Config",
        model="Qwen2ForCausalLM",
        settings=LLAMA_LIKE,
        structure=_llama_like(),
    ),
    Family(
        name="qwen3",
        title="Qwen3",
        config="Qwen3Config",
        model="Qwen3ForCausalLM",
        settings=dict(LLAMA_LIKE, head_dim=8, **_SPECIAL),
        suite=True,
        structure=_llama_like("QK-norm"),
        diagram=True,
    ),
    Family(
        name="gemma",
        title="Gemma",
        config="GemmaConfig",
        model="GemmaForCausalLM",
        settings=dict(LLAMA_LIKE, head_dim=8),
        structure=_llama_like(),
    ),
    Family(
        name="gemma2",
        title="Gemma-2",
        config="Gemma2Config",
        model="Gemma2ForCausalLM",
        slug="gemma-2",
        settings=dict(LLAMA_LIKE, head_dim=8, sliding_window=4, pad_token_id=0, **_SPECIAL),
        attn_implementations=_EAGER_ONLY,
        why="transformers runs Gemma-2 with eager attention only (softcapping)",
        suite=True,
        structure=_llama_like("sandwich norms, softcaps"),
        diagram=True,
    ),
    Family(
        name="phi",
        title="Phi",
        config="PhiConfig",
        model="PhiForCausalLM",
        settings=_SMALL,
        structure=_decoder(
            "model.layers",
            "model.final_layernorm",
            "model.embed_tokens",
            note="parallel attention and MLP",
        ),
    ),
    Family(
        name="phi3",
        title="Phi-3",
        config="Phi3Config",
        model="Phi3ForCausalLM",
        slug="phi-3",
        settings=dict(LLAMA_LIKE, pad_token_id=0, **_SPECIAL),
        suite=True,
        structure=_llama_like("fused qkv_proj", qkv=None),
        diagram=True,
    ),
    Family(
        name="falcon_multi_query",
        title="Falcon (multi-query)",
        config="FalconConfig",
        model="FalconForCausalLM",
        settings=dict(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            vocab_size=VOCAB,
            multi_query=True,
            new_decoder_architecture=False,
            parallel_attn=True,
            **_SPECIAL,
        ),
        structure=_decoder(
            "transformer.h",
            "transformer.ln_f",
            "transformer.word_embeddings",
            attention="self_attention",
            qkv=None,
            fused=("query_key_value", "queries_then_k_v", 1),
            note="q, k, v fused with one kv head; parallel attention",
        ),
    ),
    Family(
        name="falcon_new_layout",
        title="Falcon (new layout)",
        config="FalconConfig",
        model="FalconForCausalLM",
        settings=dict(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_kv_heads=2,
            vocab_size=VOCAB,
            new_decoder_architecture=True,
            **_SPECIAL,
        ),
        structure=_decoder(
            "transformer.h",
            "transformer.ln_f",
            "transformer.word_embeddings",
            attention="self_attention",
            qkv=None,
            fused=("query_key_value", "grouped", 2),
            note="grouped fused qkv",
        ),
    ),
    Family(
        name="olmo",
        title="OLMo",
        config="OlmoConfig",
        model="OlmoForCausalLM",
        settings=LLAMA_LIKE,
        structure=_llama_like(),
    ),
    Family(
        name="olmo2",
        title="OLMo-2",
        config="Olmo2Config",
        model="Olmo2ForCausalLM",
        slug="olmo-2",
        settings=dict(LLAMA_LIKE, pad_token_id=0, **_SPECIAL),
        suite=True,
        structure=_llama_like("post-sublayer norms, QK-norm"),
        diagram=True,
    ),
    Family(
        name="stablelm",
        title="StableLM",
        config="StableLmConfig",
        model="StableLmForCausalLM",
        settings=LLAMA_LIKE,
        structure=_llama_like(),
    ),
    Family(
        name="bloom",
        title="BLOOM",
        config="BloomConfig",
        model="BloomForCausalLM",
        settings=dict(n_layer=2, hidden_size=32, n_head=4, vocab_size=VOCAB, **_SPECIAL),
        attn_implementations=_EAGER_ONLY,
        why="transformers has no sdpa attention for BLOOM (ALiBi)",
        structure=_decoder(
            "transformer.h",
            "transformer.ln_f",
            "transformer.word_embeddings",
            attention="self_attention",
            qkv=None,
            fused=("query_key_value", "per_head_qkv", 4),
            note="ALiBi; scores from baddbmm, z from a bmm over merged heads (v found through it)",
        ),
    ),
    Family(
        name="codegen",
        title="CodeGen",
        config="CodeGenConfig",
        model="CodeGenForCausalLM",
        settings=dict(
            n_layer=2,
            n_embd=32,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=32,
            n_ctx=32,
            rotary_dim=4,
            **_SPECIAL,
        ),
        structure=_decoder(
            "transformer.h",
            "transformer.ln_f",
            "transformer.wte",
            attention="attn",
            qkv=None,
            note="parallel attention and MLP",
        ),
    ),
    Family(
        name="mixtral",
        title="Mixtral",
        config="MixtralConfig",
        model="MixtralForCausalLM",
        settings=dict(LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2),
        structure=_llama_like("mixture of experts"),
    ),
    Family(
        name="qwen2_moe",
        title="Qwen2-MoE",
        config="Qwen2MoeConfig",
        model="Qwen2MoeForCausalLM",
        settings=dict(
            LLAMA_LIKE,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
        ),
        structure=_llama_like("mixture of experts with a shared expert"),
    ),
    Family(
        name="mamba",
        title="Mamba",
        config="MambaConfig",
        model="MambaForCausalLM",
        settings=dict(
            num_hidden_layers=2,
            hidden_size=32,
            state_size=4,
            vocab_size=VOCAB,
            expand=2,
            conv_kernel=2,
            pad_token_id=0,
            **_SPECIAL,
        ),
        attn_implementations=_EAGER_ONLY,
        why="Mamba has no attention",
        structure=Structure(
            "decoder-only",
            {"backbone.layers": Stack(attention=None, mlp=None)},
            "backbone.layers",
            "backbone.norm_f",
            "lm_head",
            "backbone.embeddings",
            hidden={"backbone.layers": "hidden_states"},
            hidden_is_output=True,
            note="SSM: layers and their inputs/outputs; no attention or MLP facets",
        ),
    ),
    Family(
        name="bert",
        title="BERT",
        config="BertConfig",
        model="BertForMaskedLM",
        settings=_SMALL,
        structure=_encoder(
            "bert.encoder.layer",
            "cls.predictions.transform.LayerNorm",
            "cls.predictions.decoder",
            "bert.embeddings.word_embeddings",
            "attention.self",
            _BERT_QKV,
            note="post-LN; the MLP is split over two modules (no MLP facets)",
        ),
    ),
    Family(
        name="roberta",
        title="RoBERTa",
        config="RobertaConfig",
        model="RobertaForMaskedLM",
        settings=dict(_SMALL, pad_token_id=1),
        structure=_encoder(
            "roberta.encoder.layer",
            "lm_head.layer_norm",
            "lm_head.decoder",
            "roberta.embeddings.word_embeddings",
            "attention.self",
            _BERT_QKV,
        ),
    ),
    Family(
        name="distilbert",
        title="DistilBERT",
        config="DistilBertConfig",
        model="DistilBertForMaskedLM",
        settings=dict(
            n_layers=2,
            dim=32,
            n_heads=4,
            hidden_dim=48,
            vocab_size=VOCAB,
            max_position_embeddings=32,
        ),
        structure=_encoder(
            "distilbert.transformer.layer",
            "vocab_layer_norm",
            "vocab_projector",
            "distilbert.embeddings.word_embeddings",
            "attention",
            ("q_lin", "k_lin", "v_lin"),
            mlp="ffn",
        ),
    ),
    Family(
        name="albert",
        title="ALBERT",
        config="AlbertConfig",
        model="AlbertForMaskedLM",
        settings=dict(_SMALL, embedding_size=16),
        structure=_encoder(
            "albert.encoder.albert_layer_groups.0.albert_layers",
            "predictions.LayerNorm",
            "predictions.decoder",
            "albert.embeddings.word_embeddings",
            "attention",
            _BERT_QKV,
            note="one layer object run twice: two layers, one per call",
        ),
    ),
    Family(
        name="electra",
        title="ELECTRA",
        config="ElectraConfig",
        model="ElectraForMaskedLM",
        settings=dict(_SMALL, embedding_size=32),
        structure=_encoder(
            "electra.encoder.layer",
            "generator_predictions.LayerNorm",
            "generator_lm_head",
            "electra.embeddings.word_embeddings",
            "attention.self",
            _BERT_QKV,
        ),
    ),
    Family(
        name="t5",
        title="T5",
        config="T5Config",
        model="T5ForConditionalGeneration",
        settings=dict(num_layers=2, d_model=32, d_ff=48, num_heads=4, d_kv=8, vocab_size=VOCAB),
        structure=_seq2seq(
            "encoder.block",
            "decoder.block",
            (
                Stack(
                    attention="layer.0.SelfAttention",
                    mlp="layer.1.DenseReluDense",
                    qkv=("q", "k", "v"),
                ),
                Stack(
                    attention="layer.0.SelfAttention",
                    cross="layer.1.EncDecAttention",
                    mlp="layer.2.DenseReluDense",
                    qkv=("q", "k", "v"),
                ),
            ),
            "decoder.final_layer_norm",
            "encoder.embed_tokens",
        ),
        # The encoder's second layer: the first also computes T5's position bias (see the rolled drawing).
        op_graph=OpGraph(
            "`transformers.T5Config(num_layers=3, d_model=32, ...)`: an encoder-decoder, three "
            "layers each, random weights",
            "encoder.block.1",
            {"num_layers": 3},
        ),
    ),
    Family(
        name="bart",
        title="BART",
        config="BartConfig",
        model="BartForConditionalGeneration",
        settings=dict(
            encoder_layers=2,
            decoder_layers=2,
            d_model=32,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=48,
            decoder_ffn_dim=48,
            vocab_size=VOCAB,
            max_position_embeddings=32,
        ),
        structure=_seq2seq(
            "model.encoder.layers",
            "model.decoder.layers",
            (Stack(mlp=None, qkv=_QKV), Stack(cross="encoder_attn", mlp=None, qkv=_QKV)),
            None,
            "model.encoder.embed_tokens",
            note="post-LN; fc1/fc2 directly in the layer (no MLP module)",
        ),
    ),
    Family(
        name="vit",
        title="ViT",
        config="ViTConfig",
        model="ViTForImageClassification",
        settings=dict(_VISION, num_labels=3),
        structure=Structure(
            "encoder-only",
            {"vit.layers": Stack(attention="attention", mlp="mlp")},
            "vit.layers",
            "vit.layernorm",
            None,
            None,
            inputs="image",
            hidden={"vit.layers": "hidden_states"},
            attentions={"vit.layers": "attentions"},
            note="classifier head: no unembedding, no logits facet",
        ),
    ),
    Family(
        name="clip",
        title="CLIP",
        config="CLIPConfig",
        model="CLIPModel",
        settings=dict(text_config=_SMALL, vision_config=_VISION, projection_dim=16),
        structure=Structure(
            "multi-tower",
            {
                "text_model.encoder.layers": Stack(qkv=_QKV),
                "vision_model.encoder.layers": Stack(qkv=_QKV),
            },
            None,
            None,
            None,
            "text_model.embeddings.token_embedding",
            inputs="text+image",
            hidden={
                "text_model.encoder.layers": "text_model_output.hidden_states",
                "vision_model.encoder.layers": "vision_model_output.hidden_states",
            },
            attentions={
                "text_model.encoder.layers": "text_model_output.attentions",
                "vision_model.encoder.layers": "vision_model_output.attentions",
            },
            note="two towers, no language-model head: per-layer names resolve `ambiguous`",
        ),
    ),
    Family(
        name="llava",
        title="LLaVA",
        config="LlavaConfig",
        model="LlavaForConditionalGeneration",
        settings=dict(
            vision_config=dict(_VISION, model_type="clip_vision_model"),
            text_config=dict(LLAMA_LIKE, model_type="llama"),
            image_token_index=VOCAB - 1,
            projector_hidden_act="gelu",
        ),
        structure=Structure(
            "decoder-only",
            {
                "model.vision_tower.encoder.layers": Stack(qkv=_QKV),
                "model.language_model.layers": Stack(qkv=_QKV),
            },
            "model.language_model.layers",
            "model.language_model.norm",
            "lm_head",
            "model.language_model.embed_tokens",
            inputs="llava",
            hidden={"model.language_model.layers": "hidden_states"},
            attentions={"model.language_model.layers": "attentions"},
            note="a vision tower feeding a Llama: decoder-only names read the language model",
        ),
    ),
)


#: name -> [`Family`][torchlens.testing.Family]: every model family the repository builds, in
#: the order the pages list them.
FAMILIES: Mapping[str, Family] = check_families(_ROWS)
#: The families the tests that run over every family run: tiny causal language models of token ids.
SUITE: tuple[str, ...] = tuple(name for name, f in FAMILIES.items() if f.suite)

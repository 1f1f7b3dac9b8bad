"""Small seeded models and ground truth from outside TorchLens, for tests (like `torch.testing`).

TorchLens's own tests, its documentation scripts and an engine's CI need the same things: a
tiny Hugging Face model with fixed weights, built from a config in milliseconds without a
download, and a way to read what a module returned that does not go through TorchLens. This
module holds both:

- [`FAMILIES`][torchlens.testing.FAMILIES] is the one registry of the model families the
  repository builds (GPT-2, Llama, GPT-NeoX, Gemma-2, Qwen3, BERT, T5, CLIP, ...: two layers, a
  32-wide residual stream), each a [`Family`][torchlens.testing.Family] row: its config, its
  title, and where the repository uses it (the tests run over [`SUITE`][torchlens.testing.SUITE],
  the model zoo checks each `structure`, the site draws each `diagram` and `op_graph`, the peer
  engines read the `engines` ones). The rows are checked when this module is imported.
- [`build`][torchlens.testing.build]`(family)` builds one: seeded weights, eval mode.
- [`from_config`][torchlens.testing.from_config] does the same for any config and model class.
- [`checkpoint`][torchlens.testing.checkpoint] saves such a model with `save_pretrained`, for
  engines that load a directory (vLLM, SGLang).
- [`token_ids`][torchlens.testing.token_ids] and [`tokenizer`][torchlens.testing.tokenizer]
  give inputs that fit these models' vocabulary.
- [`hooked_outputs`][torchlens.testing.hooked_outputs] records module outputs with plain
  forward hooks: the ground truth a TorchLens trace is checked against.

`transformers` is imported inside the functions that need it; importing this module needs only
torch.

Example:
    >>> import torchlens as tl
    >>> from torchlens import testing
    >>> model = testing.build("llama")
    >>> ids = testing.token_ids(length=5)
    >>> truth = testing.hooked_outputs(model, ["model.layers.0"], ids)
    >>> trace = tl.trace(model, ids)
    >>> import torch
    >>> torch.equal(trace.modules["model.layers.0"].facets["resid_post"], truth["model.layers.0"])
    True
"""

from __future__ import annotations

import copy
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:  # transformers stays an optional import of the library
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

__all__ = [
    "FAMILIES",
    "LLAMA_LIKE",
    "MAX_POSITIONS",
    "SUITE",
    "VOCAB",
    "Family",
    "OpGraph",
    "Stack",
    "Structure",
    "build",
    "checkpoint",
    "from_config",
    "hooked_outputs",
    "inputs",
    "token_ids",
    "tokenizer",
]

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

# -- the rows --------------------------------------------------------------------------------------

#: Attention implementations a family can run with.
IMPLEMENTATIONS = ("eager", "sdpa")
#: Model kinds, as `trace.structure.kind` names them.
KINDS = ("decoder-only", "encoder-only", "encoder-decoder", "multi-tower")
#: What a family's forward takes: token ids; ids and decoder ids; pixels; ids and pixels (two
#: towers); ids with image tokens and pixels (LLaVA).
INPUTS = ("text", "seq2seq", "image", "text+image", "llava")


@dataclass(frozen=True)
class Stack:
    """One stack of repeated layers, as TorchLens must find it (addresses relative to a layer).

    Attributes:
        attention: the self-attention, or None where the layer has none (Mamba).
        cross: the cross-attention (an encoder-decoder's decoder), or None.
        mlp: the MLP, or None where no module holds it (BERT, OPT: the linear layers sit in the
            layer itself).
        qkv: the q, k and v projections under the attention, where each is a module of its own.
        qkv_served: False where TorchLens is known not to find q, k, v (then checked only if served).
        fused: (the fused q/k/v projection under the attention, its layout, its key/value
            groups); the layouts are those of the transformers source: `"queries_then_k_v"`,
            `"grouped"`, `"per_head_qkv"`.
        not_served: of q, k, v: known not to be found (checked if they ever are).
        n: the number of layers.
    """

    attention: str | None = "self_attn"
    cross: str | None = None
    mlp: str | None = "mlp"
    qkv: tuple[str, str, str] | None = None
    qkv_served: bool = True
    fused: tuple[str, str, int] | None = None
    not_served: tuple[str, ...] = ()
    n: int = 2


@dataclass(frozen=True)
class Structure:
    """What TorchLens must find in a family's model, read off the transformers source by hand.

    The model zoo (`tests/fixtures/zoo.py`, `docs/guides/coverage.md`) traces the model and
    compares the trace's structure with this, and the values with plain hooks on these modules
    and with the model's own outputs named here.

    Attributes:
        kind: one of `KINDS`.
        stacks: stack address -> [`Stack`][torchlens.testing.Stack], in the order they run.
        lm_stack: the stack feeding the language-model head, or None.
        final_norm: the norm after the last layer, before the unembedding, or None.
        unembed: the unembedding, or None (a classifier head).
        embed: the token embedding, or None.
        inputs: what the forward takes, one of `INPUTS`.
        hidden: stack -> the attribute of the model's output (dotted) that holds its
            `output_hidden_states`.
        attentions: stack -> the attribute that holds its `output_attentions`.
        cross_attentions: stack -> the attribute that holds its cross-attention weights.
        pad: a decoder-only language model: run on a left-padded batch with an attention mask.
        hidden_is_output: `output_hidden_states[i]` is layer i's output (Mamba), not its input.
        note: one line on what is special about the family, for the coverage page.
    """

    kind: str
    stacks: Mapping[str, Stack]
    lm_stack: str | None
    final_norm: str | None
    unembed: str | None
    embed: str | None
    inputs: str = "text"
    hidden: Mapping[str, str] = field(default_factory=dict)
    attentions: Mapping[str, str] = field(default_factory=dict)
    cross_attentions: Mapping[str, str] = field(default_factory=dict)
    pad: bool = False
    hidden_is_output: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        for name in ("stacks", "hidden", "attentions", "cross_attentions"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))


@dataclass(frozen=True)
class OpGraph:
    """How the op-graph page (`scripts/gen_op_graphs.py`) draws a family in full.

    Attributes:
        what: one line on the model, for the page.
        block: the layer the "block" drawing unrolls.
        settings: config settings of the drawn model that replace the family's.
    """

    what: str
    block: str
    settings: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))


@dataclass(frozen=True)
class Family:
    """One model family [`build`][torchlens.testing.build] can make, and where the repository uses it.

    Attributes:
        name: the key of `FAMILIES` (`"llama"`).
        title: how pages name it (`"Llama"`).
        config: the name of the `transformers` config class (`"LlamaConfig"`).
        model: the name of the `transformers` model class (`"LlamaForCausalLM"`).
        settings: the config's keyword arguments.
        attn_implementations: the attention implementations `transformers` runs this family with.
        why: why the family has only the implementations it has (empty when it has both).
        slug: the name of its files on the site (the block diagram, the op graphs); when not
            given, `name` with `-` for `_`.
        suite: the tests that run over every family run this one (`SUITE`): a causal language
            model of token ids.
        structure: what TorchLens must find in it; the model zoo checks every family that has one.
        diagram: the block-diagram page draws it (`scripts/gen_diagrams.py`).
        op_graph: the op-graph page draws it in full (`scripts/gen_op_graphs.py`); every
            `diagram` family gets its block 0 drawn there too.
        engines: the peer engines read it (`tests/fixtures/engine_runs.py`, the Verified page).
    """

    name: str
    title: str
    config: str
    model: str
    settings: Mapping[str, Any]
    attn_implementations: tuple[str, ...] = IMPLEMENTATIONS
    why: str = ""
    slug: str = ""
    suite: bool = False
    structure: Structure | None = None
    diagram: bool = False
    op_graph: OpGraph | None = None
    engines: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))
        object.__setattr__(self, "slug", self.slug or self.name.replace("_", "-"))

    def make_config(self, **settings: Any) -> Any:
        """The family's `transformers` config, with `settings` replacing or adding to its own."""
        import transformers

        return getattr(transformers, self.config)(**copy.deepcopy({**self.settings, **settings}))

    def model_class(self) -> type:
        """The family's `transformers` model class."""
        import transformers

        return getattr(transformers, self.model)


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


def check_families(rows: Iterable[Family]) -> Mapping[str, Family]:
    """Check the rows against each other and themselves; return them by name.

    Raises:
        ValueError: naming the first row that breaks a rule: a name, title or slug given twice
            or malformed; an attention implementation not in `IMPLEMENTATIONS`, or a family with
            only some and no `why`; a structure whose stacks, inputs or output attributes do not
            fit together; a `suite`, `diagram`, `op_graph` or `engines` family its page or test
            cannot use.
    """
    out: dict[str, Family] = {}
    titles: set[str] = set()
    slugs: set[str] = set()
    for f in rows:
        problems = _row_problems(f)
        for what, value, seen in (
            ("name", f.name, out),
            ("title", f.title, titles),
            ("slug", f.slug, slugs),
        ):
            if value in seen:
                problems.append(f"its {what} {value!r} is another family's")
        if problems:
            raise ValueError(f"test family {f.name!r}: " + "; ".join(problems))
        out[f.name] = f
        titles.add(f.title)
        slugs.add(f.slug)
    return MappingProxyType(out)


def _row_problems(f: Family) -> list[str]:
    problems = []
    if not re.fullmatch(r"[a-z][a-z0-9_]*", f.name) or not re.fullmatch(r"[a-z][a-z0-9-]*", f.slug):
        problems.append("name is lowercase letters, digits and `_`; slug the same with `-`")
    if not f.config.endswith("Config") or not f.title:
        problems.append("config names a transformers config class, and the title is not empty")
    if not f.attn_implementations or set(f.attn_implementations) - set(IMPLEMENTATIONS):
        problems.append(
            f"attn_implementations {f.attn_implementations} are not some of {IMPLEMENTATIONS}"
        )
    if bool(f.why) == (set(f.attn_implementations) == set(IMPLEMENTATIONS)):
        problems.append(
            "why says why the family runs only some attention implementations, and only then"
        )
    s = f.structure
    if s is not None:
        problems += _structure_problems(s)
    language_model = (
        s is not None
        and s.kind == "decoder-only"
        and s.inputs == "text"
        and bool(s.embed and s.unembed)
    )
    if (f.diagram or f.engines) and not language_model:
        problems.append(
            "diagram and engines need a structure: a decoder-only language model of token ids"
        )
    if f.op_graph is not None and (
        s is None
        or s.inputs not in ("text", "seq2seq")
        or not any(f.op_graph.block.startswith(f"{stack}.") for stack in s.stacks)
    ):
        problems.append(
            "op_graph needs a structure of token ids (or seq2seq), and its block in one of the stacks"
        )
    return problems


def _structure_problems(s: Structure) -> list[str]:
    problems = []
    if s.kind not in KINDS or s.inputs not in INPUTS:
        problems.append(
            f"structure kind {s.kind!r} / inputs {s.inputs!r}: kinds are {KINDS}, inputs {INPUTS}"
        )
    if not s.stacks or (s.lm_stack is not None and s.lm_stack not in s.stacks):
        problems.append(f"lm_stack {s.lm_stack!r} is not one of its stacks {list(s.stacks)}")
    for what in ("hidden", "attentions", "cross_attentions"):
        if set(getattr(s, what)) - set(s.stacks):
            problems.append(f"{what} names a stack the structure does not have")
    if {n for n, st in s.stacks.items() if st.cross} != set(s.cross_attentions):
        problems.append("cross_attentions are given for exactly the stacks with a cross-attention")
    if s.pad and (s.kind != "decoder-only" or s.inputs != "text"):
        problems.append("pad is for decoder-only language models of token ids")
    return problems


#: name -> [`Family`][torchlens.testing.Family]: every model family the repository builds, in
#: the order the pages list them.
FAMILIES: Mapping[str, Family] = check_families(_ROWS)
#: The families the tests that run over every family run: tiny causal language models of token ids.
SUITE: tuple[str, ...] = tuple(name for name, f in FAMILIES.items() if f.suite)


def _is_norm(name: str) -> bool:
    """Whether a parameter name says it belongs to a norm (`ln_f`, `input_layernorm`, `LayerNorm`)."""
    return "norm" in name.lower() or ".ln" in name or name.startswith("ln")


def from_config(
    config: PretrainedConfig,
    model_class: type,
    attn_implementation: str = "eager",
    dtype: torch.dtype = torch.float32,
    perturb_norms: bool = True,
) -> torch.nn.Module:
    """Build `model_class(config)` with seeded weights, in eval mode and `dtype`.

    torch is seeded with 0 before the model is made, so two calls with the same config give the
    same weights. Random init leaves the gains of some norms at exactly 1 and their biases at 0,
    which would make a tensor before a norm's gain equal the one after it; with `perturb_norms`
    every parameter of a module whose name says it is a norm gets seeded noise (scale 0.1)
    added, so the two differ.

    Args:
        config: a `transformers` config (its `_attn_implementation`, and that of its
            `text_config` and `vision_config` where it has them, is set to `attn_implementation`).
        model_class: the model class to build from it (`transformers.LlamaForCausalLM`).
        attn_implementation: `"eager"` or `"sdpa"`.
        dtype: the dtype the model is returned in.
        perturb_norms: add seeded noise to the norm parameters (see above).

    Returns:
        The model, in eval mode.

    Raises:
        RuntimeError: `transformers` did not keep `attn_implementation` on the built model.
    """
    torch.manual_seed(0)
    for sub in ("text_config", "vision_config"):  # a multimodal config's towers run it too
        if getattr(config, sub, None) is not None:
            getattr(config, sub)._attn_implementation = attn_implementation
    config._attn_implementation = attn_implementation
    model = model_class(config)
    if perturb_norms:
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if _is_norm(name):
                    p.add_(0.1 * torch.randn(p.shape, generator=gen))
    model = model.to(dtype).eval()
    if model.config._attn_implementation != attn_implementation:
        raise RuntimeError(
            f"{model_class.__name__} was asked for {attn_implementation!r} attention but runs "
            f"{model.config._attn_implementation!r}"
        )
    return model


def build(
    family: str,
    attn_implementation: str = "eager",
    dtype: torch.dtype = torch.float32,
    **settings: Any,
) -> torch.nn.Module:
    """Build a tiny random-init model of one of the [`FAMILIES`][torchlens.testing.FAMILIES].

    The weights are seeded (see [`from_config`][torchlens.testing.from_config]): the same family
    and settings give the same weights in every call and every process.

    Args:
        family: a key of `FAMILIES` (`"gpt2"`, `"llama"`, `"t5"`, ...).
        attn_implementation: one of the family's `attn_implementations`.
        dtype: the dtype the model is returned in.
        **settings: config keyword arguments that replace or add to the family's (a wider model
            for a GPU kernel: `hidden_size=128, head_dim=64`).

    Returns:
        The model, in eval mode.

    Raises:
        KeyError: `family` is not a key of `FAMILIES` (the message lists them).
        ValueError: the family does not run `attn_implementation` (the message says why).

    Examples:
        >>> from torchlens import testing
        >>> model = testing.build("gpt2", "sdpa")
        >>> model.config.n_layer, model.config._attn_implementation
        (2, 'sdpa')
        >>> testing.build("gpt2", hidden_size=64).config.n_embd  # a setting overridden
        64
        >>> testing.build("gemma2", "sdpa")
        Traceback (most recent call last):
        ValueError: gemma2 runs with 'eager' attention, not 'sdpa': transformers runs Gemma-2 with ...
    """
    if family not in FAMILIES:
        raise KeyError(f"no test family {family!r}; the families are {', '.join(FAMILIES)}")
    spec = FAMILIES[family]
    if attn_implementation not in spec.attn_implementations:
        raise ValueError(
            f"{family} runs with {' or '.join(map(repr, spec.attn_implementations))} attention, not "
            f"{attn_implementation!r}: {spec.why}"
        )
    return from_config(spec.make_config(**settings), spec.model_class(), attn_implementation, dtype)


def checkpoint(
    family: str,
    directory: str | Path | None = None,
    *,
    tokenizer_too: bool = False,
    **settings: Any,
) -> tuple[torch.nn.Module, Path]:
    """Build a family's model (float32, eager) and `save_pretrained` it into a directory.

    For engines that load a checkpoint from disk: the model returned holds the weights the
    directory holds, so a trace of it is the ground truth for what the engine loads. The saved
    config does not record the attention implementation: `from_pretrained` picks its default
    (sdpa) unless given `attn_implementation="eager"`. Loaded eager, the model computes what the
    returned one does bit for bit; loaded with sdpa, to rounding.

    Args:
        family: a key of `FAMILIES`.
        directory: where to save; a fresh temporary directory when None (not deleted).
        tokenizer_too: also save [`tokenizer`][torchlens.testing.tokenizer]`()` there (the
            model's vocabulary must then be at least 64 tokens).
        **settings: config keyword arguments, as for [`build`][torchlens.testing.build].

    Returns:
        The model and the directory.

    Examples:
        >>> import tempfile, torch, transformers
        >>> from torchlens import testing
        >>> ids = testing.token_ids()
        >>> with tempfile.TemporaryDirectory() as directory:
        ...     model, path = testing.checkpoint("llama", directory)
        ...     loaded = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        >>> torch.equal(loaded(ids).logits, model(ids).logits)
        True
    """
    model = build(family, **settings)
    path = (
        Path(directory)
        if directory is not None
        else Path(tempfile.mkdtemp(prefix=f"torchlens-{family}-"))
    )
    cast(Any, model).save_pretrained(path)  # every family builds a transformers PreTrainedModel
    if tokenizer_too:
        tokenizer().save_pretrained(path)
    return model, path


def token_ids(batch: int = 1, length: int = 7, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    """Seeded random token ids, shape `[batch, length]`, drawn from `range(vocab)`.

    Examples:
        >>> from torchlens import testing
        >>> testing.token_ids(2, 3).shape
        torch.Size([2, 3])
        >>> bool((testing.token_ids(seed=4) == testing.token_ids(seed=4)).all())
        True
    """
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen)


def inputs(family: str, batch: int = 1, length: int = 5, seed: int = 0) -> tuple[tuple, dict]:
    """Seeded `(args, kwargs)` for the forward of [`build(family)`][torchlens.testing.build].

    What the forward takes is the family's `Structure.inputs`: token ids (`"text"`, and any
    family without a structure); ids and `length - 1` decoder ids (`"seq2seq"`); a 16x16 image
    (`"image"`); ids and an image (`"text+image"`); ids whose positions 1 to 4 are image tokens,
    one per 8x8 patch, and an image (`"llava"`, so `length` must be at least 5).

    Args:
        family: a key of `FAMILIES`.
        batch: the batch size.
        length: the number of token ids.
        seed: the seed of the ids and the pixels.

    Returns:
        The positional and keyword arguments: `model(*args, **kwargs)`.

    Raises:
        KeyError: `family` is not a key of `FAMILIES` (the message lists them).
        ValueError: `length` is too short for the family's inputs.

    Examples:
        >>> from torchlens import testing
        >>> args, kwargs = testing.inputs("t5", length=4)
        >>> args[0].shape, kwargs["decoder_input_ids"].shape
        (torch.Size([1, 4]), torch.Size([1, 3]))
        >>> testing.inputs("vit")[0][0].shape
        torch.Size([1, 3, 16, 16])
    """
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; families: {', '.join(FAMILIES)}")
    structure = FAMILIES[family].structure
    kind = structure.inputs if structure is not None else "text"
    ids = token_ids(batch, length, seed)
    pixels = torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
    if kind == "image":
        return (pixels,), {}
    if kind == "text+image":
        return (), {"input_ids": ids, "pixel_values": pixels}
    if kind == "llava":
        if length < 5:
            raise ValueError(f"{family} takes 4 image tokens after the first; length must be >= 5")
        ids = ids.masked_fill(ids == VOCAB - 1, 0)
        ids[:, 1:5] = FAMILIES[family].settings["image_token_index"]
        return (), {"input_ids": ids, "pixel_values": pixels}
    if kind == "seq2seq":
        if length < 2:
            raise ValueError(f"{family} takes decoder ids of length - 1; length must be >= 2")
        return (ids,), {"decoder_input_ids": ids[:, : length - 1]}
    return (ids,), {}


def tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """A word-level fast tokenizer made in memory: nothing is downloaded.

    Ids 0-3 are `<unk>`, `<bos>`, `<eos>` and `<pad>`; the words `t4` ... `t{vocab-1}` are ids 4 to
    `vocab - 1`, split on whitespace. Engines that insist on a tokenizer (nnterp) accept it.

    Returns:
        The tokenizer, a `transformers.PreTrainedTokenizerFast`.

    Examples:
        >>> from torchlens import testing
        >>> testing.tokenizer()("t5 t9 t63")["input_ids"]
        [5, 9, 63]
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {
        "<unk>": 0,
        "<bos>": 1,
        "<eos>": 2,
        "<pad>": 3,
        **{f"t{i}": i for i in range(4, vocab)},
    }
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
    )


def hooked_outputs(
    model: torch.nn.Module, addresses: Iterable[str], *args: Any, **kwargs: Any
) -> dict[str, torch.Tensor]:
    """Run `model(*args, **kwargs)` once under `no_grad` and return what plain forward hooks saw.

    This is ground truth from outside TorchLens: one `register_forward_hook` per address, each
    cloning the module's output (the first element when the module returns a tuple) as it was
    returned. The hooks are removed before this returns, also when the forward raises.

    Args:
        model: the model.
        addresses: module addresses as `model.named_modules()` spells them.
        *args: the forward's positional arguments.
        **kwargs: the forward's keyword arguments.

    Returns:
        address -> the output tensor, for each address whose module ran (a module that ran more
        than once keeps its last output).

    Raises:
        KeyError: an address is not a module of `model`.

    Examples:
        >>> from torchlens import testing
        >>> model = testing.build("gpt2")
        >>> out = testing.hooked_outputs(model, ["transformer.h.1", "lm_head"], testing.token_ids(length=3))
        >>> {a: tuple(t.shape) for a, t in out.items()}
        {'transformer.h.1': (1, 3, 32), 'lm_head': (1, 3, 64)}
        >>> testing.hooked_outputs(model, ["transformer.h.7"], testing.token_ids())
        Traceback (most recent call last):
        KeyError: "not modules of GPT2LMHeadModel: ['transformer.h.7']"
    """
    seen: dict[str, torch.Tensor] = {}
    mods = dict(model.named_modules())
    wanted = list(addresses)
    missing = [a for a in wanted if a not in mods]
    if missing:
        raise KeyError(f"not modules of {type(model).__name__}: {missing}")
    handles = []
    try:
        for a in wanted:

            def hook(module, hook_args, out, a=a):
                seen[a] = (out[0] if isinstance(out, tuple) else out).detach().clone()

            handles.append(mods[a].register_forward_hook(hook))
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen

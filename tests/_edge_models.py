"""Tiny seeded models of the layer designs issue 22 found at the edges, and ground-truth helpers.

Every model here is built from a small config (2 layers, width 32, vocabulary 64) with
`torchlens.testing.from_config` (seed 0, norm parameters perturbed), so two builds have the same
weights. None of these architectures is in `torchlens.testing.FAMILIES` or the model zoo; the
tests that use them say which defect each one shows.

`CUSTOM` holds small `nn.Module` language models written here, each with a block whose MLP has a
module beside it (a low-rank side branch, a bottleneck adapter beside the attention, a
token-mixing conv branch): the layer designs a role rule must not take for an MLP.

Ground truth comes from plain forward hooks (`torchlens.testing.hooked_outputs` and
`hooked_inputs` below), never from TorchLens.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

from torchlens import testing

V = 64
_LL = dict(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    vocab_size=V,
    max_position_embeddings=32,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)
_SEQ2SEQ = dict(
    encoder_layers=2,
    decoder_layers=2,
    d_model=32,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=48,
    decoder_ffn_dim=48,
    vocab_size=V,
    max_position_embeddings=32,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    decoder_start_token_id=2,
)
_MAMBA = dict(
    mamba_n_heads=4,
    mamba_d_head=8,
    mamba_n_groups=1,
    mamba_d_state=4,
    mamba_d_conv=2,
    mamba_expand=1,
    mamba_chunk_size=4,
)

#: name -> (config factory, model class). Configs for the transformers these tests pin (5.x).
CONFIGS: dict[str, tuple[Callable[[], Any], Callable[[], type]]] = {
    # a low-rank side block (LAuReL) beside the attention, AltUp, per-layer inputs
    "gemma3n": (
        lambda: tf.Gemma3nTextConfig(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=V,
            vocab_size_per_layer_input=V,
            hidden_size_per_layer_input=8,
            laurel_rank=4,
            altup_num_inputs=2,
            num_kv_shared_layers=0,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=4,
            max_position_embeddings=32,
            activation_sparsity_pattern=[0.0, 0.0],
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
        ),
        lambda: tf.Gemma3nForCausalLM,
    ),
    # a Mamba-2 mixer in parallel with the attention, then the MLP (feed_forward)
    "falcon_h1": (
        lambda: tf.FalconH1Config(**_LL, head_dim=8, mamba_d_ssm=32, **_MAMBA),
        lambda: tf.FalconH1ForCausalLM,
    ),
    # a dense MLP with an expert block beside it, their normed sum added to the residual
    "gemma4": (
        lambda: tf.Gemma4TextConfig(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            global_head_dim=8,
            vocab_size=V,
            vocab_size_per_layer_input=V,
            hidden_size_per_layer_input=8,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=4,
            max_position_embeddings=32,
            enable_moe_block=True,
            num_experts=2,
            top_k_experts=1,
            moe_intermediate_size=16,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
        ),
        lambda: tf.Gemma4ForCausalLM,
    ),
    # an MoE block with a dense shared MLP beside it, their sum added to the residual
    "granitemoeshared": (
        lambda: tf.GraniteMoeSharedConfig(
            **_LL, num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=24
        ),
        lambda: tf.GraniteMoeSharedForCausalLM,
    ),
    # the attention adds the residual inside its own module (BLOOM's dropout_add)
    "bloom": (
        lambda: tf.BloomConfig(
            n_layer=2, hidden_size=32, n_head=4, vocab_size=V, bos_token_id=0, eos_token_id=0
        ),
        lambda: tf.BloomForCausalLM,
    ),
    # sublayer outputs scaled before the residual add
    "granite": (
        lambda: tf.GraniteConfig(**_LL, residual_multiplier=0.22),
        lambda: tf.GraniteForCausalLM,
    ),
    "minicpm3": (
        lambda: tf.MiniCPM3Config(
            **{**_LL, "num_key_value_heads": 4},
            q_lora_rank=16,
            kv_lora_rank=8,
            qk_nope_head_dim=4,
            qk_rope_head_dim=4,
            v_head_dim=8,
            scale_depth=1.4,
        ),
        lambda: tf.MiniCPM3ForCausalLM,
    ),
    # further architectures of the same kind (issue 22, item 4): Granite with sliding-window
    # attention, and HyperCLOVAX, which scales its sandwich norms' outputs before the add
    "graniteswa": (
        lambda: tf.GraniteSWAConfig(**_LL, residual_multiplier=0.3, sliding_window=4),
        lambda: tf.GraniteSWAForCausalLM,
    ),
    "hyperclovax": (
        lambda: tf.HyperCLOVAXConfig(**_LL, residual_multiplier=0.4, head_dim=8),
        lambda: tf.HyperCLOVAXForCausalLM,
    ),
    # an MoE feed_forward whose output is reshaped before the add
    "llama4": (
        lambda: tf.Llama4TextConfig(
            **_LL,
            head_dim=8,
            intermediate_size_mlp=48,
            num_local_experts=2,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            attention_chunk_size=16,
            no_rope_layers=[1, 1],
        ),
        lambda: tf.Llama4ForCausalLM,
    ),
    # encoder-decoders whose decoder blocks hold self-attention, cross-attention, fc1/fc2
    "mbart": (lambda: tf.MBartConfig(**_SEQ2SEQ), lambda: tf.MBartForConditionalGeneration),
    "pegasus": (lambda: tf.PegasusConfig(**_SEQ2SEQ), lambda: tf.PegasusForConditionalGeneration),
    "m2m100": (lambda: tf.M2M100Config(**_SEQ2SEQ), lambda: tf.M2M100ForConditionalGeneration),
    "blenderbot": (
        lambda: tf.BlenderbotConfig(**_SEQ2SEQ),
        lambda: tf.BlenderbotForConditionalGeneration,
    ),
    "plbart": (lambda: tf.PLBartConfig(**_SEQ2SEQ), lambda: tf.PLBartForConditionalGeneration),
    "biogpt": (
        lambda: tf.BioGptConfig(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            intermediate_size=48,
            vocab_size=V,
            max_position_embeddings=32,
            pad_token_id=1,
        ),
        lambda: tf.BioGptForCausalLM,
    ),
    # attention whose q/k/v are not computed by three projections
    "deepseek_v3": (
        lambda: tf.DeepseekV3Config(
            **{**_LL, "num_key_value_heads": 4},
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=8,
            q_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            n_shared_experts=1,
        ),
        lambda: tf.DeepseekV3ForCausalLM,
    ),
    "gpt_bigcode": (
        lambda: tf.GPTBigCodeConfig(
            n_layer=2,
            n_embd=32,
            n_head=4,
            vocab_size=V,
            n_positions=32,
            multi_query=True,
            bos_token_id=0,
            eos_token_id=0,
        ),
        lambda: tf.GPTBigCodeForCausalLM,
    ),
    "modernbert": (
        lambda: tf.ModernBertConfig(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            intermediate_size=48,
            vocab_size=V,
            max_position_embeddings=32,
            global_attn_every_n_layers=1,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
            cls_token_id=0,
            sep_token_id=0,
        ),
        lambda: tf.ModernBertForMaskedLM,
    ),
    "deberta_v2": (
        lambda: tf.DebertaV2Config(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            intermediate_size=48,
            vocab_size=V,
            max_position_embeddings=32,
            pad_token_id=0,
        ),
        lambda: tf.DebertaV2ForMaskedLM,
    ),
    # hybrid stacks: layers of different mixers (attention, SSM, conv, linear attention)
    "jamba": (
        lambda: tf.JambaConfig(
            **_LL,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            num_experts_per_tok=1,
            mamba_d_state=4,
            mamba_d_conv=2,
            mamba_expand=1,
            mamba_dt_rank=4,
        ),
        lambda: tf.JambaForCausalLM,
    ),
    # five layers, two classes (three Mamba layers, two hybrid layers sharing one attention block)
    "zamba": (
        lambda: tf.ZambaConfig(
            num_hidden_layers=5,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,
            attention_hidden_size=64,
            attention_head_dim=16,
            intermediate_size=48,
            vocab_size=V,
            max_position_embeddings=32,
            mamba_d_state=4,
            mamba_d_conv=2,
            mamba_expand=2,
            mamba_dt_rank=4,
            n_mamba_heads=1,
            attn_layer_period=2,
            attn_layer_offset=0,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
        ),
        lambda: tf.ZambaForCausalLM,
    ),
    "qwen3_next": (
        lambda: tf.Qwen3NextConfig(
            **_LL,
            head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=2,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            decoder_sparse_step=1,
            mlp_only_layers=[0, 1],
        ),
        lambda: tf.Qwen3NextForCausalLM,
    ),
    "bamba": (
        lambda: tf.BambaConfig(**_LL, attn_layer_indices=[1], **_MAMBA),
        lambda: tf.BambaForCausalLM,
    ),
    # two layer classes in one ModuleList: a gated-delta-net layer and an attention layer
    "olmo_hybrid": (
        lambda: tf.OlmoHybridConfig(
            **_LL,
            layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=2,
        ),
        lambda: tf.OlmoHybridForCausalLM,
    ),
    # one layer class whose token mixer is a recurrent block (conv + RG-LRU) or attention
    "recurrent_gemma": (
        lambda: tf.RecurrentGemmaConfig(
            num_hidden_layers=2,
            vocab_size=V,
            hidden_size=32,
            intermediate_size=48,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            lru_width=32,
            attention_window_size=8,
            conv1d_width=2,
            block_types=["recurrent", "attention"],
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
        ),
        lambda: tf.RecurrentGemmaForCausalLM,
    ),
    # one layer class whose mixer is a Mamba-2 layer or attention, then a dense MLP (no experts)
    "granitemoehybrid": (
        lambda: tf.GraniteMoeHybridConfig(
            **_LL,
            layer_types=["mamba", "attention"],
            num_local_experts=0,
            shared_intermediate_size=48,
            position_embedding_type="rope",
            **_MAMBA,
        ),
        lambda: tf.GraniteMoeHybridForCausalLM,
    ),
    "lfm2": (
        lambda: tf.Lfm2Config(
            **_LL,
            layer_types=["conv", "full_attention"],
            conv_L_cache=2,
            block_ff_dim=48,
            block_auto_adjust_ff_dim=False,
        ),
        lambda: tf.Lfm2ForCausalLM,
    ),
    # no language-model stack
    "swin": (
        lambda: tf.SwinConfig(
            image_size=16,
            patch_size=4,
            num_channels=3,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[2, 2],
            window_size=2,
        ),
        lambda: tf.SwinModel,
    ),
    "swinv2": (
        lambda: tf.Swinv2Config(
            image_size=16,
            patch_size=4,
            num_channels=3,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[2, 2],
            window_size=2,
        ),
        lambda: tf.Swinv2Model,
    ),
    "clip": (
        lambda: tf.CLIPConfig(
            text_config=dict(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                intermediate_size=48,
                vocab_size=V,
                max_position_embeddings=32,
                bos_token_id=0,
                eos_token_id=2,
                pad_token_id=1,
            ),
            vision_config=dict(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                intermediate_size=48,
                image_size=16,
                patch_size=8,
            ),
            projection_dim=16,
        ),
        lambda: tf.CLIPModel,
    ),
    "siglip": (
        lambda: tf.SiglipConfig(
            text_config=dict(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                intermediate_size=48,
                vocab_size=V,
                max_position_embeddings=32,
                bos_token_id=0,
                eos_token_id=2,
                pad_token_id=1,
            ),
            vision_config=dict(
                num_hidden_layers=2,
                hidden_size=32,
                num_attention_heads=4,
                intermediate_size=48,
                image_size=16,
                patch_size=8,
            ),
        ),
        lambda: tf.SiglipModel,
    ),
    # Llama-like decoders for the diagnosis tests
    "qwen3": (lambda: tf.Qwen3Config(**_LL, head_dim=8), lambda: tf.Qwen3ForCausalLM),
    "phi3": (lambda: tf.Phi3Config(**_LL), lambda: tf.Phi3ForCausalLM),
    "mistral": (
        lambda: tf.MistralConfig(**_LL, sliding_window=None),
        lambda: tf.MistralForCausalLM,
    ),
    "exaone4": (
        lambda: tf.Exaone4Config(
            **_LL, head_dim=8, sliding_window=None, layer_types=["full_attention"] * 2
        ),
        lambda: tf.Exaone4ForCausalLM,
    ),
    # further architectures of the kinds above, each used by one more parametrized case
    "marian": (
        lambda: tf.MarianConfig(**_SEQ2SEQ),
        lambda: tf.MarianMTModel,
    ),  # decoder: self + cross attention
    "granitemoe": (
        lambda: tf.GraniteMoeConfig(
            **_LL,
            residual_multiplier=0.3,
            num_local_experts=2,
            num_experts_per_tok=1,
            experts_implementation="eager",
        ),
        lambda: tf.GraniteMoeForCausalLM,
    ),  # eager experts: grouped_mm has no float64
    "helium": (
        lambda: tf.HeliumConfig(**_LL, head_dim=8),
        lambda: tf.HeliumForCausalLM,
    ),  # diagnosis: GQA + RoPE
    "deepseek_v2": (
        lambda: tf.DeepseekV2Config(  # multi-head latent attention, as DeepSeek-V3's
            **{**_LL, "num_key_value_heads": 4},
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=8,
            q_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            n_shared_experts=1,
        ),
        lambda: tf.DeepseekV2ForCausalLM,
    ),
    "mvp": (
        lambda: tf.MvpConfig(**_SEQ2SEQ),
        lambda: tf.MvpForConditionalGeneration,
    ),  # positions: arange + 2
    "olmo3": (
        lambda: tf.Olmo3Config(
            **_LL, layer_types=["full_attention"] * 2
        ),  # its RMSNorm casts to float32
        lambda: tf.Olmo3ForCausalLM,
    ),
}

_SEQ2SEQ_NAMES = ("mbart", "pegasus", "m2m100", "blenderbot", "plbart", "marian", "mvp")


@functools.cache
def build(name: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model `name` (a key of `CONFIGS` or `CUSTOM`), seeded, eager attention, in `dtype`.
    Cached: a test must not modify it."""
    if name in CUSTOM:
        return _custom(CUSTOM[name], dtype)
    config, model_class = CONFIGS[name]
    return testing.from_config(config(), model_class(), "eager", dtype)


def inputs(name: str, dtype: torch.dtype = torch.float32) -> tuple[tuple, dict]:
    """(args, kwargs) of one forward of model `name`: 5 token ids (and 4 decoder ids), or an image."""
    ids = testing.token_ids(length=5)
    if name in _SEQ2SEQ_NAMES:
        return (), dict(input_ids=ids, decoder_input_ids=testing.token_ids(length=4, seed=1))
    gen = torch.Generator().manual_seed(3)
    if name in ("swin", "swinv2"):
        return (torch.randn(1, 3, 16, 16, generator=gen).to(dtype),), {}
    if name in ("clip", "siglip"):
        return (), dict(
            input_ids=ids, pixel_values=torch.randn(1, 3, 16, 16, generator=gen).to(dtype)
        )
    return (ids,), {}


def hooked_inputs(
    model: nn.Module, addresses: Iterable[str], *args: Any, **kwargs: Any
) -> dict[str, torch.Tensor]:
    """Run the model once under `no_grad`; return each module's first input (its first positional
    argument, else its `hidden_states` keyword), as plain forward pre-hooks saw it (last call)."""
    seen: dict[str, torch.Tensor] = {}
    mods = dict(model.named_modules())
    handles = []
    try:
        for a in addresses:

            def hook(module, hook_args, hook_kwargs, a=a):
                x = (
                    hook_args[0]
                    if hook_args
                    else hook_kwargs.get("hidden_states", next(iter(hook_kwargs.values())))
                )
                seen[a] = x.detach().clone()

            handles.append(mods[a].register_forward_pre_hook(hook, with_kwargs=True))
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen


# -- custom layer designs: a module beside the MLP -----------------------------------------------

D, HEADS, FF = 32, 4, 64


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(D, D, bias=False) for _ in range(4)
        )

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, HEADS, D // HEADS).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D // HEADS)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        z = scores.softmax(-1) @ v
        return self.o_proj(z.transpose(1, 2).reshape(b, t, D))


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


class _LowRank(nn.Module):
    """A LAuReL-like side block: down to rank 4 and back up, no activation."""

    def __init__(self):
        super().__init__()
        self.down, self.up = nn.Linear(D, 4, bias=False), nn.Linear(4, D, bias=False)

    def forward(self, x):
        return self.up(self.down(x))


class _Adapter(nn.Module):
    """A bottleneck adapter: down, SiLU, up (an MLP's shape, but a side branch)."""

    def __init__(self):
        super().__init__()
        self.down, self.up = nn.Linear(D, 8), nn.Linear(8, D)

    def forward(self, x):
        return self.up(F.silu(self.down(x)))


class _ConvMixer(nn.Module):
    """A token mixer: projection, causal depthwise conv over positions, SiLU, projection."""

    def __init__(self):
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(D, D), nn.Linear(D, D)
        self.conv = nn.Conv1d(D, D, 3, groups=D, padding=2)

    def forward(self, x):
        h = self.conv(self.in_proj(x).transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return self.out_proj(F.silu(h))


class SideBeforeMLP(nn.Module):
    """x += attn(ln1(x)); h = ln2(x); x += side(h) + mlp(h), the low-rank side block run first."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn, self.side, self.mlp = _Attention(), _LowRank(), _MLP()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        s = self.side(h)
        return x + s + self.mlp(h)


class AdapterBesideAttention(nn.Module):
    """An adapter with an activation reads the attention's input and runs first, in parallel with
    the attention (as Gemma-3n's LAuReL does); the MLP reads the residual after both."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.side, self.attn, self.mlp = _Adapter(), _Attention(), _MLP()

    def forward(self, x):
        h = self.ln1(x)
        s = self.side(h)
        x = x + self.attn(h) + s
        return x + self.mlp(self.ln2(x))


class MixerBesideMLP(nn.Module):
    """After the attention, a token-mixing conv branch runs beside the MLP on the same normed input."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn, self.side, self.mlp = _Attention(), _ConvMixer(), _MLP()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        s = self.side(h)
        return x + s + self.mlp(h)


class TinyLM(nn.Module):
    """Token embedding, two blocks of one design, a final norm, an untied head."""

    def __init__(self, block: type[nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)
        self.layers = nn.ModuleList([block() for _ in range(2)])
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


#: name -> block class of a custom design (every one has its side module at `layers.N.side`).
CUSTOM: dict[str, type[nn.Module]] = {
    "side_before_mlp": SideBeforeMLP,
    "adapter_beside_attention": AdapterBesideAttention,
    "mixer_beside_mlp": MixerBesideMLP,
}


class OneBlockLM(nn.Module):
    """Token embedding, one `SideBeforeMLP` block held as a plain attribute, a final norm, a head:
    nothing repeats, so the trace has no stack of layers."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, D)
        self.block = SideBeforeMLP()
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        return self.lm_head(self.norm(self.block(self.embed_tokens(ids))))


def one_block_lm(dtype: torch.dtype = torch.float32) -> nn.Module:
    """An `OneBlockLM`, seeded like the custom designs."""
    return _custom(OneBlockLM, dtype)


def _custom(block: type[nn.Module], dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = block() if block is OneBlockLM else TinyLM(block)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.to(dtype).eval()

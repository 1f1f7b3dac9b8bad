"""Tiny random-init Hugging Face decoders for the capture tests.

Every factory seeds torch with 0, builds the model from a small config (no downloads), puts it
in eval mode, and returns it in the requested dtype with the requested attention
implementation. The configs are small enough that a forward of a few tokens takes
milliseconds on a CPU.
"""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 64
MAX_POS = 16

# Common shape of the Llama-like configs: 2 layers, d_model 32, 4 query heads over 2 kv heads
# (GQA), d_head 8, d_mlp 48.
_LLAMA_LIKE = dict(
    num_hidden_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    vocab_size=VOCAB,
    max_position_embeddings=MAX_POS,
)


def _build(config_cls, model_cls, attn_implementation: str, dtype: torch.dtype, **config) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = config_cls(**config)
    cfg._attn_implementation = attn_implementation
    model = model_cls(cfg)
    # Random init of some families leaves norm gains at exactly 1 and biases at 0, which would
    # hide a swapped pre/post-gain facet; perturb every norm weight/bias (seeded).
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln" in name or name.startswith("ln") or "layernorm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    model = model.to(dtype).eval()
    assert model.config._attn_implementation == attn_implementation
    return model


def gpt2(attn_implementation: str = "eager", dtype: torch.dtype = torch.float32):
    return _build(
        tf.GPT2Config, tf.GPT2LMHeadModel, attn_implementation, dtype,
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=MAX_POS,
        bos_token_id=0, eos_token_id=0,
    )


def gpt2_upcast(attn_implementation: str = "eager", dtype: torch.dtype = torch.float32):
    """GPT-2 with `reorder_and_upcast_attn`: eager scores come from a float32 `baddbmm`."""
    if attn_implementation != "eager":
        raise ValueError("reorder_and_upcast_attn only changes the eager attention")
    return _build(
        tf.GPT2Config, tf.GPT2LMHeadModel, attn_implementation, dtype,
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=MAX_POS,
        bos_token_id=0, eos_token_id=0, reorder_and_upcast_attn=True,
    )


def llama(attn_implementation: str = "eager", dtype: torch.dtype = torch.float32):
    return _build(tf.LlamaConfig, tf.LlamaForCausalLM, attn_implementation, dtype, **_LLAMA_LIKE)


def gpt_neox(attn_implementation: str = "eager", dtype: torch.dtype = torch.float32):
    return _build(
        tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, attn_implementation, dtype,
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=48,
        vocab_size=VOCAB, max_position_embeddings=MAX_POS, rotary_pct=0.5,
        use_parallel_residual=True, bos_token_id=0, eos_token_id=0,
    )


def gpt_neox_sequential(attn_implementation: str = "eager", dtype: torch.dtype = torch.float32):
    """GPT-NeoX with `use_parallel_residual=False`: attention then MLP, like GPT-2."""
    return _build(
        tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, attn_implementation, dtype,
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=48,
        vocab_size=VOCAB, max_position_embeddings=MAX_POS, rotary_pct=0.5,
        use_parallel_residual=False, bos_token_id=0, eos_token_id=0,
    )


def gemma2(attn_implementation: str = "eager", dtype: torch.dtype = torch.float32):
    if attn_implementation != "eager":
        raise ValueError("transformers runs Gemma-2 with eager attention only (softcapping)")
    return _build(
        tf.Gemma2Config, tf.Gemma2ForCausalLM, attn_implementation, dtype,
        head_dim=8, sliding_window=4, pad_token_id=0, bos_token_id=0, eos_token_id=0, **_LLAMA_LIKE,
    )


def qwen3(attn_implementation: str = "eager", dtype: torch.dtype = torch.float32):
    return _build(
        tf.Qwen3Config, tf.Qwen3ForCausalLM, attn_implementation, dtype,
        head_dim=8, bos_token_id=0, eos_token_id=0, **_LLAMA_LIKE,
    )


def phi3(attn_implementation: str = "eager", dtype: torch.dtype = torch.float32):
    return _build(
        tf.Phi3Config, tf.Phi3ForCausalLM, attn_implementation, dtype,
        pad_token_id=0, bos_token_id=0, eos_token_id=0, **_LLAMA_LIKE,
    )


def olmo2(attn_implementation: str = "eager", dtype: torch.dtype = torch.float32):
    return _build(
        tf.Olmo2Config, tf.Olmo2ForCausalLM, attn_implementation, dtype,
        pad_token_id=0, bos_token_id=0, eos_token_id=0, **_LLAMA_LIKE,
    )


def mistral(attn_implementation: str = "eager", dtype: torch.dtype = torch.float32):
    return _build(
        tf.MistralConfig, tf.MistralForCausalLM, attn_implementation, dtype,
        sliding_window=None, bos_token_id=0, eos_token_id=0, **_LLAMA_LIKE,
    )


#: name -> (factory, attention implementations transformers supports for it)
FAMILIES = {
    "gpt2": (gpt2, ("eager", "sdpa")),
    "gpt2_upcast": (gpt2_upcast, ("eager",)),
    "llama": (llama, ("eager", "sdpa")),
    "gpt_neox": (gpt_neox, ("eager", "sdpa")),
    "gpt_neox_sequential": (gpt_neox_sequential, ("eager", "sdpa")),
    "gemma2": (gemma2, ("eager",)),
    "qwen3": (qwen3, ("eager", "sdpa")),
    "phi3": (phi3, ("eager", "sdpa")),
    "olmo2": (olmo2, ("eager", "sdpa")),
    "mistral": (mistral, ("eager", "sdpa")),
}


def build(family: str, attn_implementation: str = "eager", dtype: torch.dtype = torch.float32):
    """Build family `family` (a key of `FAMILIES`)."""
    return FAMILIES[family][0](attn_implementation, dtype)


def token_ids(batch: int = 1, length: int = 7, seed: int = 0) -> torch.Tensor:
    """Seeded random token ids `[batch, length]`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=gen)


def hooked_outputs(model: torch.nn.Module, addresses, *args, **kwargs) -> dict[str, torch.Tensor]:
    """Ground truth from outside TorchLens: each module's output (its first tensor, cloned) as a
    plain forward hook sees it during `model(*args, **kwargs)` under `no_grad`. The hooks are
    removed before returning, even if the forward raises."""
    seen, handles = {}, []
    mods = dict(model.named_modules())
    for a in addresses:
        def hook(m, hook_args, out, a=a):
            seen[a] = (out[0] if isinstance(out, tuple) else out).detach().clone()
        handles.append(mods[a].register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen

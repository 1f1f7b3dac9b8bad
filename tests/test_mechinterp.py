"""Tests of the alias layer, `torchlens.mechinterp`: report counts, statuses, ground truth, errors.

The ground-truth tests do not trust the library's targets or facets: each name's meaning is
written down here (`MEANING`), and each meaning is read from the Hugging Face model with plain
PyTorch forward hooks on module paths written down per family (`TRUTH`). Every row that a
trace says it can read is compared, and the test asserts that nothing readable was skipped.

Models are random-init from small configs (seeded), traced on the CPU; everything is cached
per module so the file runs in a few seconds.

Tests internals: `torchlens._naming.resolver.n_layers` (from `_naming.layer_index`), which a
planted resolver bug (one layer too few) replaces to show that the report-count test can fail.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections import defaultdict

import pytest
import torch
import transformers
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from torch import nn

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import TorchLensError, testing
from torchlens._naming import resolver
from torchlens.mechinterp import (
    AliasError,
    AliasResolution,
    LayerOutOfRange,
    MalformedAlias,
    UnknownAlias,
    UnknownGeneration,
)

IDS = torch.tensor([[1, 2, 3, 4]])
LIVE = ("real", "reconstructed_read_only")
HAS_SITE = ("real", "reconstructed_read_only", "needs_capture")

# -- models ------------------------------------------------------------------------------------


def _perturb_norms(model: nn.Module) -> None:
    """Random init leaves norm gains at 1 and biases at 0, which would hide a pre/post-gain mix-up."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(s in name for s in ("ln_", "norm", "layernorm")):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def build(family: str, n_layers: int = 2, attn: str = "sdpa", perturb: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=n_layers,
            n_embd=32,
            n_head=2,
            vocab_size=64,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
        )
        cls = transformers.GPT2LMHeadModel
    elif family in ("llama", "gemma2"):
        common = dict(
            num_hidden_layers=n_layers,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=48,
            vocab_size=64,
            max_position_embeddings=16,
        )
        if family == "llama":
            cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
        else:
            # Small softcaps, so that capped and uncapped logits/scores differ beyond tolerance.
            cfg = transformers.Gemma2Config(
                head_dim=8,
                sliding_window=4,
                pad_token_id=0,
                bos_token_id=0,
                eos_token_id=0,
                final_logit_softcapping=0.5,
                attn_logit_softcapping=0.5,
                **common,
            )
            cls = transformers.Gemma2ForCausalLM
    elif family == "neox":
        cfg = transformers.GPTNeoXConfig(
            num_hidden_layers=n_layers,
            hidden_size=32,
            num_attention_heads=4,
            intermediate_size=48,
            vocab_size=64,
            max_position_embeddings=16,
            rotary_pct=0.5,
            use_parallel_residual=True,
            bos_token_id=0,
            eos_token_id=0,
        )
        cls = transformers.GPTNeoXForCausalLM
    else:
        raise ValueError(family)
    cfg._attn_implementation = attn
    model = cls(cfg)
    if perturb:
        _perturb_norms(model)
    model.eval()
    assert model.config._attn_implementation == attn
    return model


@functools.cache
def traced(family: str, n_layers: int = 2, attn: str = "sdpa", perturb: bool = False, save="all"):
    """(model, trace), cached: tests must not modify either."""
    model = build(family, n_layers, attn, perturb)
    save_arg = list(save) if isinstance(save, tuple) else save
    return model, tl.trace(model, IDS, save=save_arg)


# -- report counts -----------------------------------------------------------------------------


#: The report's length on a single-stack decoder with L layers, `a * L + b`, counted by hand from
#: the table sources (each name with `{L}` counts once per layer, each other name once), not with
#: the resolver's logic or the tables' flags:
#: - 2.x: 39 `blocks.{L}.` names (4 of them QK-norm hooks without a site); hook_tokens,
#:   hook_embed, hook_pos_embed, ln_final.hook_scale and
#:   ln_final.hook_normalized;
#: - 3.x: the 4.x names (43 + 14), 16 per-layer 2.x aliases, and hook_pos_embed, hook_embed, hook_unembed;
#: - 4.x: 43 `blocks.{L}.` names; embed.*, pos_embed.*, rotary_emb.* (4), ln_final.* (4), unembed.* (2);
#: - nnterp: 7 per-layer accessors; input_ids, token_embeddings, embed_tokens.output, logits, lm_head.output;
#: - interp-engine: 14 per-layer points with a site; 17 per-layer points without one, listed once
#:   without a layer (interp-engine refuses them whatever the layer); embeddings, final_norm, lm_head.
REPORT_LENGTH = {
    "2.x": (39, 5),
    "3.x": (59, 17),
    "4.x": (43, 14),
    "nnterp": (7, 5),
    "interp-engine": (14, 20),
}
#: Per-layer names a report lists once, without a layer (interp-engine's points without a site).
LISTED_ONCE = {"2.x": 0, "3.x": 0, "4.x": 0, "nnterp": 0, "interp-engine": 17}


def check_report(report, generation: str, n_layers: int) -> None:
    """Assert what a report of `generation` on a decoder with `n_layers` layers must hold, from the
    literals above and the names' own text (a `{L}` in the pattern)."""
    a, b = REPORT_LENGTH[generation]
    assert len(report) == a * n_layers + b, (generation, len(report), a * n_layers + b)
    by_pattern = defaultdict(list)
    for r in report:
        by_pattern[r.pattern].append(r)
        if r.layer is not None:
            assert r.query == r.pattern.replace("{L}", str(r.layer)), r
        else:
            assert "{L}" not in r.query, r
    once = 0
    for pattern, mine in by_pattern.items():
        layers = [r.layer for r in mine]
        if "{L}" not in pattern or layers == [None]:
            assert layers == [None], (pattern, layers)
            once += "{L}" in pattern
        else:
            assert layers == list(range(n_layers)), (pattern, layers)
    assert once == LISTED_ONCE[generation], (generation, once)
    assert len({r.query for r in report}) == len(report), "report queries must be unique"


CASES = [
    ("gpt2", 2, "sdpa"),
    ("gpt2", 2, "eager"),
    ("gpt2", 3, "sdpa"),
    ("llama", 2, "sdpa"),
    ("llama", 2, "eager"),
]


@pytest.mark.parametrize("family,n_layers,attn", CASES)
@pytest.mark.parametrize("generation", list(mi.GENERATIONS))
def test_report_count_follows_the_table(family, n_layers, attn, generation):
    _, trace = traced(family, n_layers, attn)
    assert len(trace.blocks) == n_layers
    report = mi.alias_report(trace, generation=generation)
    assert isinstance(report, mi.AliasReport)
    check_report(report, generation, n_layers)
    assert all(isinstance(r, AliasResolution) and r.generation == generation for r in report)
    assert sum(report.counts().values()) == len(report)
    assert set(report.counts()) <= set(mi.STATUSES)
    for r in report:
        if r.facet is None:
            assert r.status == "structurally_absent" and r.module_address is None, r


@pytest.fixture
def fresh_patterns():
    """Nothing to reset: each row compiles its own pattern (`Row.pattern`), so an edited table
    never meets a pattern cached from the table it replaced."""
    yield


def _planted_absent_once(monkeypatch):
    """A table-flag bug: 4.x lists its names without a site once, as interp-engine does."""
    monkeypatch.setitem(
        mi.GENERATIONS, "4.x", dataclasses.replace(mi.GENERATIONS["4.x"], absent_once=True)
    )
    return "4.x"


def _planted_layer_count(monkeypatch):
    """A resolver bug: per-layer names count one layer too few."""
    real = resolver.n_layers
    monkeypatch.setattr(resolver, "n_layers", lambda trace, row=None: max(real(trace, row) - 1, 0))
    return "2.x"


def _planted_in_report(monkeypatch):
    """A table-data bug: one 4.x row dropped from the report (in_report flipped)."""
    table = mi.GENERATIONS["4.x"]
    rows = tuple(
        dataclasses.replace(r, in_report=False) if r.name == "blocks.{L}.hook_out" else r
        for r in table.rows
    )
    monkeypatch.setitem(mi.GENERATIONS, "4.x", dataclasses.replace(table, rows=rows))
    return "4.x"


@pytest.mark.parametrize("plant", [_planted_absent_once, _planted_layer_count, _planted_in_report])
def test_report_check_fails_on_a_planted_bug(plant, monkeypatch, fresh_patterns):
    _, trace = traced("gpt2", 2, "sdpa")
    generation = plant(monkeypatch)
    with pytest.raises(AssertionError):
        check_report(mi.alias_report(trace, generation=generation), generation, 2)


@pytest.mark.parametrize("family,n_layers,attn", CASES)
def test_report_count_literals(family, n_layers, attn):
    _, trace = traced(family, n_layers, attn)
    L = n_layers
    assert len(mi.alias_report(trace, generation="nnterp")) == 7 * L + 5
    ie = mi.alias_report(trace, generation="interp-engine")
    assert len(ie) == 2 + 14 * L + 18
    assert sum(r.facet is None for r in ie) == 18
    assert all(r.layer is None for r in ie if r.facet is None)
    pre_linear = [r for r in ie if r.pattern == "mlp_pre_linear.{L}"]
    assert len(pre_linear) == L
    if family == "gpt2":
        assert all(r.status == "structurally_absent" for r in pre_linear)
        assert sorted(r.query for r in ie if r.facet is not None and r.status not in HAS_SITE) == [
            f"mlp_pre_linear.{i}" for i in range(L)
        ]
    else:
        assert all(r.status == "real" for r in pre_linear)
        assert [r.query for r in ie if r.facet is not None and r.status not in HAS_SITE] == []


def test_seed_nnterp_gpt2_sdpa():
    _, trace = traced("gpt2", 2, "sdpa")
    report = mi.alias_report(trace, generation="nnterp")
    assert len(report) == 19
    assert [r.query for r in report if r.status not in LIVE] == []
    site = mi.resolve_alias(trace, "layers_output[1]")
    assert (site.module_address, site.facet) == ("transformer.h.1", "resid_post")


def test_seed_interp_engine_gpt2_eager():
    _, trace = traced("gpt2", 2, "eager")
    report = mi.alias_report(trace, generation="interp-engine")
    assert len(report) == 48
    assert sum(r.facet is None for r in report) == 18
    not_live = sorted(r.query for r in report if r.facet is not None and r.status not in HAS_SITE)
    assert not_live == ["mlp_pre_linear.0", "mlp_pre_linear.1"]
    assert mi.resolve_alias(trace, "resid_post.1").module_address == "transformer.h.1"


# -- statuses ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("attn,status", [("sdpa", "reconstructed_read_only"), ("eager", "real")])
def test_scores_and_pattern_status_follow_the_kernel(family, attn, status):
    _, trace = traced(family, 2, attn)
    seen = 0
    for generation in mi.GENERATIONS:
        for r in mi.alias_report(trace, generation=generation):
            if r.facet in ("scores", "pattern"):
                assert r.status == status, r
                seen += 1
    assert seen == 2 * (
        2 + 2 + 2 + 1 + 2
    )  # 2 layers x (2.x: 2, 3.x: 2, 4.x: 2, nnterp: 1, interp-engine: 2)
    r = mi.resolve_alias(trace, "blocks.0.attn.hook_pattern")
    if status == "reconstructed_read_only":
        assert "attn_implementation='eager'" in r.remedy
    else:
        assert r.remedy == ""


def test_save_none_needs_capture():
    _, trace = traced("gpt2", 2, "sdpa", save="none")
    r = mi.resolve_alias(trace, "blocks.0.hook_resid_post")
    assert r.status == "needs_capture"
    assert (r.module_address, r.facet) == ("transformer.h.0", "resid_post")
    assert "save=" in r.remedy
    assert not r.readable
    with pytest.raises(tl.FacetNotSaved):
        r.tensor
    for generation in mi.GENERATIONS:
        for r in mi.alias_report(trace, generation=generation):
            assert r.status in ("needs_capture", "structurally_absent"), r
            if r.status == "needs_capture":
                assert "save=" in r.remedy, r


def test_save_one_block():
    _, trace = traced("gpt2", 2, "sdpa", save=("transformer.h.1",))
    for generation in mi.GENERATIONS:
        for r in mi.alias_report(trace, generation=generation):
            addr = r.module_address
            if addr is None or r.status == "structurally_absent":
                continue
            if addr == "transformer.h.1" or addr.startswith("transformer.h.1."):
                assert r.status in LIVE, r
            else:
                assert r.status == "needs_capture", r
                assert "save=" in r.remedy
    assert mi.resolve_alias(trace, "layers_output[1]").status == "real"
    assert mi.resolve_alias(trace, "layers_input[1]").status == "real"
    assert mi.resolve_alias(trace, "attention_probabilities[1]").status == "reconstructed_read_only"
    assert mi.resolve_alias(trace, "layers_output[0]").status == "needs_capture"
    assert mi.resolve_alias(trace, "blocks.0.attn.hook_pattern").status == "needs_capture"
    assert mi.resolve_alias(trace, "embeddings").status == "needs_capture"


def test_structurally_absent_reasons():
    _, gpt2 = traced("gpt2", 2, "sdpa")
    r = mi.resolve_alias(gpt2, "mlp_pre_linear.0")
    assert r.status == "structurally_absent" and "not gated" in r.reason
    assert mi.resolve_alias(gpt2, "blocks.1.mlp.hook_pre_linear").status == "structurally_absent"
    assert "not gated" in mi.resolve_alias(gpt2, "blocks.1.mlp.gate.hook_out").reason
    r = mi.resolve_alias(gpt2, "blocks.0.attn.hook_rot_q")
    assert r.status == "structurally_absent" and "RoPE" in r.reason

    _, llama = traced("llama", 2, "sdpa")
    r = mi.resolve_alias(llama, "hook_pos_embed")
    assert r.status == "structurally_absent" and "no learned position embedding" in r.reason
    assert r.module_address is None
    assert mi.resolve_alias(llama, "mlp_pre_linear.0").status == "real"

    _, neox = traced("neox", 2, "sdpa")
    for name in ("blocks.0.hook_resid_mid", "resid_mid.1"):
        r = mi.resolve_alias(neox, name)
        assert r.status == "structurally_absent", r
        assert "parallel" in r.reason, r.reason
    # TransformerLens hooks hook_mlp_in on a parallel block too: the MLP norm's input, resid_pre
    r = mi.resolve_alias(neox, "blocks.1.hook_mlp_in")
    assert (r.status, r.module_address, r.facet) == (
        "real",
        "gpt_neox.layers.1.post_attention_layernorm",
        "input",
    )
    assert torch.equal(r.tensor, neox.modules["gpt_neox.layers.1"].facets["resid_pre"])
    assert mi.resolve_alias(neox, "blocks.0.hook_resid_post").status == "real"

    r = mi.resolve_alias(gpt2, "q_norm_in")
    assert r.status == "structurally_absent" and r.facet is None and r.module_address is None
    assert r.reason


class _ToyAttention(nn.Module):
    def __init__(self, d, n_heads=2):
        super().__init__()
        self.n_heads = n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        if self.n_heads is None:  # one head, no head axis
            scores = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(x.shape[-1])
            return self.o(scores.softmax(-1) @ self.v(x))
        b, t, d = x.shape
        q, k, v = (
            p(x).view(b, t, self.n_heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        z = scores.softmax(-1) @ v
        return self.o(z.transpose(1, 2).reshape(b, t, d))


class _ToyMLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc, self.act, self.proj = nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class _ToyBlock(nn.Module):
    def __init__(self, d, n_heads=2):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), _ToyAttention(d, n_heads)
        self.ln2, self.mlp = nn.LayerNorm(d), _ToyMLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _ToyDecoder(nn.Module):
    """A decoder whose block list holds the same block object twice (weight-shared layers)."""

    def __init__(self, d=8, vocab=16, n_heads=2, shared=True):
        super().__init__()
        block = _ToyBlock(d, n_heads)
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList([block, block if shared else _ToyBlock(d, n_heads)])
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def test_block_object_run_twice_gives_one_layer_per_call():
    """Weight-shared layers (one block object in the list twice): one layer per call, in order."""
    torch.manual_seed(0)
    model = _ToyDecoder().eval()
    seen = []  # ground truth: a plain forward hook on the shared block
    handle = model.layers[0].register_forward_hook(
        lambda m, a, out: seen.append(out.detach().clone())
    )
    try:
        model(torch.tensor([[1, 2, 3]]))
    finally:
        handle.remove()
    trace = tl.trace(model, torch.tensor([[1, 2, 3]]))
    assert len(trace.modules["layers.0"].calls) == 2
    assert trace.blocks == ["layers.0", "layers.0"]
    for layer in (0, 1):
        for name in (
            f"blocks.{layer}.hook_resid_post",
            f"layers_output[{layer}]",
            f"resid_post.{layer}",
        ):
            r = mi.resolve_alias(trace, name)
            assert r.status == "real" and r.call == layer, r
            torch.testing.assert_close(r.tensor, seen[layer], rtol=0, atol=0)
        assert mi.resolve_alias(trace, f"blocks.{layer}.attn.hook_pattern").call == layer
    assert not torch.equal(seen[0], seen[1])
    with pytest.raises(mi.LayerOutOfRange):
        mi.resolve_alias(trace, "blocks.2.hook_resid_post")
    # Sites outside the shared block are unaffected.
    assert mi.resolve_alias(trace, "hook_embed").status == "real"
    assert mi.resolve_alias(trace, "unembed.hook_out").status == "real"
    report = mi.alias_report(trace, generation="nnterp")
    assert [r.query for r in report if r.pattern == "layers_output[{L}]"] == [
        "layers_output[0]",
        "layers_output[1]",
    ]
    # The same toy with two distinct blocks is unambiguous: the sharing is what makes it ambiguous.
    torch.manual_seed(0)
    distinct = tl.trace(_ToyDecoder(shared=False).eval(), torch.tensor([[1, 2, 3]]))
    assert distinct.blocks == ["layers.0", "layers.1"]
    for name in (
        "blocks.1.hook_resid_post",
        "layers_output[0]",
        "resid_post.0",
        "blocks.0.attn.hook_pattern",
    ):
        assert mi.resolve_alias(distinct, name).status == "real", name


def test_single_head_attention_without_head_axis():
    """An attention whose z has no head axis still traces; it simply has no per-head result."""
    torch.manual_seed(0)
    trace = tl.trace(_ToyDecoder(n_heads=None, shared=False).eval(), torch.tensor([[1, 2, 3]]))
    assert mi.resolve_alias(trace, "blocks.1.hook_resid_post").status == "real"
    assert mi.resolve_alias(trace, "attn_probs.0").status == "real"


def test_ambiguous_name_in_two_generations(monkeypatch):
    """A name two generations point at different sites resolves `ambiguous`, listing both."""
    clash = mi.Table(
        "clash-test",
        "a made-up generation",
        (mi.Row("blocks.{L}.hook_resid_post", "block", "resid_pre", "made up: the block input"),),
    )
    monkeypatch.setitem(mi.GENERATIONS, "clash-test", clash)
    try:
        _, trace = traced("gpt2", 2, "sdpa")
        r = mi.resolve_alias(trace, "blocks.1.hook_resid_post")
        assert r.status == "ambiguous"
        assert (r.module_address, r.facet) == (None, None)
        assert "transformer.h.1:resid_post" in r.reason and "transformer.h.1:resid_pre" in r.reason
        assert "'2.x'" in r.remedy and "'clash-test'" in r.remedy
        assert (
            mi.resolve_alias(trace, "blocks.1.hook_resid_post", generation="2.x").facet
            == "resid_post"
        )
        assert (
            mi.resolve_alias(trace, "blocks.1.hook_resid_post", generation="clash-test").facet
            == "resid_pre"
        )
    finally:
        monkeypatch.undo()


#: Spellings whose meaning really changed between generations, with the reason.
KNOWN_CLASHES = {
    # 2.x HookedTransformer folds Gemma's sqrt(d_model) into W_E, so its hook_embed is the scaled
    # embedding wherever the model scales it; a 3.x bridge aliases hook_embed to embed.hook_out,
    # the embedding module's output, which is unscaled where the model scales outside that module.
    "hook_embed",
}


def test_no_real_name_clashes_across_generations():
    """Shipped tables give one spelling two meanings only where the libraries themselves do."""
    by_name = defaultdict(set)
    for table in mi.GENERATIONS.values():
        for row in table.rows:
            by_name[row.name].add((row.target, row.facets))
    assert {n for n, s in by_name.items() if len(s) > 1} == KNOWN_CLASHES


def test_known_clash_is_ambiguous_only_where_the_tensors_differ():
    """hook_embed: one tensor on GPT-2 (lookup is the module output) and on a Gemma-2 whose
    embedding module scales (both generations read the scaled output); two where the model
    scales outside the module (2.x reads the scaled first-block input, 3.x the module output)."""
    _, gpt2 = traced("gpt2", 2, "sdpa")
    assert mi.resolve_alias(gpt2, "hook_embed").status == "real"
    gemma = tl.trace(testing.build("gemma2", "eager"), torch.tensor([[1, 2, 3, 4]]))
    output = gemma.modules["model.embed_tokens"].facets["output"]
    assert mi.resolve_alias(gemma, "hook_embed").status == "real"
    assert mi.resolve_alias(gemma, "hook_embed", generation="2.x").tensor is output
    assert not torch.equal(gemma.modules["model.embed_tokens"].facets["lookup"], output)

    class Scaled(
        nn.Module
    ):  # an older Gemma: the model multiplies the lookup by sqrt(d_model) itself
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

        def forward(self, ids):
            x = self.embed(ids) * torch.tensor(8**0.5)
            for layer in self.layers:
                x = x + layer(x)
            return x

    model = Scaled()
    scaled = model.embed(torch.tensor([[1, 2, 3]])).detach() * 8**0.5
    trace = tl.trace(model, torch.tensor([[1, 2, 3]]), roles={"layers.*": "block"})
    r = mi.resolve_alias(trace, "hook_embed")
    assert r.status == "ambiguous" and "'2.x'" in r.remedy and "'3.x'" in r.remedy
    r2 = mi.resolve_alias(trace, "hook_embed", generation="2.x")
    assert (r2.module_address, r2.facet) == ("layers.0", "resid_pre") and torch.equal(
        r2.tensor, scaled
    )
    assert mi.resolve_alias(trace, "hook_embed", generation="3.x").facet == "output"


# -- ground truth ------------------------------------------------------------------------------

#: What each name reads, in words of the model, independent of TorchLens's targets and facets.
#: The keys are read per family by `TRUTH` below.
MEANING = {
    # TransformerLens 2.x (and 3.x legacy aliases)
    "hook_tokens": "tokens",
    "hook_embed": "embed",
    "hook_pos_embed": "pos_embed",
    "blocks.{L}.hook_resid_pre": "resid_pre",
    "blocks.{L}.ln1.hook_scale": "ln1_scale",
    "blocks.{L}.ln1.hook_normalized": "ln1_normalized",
    "blocks.{L}.attn.hook_q": "q",
    "blocks.{L}.attn.hook_k": "k",
    "blocks.{L}.attn.hook_v": "v",
    "blocks.{L}.attn.hook_rot_q": "rot_q",
    "blocks.{L}.attn.hook_rot_k": "rot_k",
    "blocks.{L}.attn.hook_attn_scores": "scores",
    "blocks.{L}.attn.hook_pattern": "pattern",
    "blocks.{L}.attn.hook_z": "z",
    "blocks.{L}.attn.hook_result": "result",
    "blocks.{L}.hook_attn_out": "attn_contribution",
    "blocks.{L}.hook_resid_mid": "resid_mid",
    "blocks.{L}.hook_mlp_in": "resid_mid",
    "blocks.{L}.ln2.hook_scale": "ln2_scale",
    "blocks.{L}.ln2.hook_normalized": "ln2_normalized",
    "blocks.{L}.mlp.hook_pre": "mlp_pre",
    "blocks.{L}.mlp.hook_pre_linear": "mlp_pre_linear",
    "blocks.{L}.mlp.hook_post": "down_in",
    "blocks.{L}.hook_mlp_out": "mlp_contribution",
    "blocks.{L}.hook_resid_post": "resid_post",
    "blocks.{L}.ln1_post.hook_scale": "attn_post_norm_scale",
    "blocks.{L}.ln1_post.hook_normalized": "attn_post_norm_normalized",
    "blocks.{L}.ln2_post.hook_scale": "mlp_post_norm_scale",
    "blocks.{L}.ln2_post.hook_normalized": "mlp_post_norm_normalized",
    "ln_final.hook_scale": "final_scale",
    "ln_final.hook_normalized": "final_normalized",
    # TransformerLens 4.x canonical (and 3.x)
    "embed.hook_in": "tokens",
    "embed.hook_out": "embed",
    "pos_embed.hook_in": "pos_ids",
    "pos_embed.hook_out": "pos_embed",
    "blocks.{L}.hook_in": "resid_pre",
    "blocks.{L}.ln1.hook_in": "ln1_in",
    "blocks.{L}.ln1.hook_out": "ln1_out",
    "blocks.{L}.attn.hook_in": "attn_in",
    "blocks.{L}.attn.q.hook_in": "q_proj_in",
    "blocks.{L}.attn.q.hook_out": "q",
    "blocks.{L}.attn.k.hook_in": "k_proj_in",
    "blocks.{L}.attn.k.hook_out": "k",
    "blocks.{L}.attn.v.hook_in": "v_proj_in",
    "blocks.{L}.attn.v.hook_out": "v",
    "blocks.{L}.attn.o.hook_in": "z",
    "blocks.{L}.attn.o.hook_out": "o_proj_out",
    "blocks.{L}.attn.hook_hidden_states": "o_proj_out",
    "blocks.{L}.attn.hook_out": "attn_out",
    "blocks.{L}.ln2.hook_in": "ln2_in",
    "blocks.{L}.ln2.hook_out": "ln2_out",
    "blocks.{L}.mlp.hook_in": "mlp_in",
    "blocks.{L}.mlp.gate.hook_in": "gate_proj_in",
    "blocks.{L}.mlp.gate.hook_out": "gate_proj_out",
    "blocks.{L}.mlp.in.hook_in": "in_proj_in",
    "blocks.{L}.mlp.in.hook_out": "in_proj_out",
    "blocks.{L}.mlp.out.hook_in": "down_in",
    "blocks.{L}.mlp.out.hook_out": "down_out",
    "blocks.{L}.mlp.hook_out": "mlp_out",
    "blocks.{L}.hook_out": "resid_post",
    "ln_final.hook_in": "final_in",
    "ln_final.hook_out": "final_out",
    "unembed.hook_in": "unembed_in",
    "unembed.hook_out": "unembed_out",
    "hook_unembed": "unembed_out",
    # nnterp
    "layers_input[{L}]": "resid_pre",
    "attentions_input[{L}]": "attn_in",
    "attention_probabilities[{L}]": "pattern",
    "attentions_output[{L}]": "attn_out",
    "mlps_input[{L}]": "mlp_in",
    "mlps_output[{L}]": "mlp_out",
    "layers_output[{L}]": "resid_post",
    "input_ids": "tokens",
    "token_embeddings": "embed",
    "embed_tokens.output": "embed",
    "logits": "model_logits",
    "lm_head.output": "unembed_out",
    # interp-engine
    "embeddings": "embed",
    "resid_pre.{L}": "resid_pre",
    "attn_in.{L}": "attn_in",
    "value.{L}": "v",
    "attn_scores.{L}": "scores",
    "attn_probs.{L}": "pattern",
    "z.{L}": "z",
    "attn_out.{L}": "attn_out",
    "resid_mid.{L}": "resid_mid",
    "mlp_in.{L}": "mlp_in",
    "mlp_pre.{L}": "mlp_pre",
    "mlp_pre_linear.{L}": "mlp_pre_linear",
    "mlp_act.{L}": "down_in",
    "mlp_out.{L}": "mlp_out",
    "resid_post.{L}": "resid_post",
    "final_norm": "final_out",
    "lm_head": "unembed_out",
}


class HF:
    """One eager forward of a Hugging Face model with plain forward hooks on every module."""

    def __init__(self, model: nn.Module, ids: torch.Tensor, eager_twin: nn.Module):
        self.model = model
        self.mods = dict(model.named_modules())
        self.calls: dict[str, tuple] = {}
        handles = [
            m.register_forward_hook(self._hook(n), with_kwargs=True)
            for n, m in model.named_modules()
        ]
        try:
            with torch.no_grad():
                self.output = model(ids)
        finally:
            for h in handles:
                h.remove()
        with torch.no_grad():  # the pattern, as transformers returns it from eager attention
            self.attentions = eager_twin(ids, output_attentions=True).attentions
        self.cfg = model.config

    def _hook(self, name):
        def hook(module, args, kwargs, output):
            assert name not in self.calls, f"{name} ran twice"
            self.calls[name] = (args, kwargs, output)

        return hook

    def inp(self, path: str) -> torch.Tensor:
        args, kwargs, _ = self.calls[path]
        if args:
            return args[0]
        return kwargs["hidden_states"]  # attention called with keywords only (Llama)

    def out(self, path: str) -> torch.Tensor:
        out = self.calls[path][2]
        return out[0] if isinstance(out, tuple) else out

    def raw_out(self, path: str):
        return self.calls[path][2]


def _norm_stats(hf: HF, path: str, rms: bool):
    """TL's hook_scale (the divisor) and the pre-gain normalized input, from the norm's input."""
    x = hf.inp(path)
    mod = hf.mods[path]
    eps = getattr(mod, "eps", None)
    eps = mod.variance_epsilon if eps is None else eps
    xf = x.float()
    centred = xf if rms else xf - xf.mean(-1, keepdim=True)
    inv = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    return 1 / inv, (centred * inv).to(x.dtype)


def _causal_masked(scores: torch.Tensor) -> torch.Tensor:
    t_q, t_k = scores.shape[-2:]
    visible = torch.ones(t_q, t_k, dtype=torch.bool).tril()
    return scores.masked_fill(~visible, torch.finfo(scores.dtype).min)


def _rope(x_bthd: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on a token-major [B, T, H, dh] tensor, with cos/sin [B, T, dh]."""
    half = x_bthd.shape[-1] // 2
    rotated = torch.cat((-x_bthd[..., half:], x_bthd[..., :half]), dim=-1)
    return x_bthd * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


def _heads(x: torch.Tensor, d_head: int) -> torch.Tensor:
    """[B, T, H*dh] -> [B, T, H, dh]."""
    return x.view(*x.shape[:-1], x.shape[-1] // d_head, d_head)


def _per_head_result(z_flat: torch.Tensor, w_in_out: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Each head's share of the output projection (bias excluded): [B, T, H, d_model]."""
    b, t, hd = z_flat.shape
    return torch.einsum(
        "bthd,hdo->btho",
        z_flat.view(b, t, n_heads, hd // n_heads),
        w_in_out.view(n_heads, hd // n_heads, -1),
    )


def _gpt2_truth():
    blk = "transformer.h.{L}"

    def p(suffix):
        return lambda L: (blk + suffix).format(L=L)

    def qkv(hf, L, i):
        d = hf.cfg.n_embd
        return _heads(hf.out(p(".attn.c_attn")(L))[..., i * d : (i + 1) * d], d // hf.cfg.n_head)

    def scores(hf, L):
        q, k = qkv(hf, L, 0).transpose(1, 2), qkv(hf, L, 1).transpose(1, 2)
        return _causal_masked(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5)

    def z(hf, L):
        return _heads(hf.inp(p(".attn.c_proj")(L)), hf.cfg.n_embd // hf.cfg.n_head).transpose(1, 2)

    def result(hf, L):
        w = hf.mods[p(".attn.c_proj")(L)].weight  # Conv1D: [in, out]
        return _per_head_result(hf.inp(p(".attn.c_proj")(L)), w, hf.cfg.n_head)

    inp = lambda path: lambda hf, L: hf.inp(path(L))
    out = lambda path: lambda hf, L: hf.out(path(L))
    g = lambda path: lambda L: path
    return {
        "tokens": inp(g("transformer.wte")),
        "embed": out(g("transformer.wte")),
        "embed_lookup": lambda hf, L: nn.functional.embedding(
            hf.inp("transformer.wte"), hf.mods["transformer.wte"].weight
        ),
        "pos_ids": inp(g("transformer.wpe")),
        "pos_embed": out(g("transformer.wpe")),
        "resid_pre": inp(p("")),
        "ln1_in": inp(p(".ln_1")),
        "ln1_out": out(p(".ln_1")),
        "ln1_scale": lambda hf, L: _norm_stats(hf, p(".ln_1")(L), rms=False)[0],
        "ln1_normalized": lambda hf, L: _norm_stats(hf, p(".ln_1")(L), rms=False)[1],
        "attn_in": inp(p(".attn")),
        "q_proj_in": inp(p(".attn.c_attn")),
        "k_proj_in": inp(p(".attn.c_attn")),
        "v_proj_in": inp(p(".attn.c_attn")),
        "q": lambda hf, L: qkv(hf, L, 0),
        "k": lambda hf, L: qkv(hf, L, 1),
        "v": lambda hf, L: qkv(hf, L, 2),
        "scores": scores,
        "pattern": lambda hf, L: hf.attentions[L],
        "z": z,
        "result": result,
        "o_proj_out": out(p(".attn.c_proj")),
        "attn_out": out(p(".attn")),
        "attn_contribution": out(p(".attn")),
        "resid_mid": inp(p(".ln_2")),
        "ln2_in": inp(p(".ln_2")),
        "ln2_out": out(p(".ln_2")),
        "ln2_scale": lambda hf, L: _norm_stats(hf, p(".ln_2")(L), rms=False)[0],
        "ln2_normalized": lambda hf, L: _norm_stats(hf, p(".ln_2")(L), rms=False)[1],
        "mlp_in": inp(p(".mlp")),
        "in_proj_in": inp(p(".mlp.c_fc")),
        "in_proj_out": out(p(".mlp.c_fc")),
        "mlp_pre": out(p(".mlp.c_fc")),
        "down_in": inp(p(".mlp.c_proj")),
        "down_out": out(p(".mlp.c_proj")),
        "mlp_out": out(p(".mlp")),
        "mlp_contribution": out(p(".mlp")),
        "resid_post": out(p("")),
        "final_in": inp(g("transformer.ln_f")),
        "final_out": out(g("transformer.ln_f")),
        "final_scale": lambda hf, L: _norm_stats(hf, "transformer.ln_f", rms=False)[0],
        "final_normalized": lambda hf, L: _norm_stats(hf, "transformer.ln_f", rms=False)[1],
        "unembed_in": inp(g("lm_head")),
        "unembed_out": out(g("lm_head")),
        "model_logits": lambda hf, L: hf.output.logits,
    }


def _llama_like_truth(ln2: str, attn_post: str | None = None, mlp_post: str | None = None):
    """Llama-style decoders; `ln2` names the norm feeding the MLP, the others sandwich norms."""
    blk = "model.layers.{L}"

    def p(suffix):
        return lambda L: (blk + suffix).format(L=L)

    inp = lambda path: lambda hf, L: hf.inp(path(L))
    out = lambda path: lambda hf, L: hf.out(path(L))
    g = lambda path: lambda L: path

    def d_head(hf):
        return getattr(hf.cfg, "head_dim", None) or hf.cfg.hidden_size // hf.cfg.num_attention_heads

    def proj(hf, L, name):
        return _heads(hf.out(p(f".self_attn.{name}_proj")(L)), d_head(hf))

    def rot(hf, L, name):
        cos, sin = hf.raw_out("model.rotary_emb")
        return _rope(proj(hf, L, name), cos, sin)

    def scores(hf, L):
        q, k = rot(hf, L, "q").transpose(1, 2), rot(hf, L, "k").transpose(1, 2)
        k = k.repeat_interleave(
            q.shape[1] // k.shape[1], dim=1
        )  # GQA: consecutive query heads share a kv head
        s = q @ k.transpose(-1, -2) * hf.mods[p(".self_attn")(L)].scaling
        cap = getattr(hf.cfg, "attn_logit_softcapping", None)
        if cap is not None:
            s = torch.tanh(s / cap) * cap
        return _causal_masked(s)

    def z(hf, L):
        return _heads(hf.inp(p(".self_attn.o_proj")(L)), d_head(hf)).transpose(1, 2)

    def result(hf, L):
        w = hf.mods[p(".self_attn.o_proj")(L)].weight  # Linear: [out, in]
        return _per_head_result(hf.inp(p(".self_attn.o_proj")(L)), w.T, hf.cfg.num_attention_heads)

    def stats(path, i):
        return lambda hf, L: _norm_stats(hf, path(L), rms=True)[i]

    truth = {
        "tokens": inp(g("model.embed_tokens")),
        "embed": out(g("model.embed_tokens")),
        "embed_lookup": lambda hf, L: nn.functional.embedding(
            hf.inp("model.embed_tokens"), hf.mods["model.embed_tokens"].weight
        ),
        "resid_pre": inp(p("")),
        "ln1_in": inp(p(".input_layernorm")),
        "ln1_out": out(p(".input_layernorm")),
        "ln1_scale": stats(p(".input_layernorm"), 0),
        "ln1_normalized": stats(p(".input_layernorm"), 1),
        "attn_in": inp(p(".self_attn")),
        "q_proj_in": inp(p(".self_attn.q_proj")),
        "k_proj_in": inp(p(".self_attn.k_proj")),
        "v_proj_in": inp(p(".self_attn.v_proj")),
        "q": lambda hf, L: proj(hf, L, "q"),
        "k": lambda hf, L: proj(hf, L, "k"),
        "v": lambda hf, L: proj(hf, L, "v"),
        "rot_q": lambda hf, L: rot(hf, L, "q"),
        "rot_k": lambda hf, L: rot(hf, L, "k"),
        "scores": scores,
        "pattern": lambda hf, L: hf.attentions[L],
        "z": z,
        "result": result,
        "o_proj_out": out(p(".self_attn.o_proj")),
        "attn_out": out(p(".self_attn")),
        "attn_contribution": out(p(attn_post or ".self_attn")),
        "resid_mid": inp(p(ln2)),
        "ln2_in": inp(p(ln2)),
        "ln2_out": out(p(ln2)),
        "ln2_scale": stats(p(ln2), 0),
        "ln2_normalized": stats(p(ln2), 1),
        "mlp_in": inp(p(".mlp")),
        "gate_proj_in": inp(p(".mlp.gate_proj")),
        "gate_proj_out": out(p(".mlp.gate_proj")),
        "mlp_pre": out(p(".mlp.gate_proj")),
        "mlp_pre_linear": out(p(".mlp.up_proj")),
        "in_proj_in": inp(p(".mlp.up_proj")),
        "in_proj_out": out(p(".mlp.up_proj")),
        "down_in": inp(p(".mlp.down_proj")),
        "down_out": out(p(".mlp.down_proj")),
        "mlp_out": out(p(".mlp")),
        "mlp_contribution": out(p(mlp_post or ".mlp")),
        "resid_post": out(p("")),
        "final_in": inp(g("model.norm")),
        "final_out": out(g("model.norm")),
        "final_scale": stats(g("model.norm"), 0),
        "final_normalized": stats(g("model.norm"), 1),
        "unembed_in": inp(g("lm_head")),
        "unembed_out": out(g("lm_head")),
        "model_logits": lambda hf, L: hf.output.logits,
    }
    if attn_post:
        truth["attn_post_norm_scale"] = stats(p(attn_post), 0)
        truth["attn_post_norm_normalized"] = stats(p(attn_post), 1)
    if mlp_post:
        truth["mlp_post_norm_scale"] = stats(p(mlp_post), 0)
        truth["mlp_post_norm_normalized"] = stats(p(mlp_post), 1)
    return truth


TRUTH = {
    "gpt2": _gpt2_truth(),
    "llama": _llama_like_truth(".post_attention_layernorm"),
    "gemma2": _llama_like_truth(
        ".pre_feedforward_layernorm", ".post_attention_layernorm", ".post_feedforward_layernorm"
    ),
}


#: Where one spelling means different tensors in different generations (see KNOWN_CLASHES).
MEANING_BY_GENERATION: dict[tuple[str, str], str] = {}


def _check_ground_truth(family: str, attn: str):
    model, trace = traced(family, 2, attn, perturb=True)
    twin, _ = traced(family, 2, "eager", perturb=True)
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values())
    )
    hf = HF(model, IDS, twin)
    truth = TRUTH[family]
    readable, checked, failures = set(), set(), []
    for generation in mi.GENERATIONS:
        for r in mi.alias_report(trace, generation=generation):
            if not r.readable:
                continue
            readable.add((generation, r.query))
            key = MEANING_BY_GENERATION.get((generation, r.pattern), MEANING.get(r.pattern))
            if key is None or key not in truth:
                failures.append(f"{generation} {r.query}: no ground truth for meaning {key!r}")
                continue
            expected = truth[key](hf, r.layer)
            again = mi.resolve_alias(trace, r.query, generation=generation)
            assert (again.module_address, again.facet, again.status) == (
                r.module_address,
                r.facet,
                r.status,
            )
            actual = trace.modules[r.module_address].facets[r.facet]
            assert torch.equal(actual, r.tensor)
            if actual.shape != expected.shape or not torch.allclose(
                actual, expected.to(actual.dtype), rtol=1e-4, atol=1e-5
            ):
                err = (
                    (actual.float() - expected.float()).abs().max()
                    if actual.shape == expected.shape
                    else "-"
                )
                failures.append(
                    f"{generation} {r.query} -> {r.module_address}:{r.facet} [{r.status}] differs from "
                    f"{key}: shapes {tuple(actual.shape)} vs {tuple(expected.shape)}, max err {err}"
                )
            checked.add((generation, r.query))
    assert not failures, "\n".join(failures)
    assert checked == readable
    return checked


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_ground_truth_every_readable_row(family, attn):
    checked = _check_ground_truth(family, attn)
    names = {q for _, q in checked}
    # The rows the brief singles out are among those compared.
    assert {
        "layers_output[1]",
        "attentions_input[0]",
        "mlp_act.1",
        "embeddings",
        "lm_head",
        "blocks.0.ln1.hook_scale",
        "attn_probs.1",
        "attention_probabilities[0]",
    } <= names
    if family == "llama":
        assert {
            "mlp_pre_linear.0",
            "blocks.1.attn.hook_rot_q",
            "blocks.0.mlp.gate.hook_out",
        } <= names
    else:
        assert {"hook_pos_embed", "pos_embed.hook_in"} <= names


def test_ground_truth_gemma2_sandwich_norms():
    checked = _check_ground_truth("gemma2", "eager")
    names = {q for _, q in checked}
    assert {
        "blocks.0.hook_attn_out",
        "blocks.1.hook_mlp_out",
        "blocks.0.ln1_post.hook_scale",
        "blocks.1.ln1_post.hook_normalized",
        "blocks.0.ln2_post.hook_scale",
        "blocks.0.ln2.hook_normalized",
        "blocks.1.hook_resid_mid",
        "attn_out.0",
        "blocks.0.attn.hook_attn_scores",
    } <= names
    _, trace = traced("gemma2", 2, "eager", perturb=True)
    r = mi.resolve_alias(trace, "blocks.0.hook_attn_out")
    assert r.module_address == "model.layers.0.post_attention_layernorm"


def test_nnterp_negative_index_is_last_block():
    model, trace = traced("gpt2", 2, "sdpa")
    r = mi.resolve_alias(trace, "layers_output[-1]")
    assert (r.module_address, r.facet, r.layer) == ("transformer.h.1", "resid_post", 1)
    assert mi.resolve_alias(trace, "layers_input[-2]").module_address == "transformer.h.0"
    hf = HF(model, IDS, traced("gpt2", 2, "eager")[0])
    assert torch.allclose(r.tensor, hf.out("transformer.h.1"), atol=1e-6)
    with pytest.raises(LayerOutOfRange):
        mi.resolve_alias(trace, "layers_output[-3]")


def test_path_address_reads_the_module_output():
    model, trace = traced("gpt2", 2, "sdpa")
    r = mi.resolve_alias(trace, "path.transformer.wpe")
    assert (r.module_address, r.facet, r.status) == ("transformer.wpe", "output", "real")
    with torch.no_grad():
        expected = model.transformer.wpe(torch.arange(IDS.shape[1]))
    assert torch.allclose(r.tensor[0], expected)
    with pytest.raises(UnknownAlias, match=r"path\.transformer\.wpe"):
        mi.resolve_alias(trace, "path.transformer.wpee")
    with pytest.raises(UnknownAlias) as e:
        mi.resolve_alias(trace, "path.nope")
    assert "path.transformer" in str(e.value), "a missing path should still point at real addresses"


def test_path_needs_a_module_address():
    _, trace = traced("gpt2", 2, "sdpa")
    with pytest.raises(AliasError):
        mi.resolve_alias(trace, "path.")


# -- errors ------------------------------------------------------------------------------------


def test_unknown_name_suggests_close_matches():
    _, trace = traced("gpt2", 2, "sdpa")
    with pytest.raises(UnknownAlias) as e:
        mi.resolve_alias(trace, "blocks.0.hook_resid_pots")
    assert "'blocks.0.hook_resid_post'" in str(e.value)
    with pytest.raises(UnknownAlias) as e:
        mi.resolve_alias(trace, "layers_outptu[1]", generation="nnterp")
    assert "'layers_output[1]'" in str(e.value)
    with pytest.raises(UnknownAlias):
        mi.resolve_alias(trace, "blocks.0.hook_resid_post", generation="nnterp")
    with pytest.raises(UnknownAlias):
        mi.resolve_alias(trace, "   ")
    with pytest.raises(UnknownAlias):
        mi.resolve_alias(trace, 3)  # type: ignore[arg-type]


def test_layer_out_of_range_names_the_range():
    _, trace = traced("gpt2", 2, "sdpa")
    for name in ("blocks.7.hook_resid_post", "resid_post.2", "layers_output[2]", "q_norm_in.5"):
        with pytest.raises(LayerOutOfRange) as e:
            mi.resolve_alias(trace, name)
        assert "0..1" in str(e.value), str(e.value)
        assert isinstance(e.value, IndexError)


@pytest.mark.parametrize("bad", ["5.x", "nnterpp", "", "TL2", ["nnterp"], 3])
def test_unknown_generation_lists_generations(bad):
    _, trace = traced("gpt2", 2, "sdpa")
    for call in (
        lambda: mi.resolve_alias(trace, "resid_post.1", generation=bad),
        lambda: mi.alias_report(trace, generation=bad),
        lambda: mi.table(bad),
    ):
        with pytest.raises(UnknownGeneration) as e:
            call()
        for g in mi.GENERATIONS:
            assert repr(g) in str(e.value)


def test_report_and_table_need_a_generation():
    _, trace = traced("gpt2", 2, "sdpa")
    with pytest.raises(UnknownGeneration):
        mi.alias_report(trace, generation=None)  # type: ignore[arg-type]
    with pytest.raises(UnknownGeneration):
        mi.table(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [
        "resid_post:5",
        "blocks.01.hook_resid_post",
        "resid_post.-1",
        "attn_out.1.stream-0",
        "resid_post.1.site-1",
        "blocks.-1.hook_resid_post",
        "resid_post.stream-0",
        "layers_output[01]",
        "layers_output[-01]",
        "resid_post.1.stream-01",
        "blocks.\u0661.hook_resid_post",
        "resid_post.1.stream-\u0663",
    ],
)
def test_malformed_names(bad):
    _, trace = traced("gpt2", 2, "sdpa")
    with pytest.raises(AliasError):
        mi.resolve_alias(trace, bad)


@pytest.mark.parametrize(
    "bad,cls",
    [
        ("blocks.01.hook_resid_post", MalformedAlias),
        ("resid_post.-1", MalformedAlias),
        ("attn_out.1.stream-0", MalformedAlias),
        ("resid_post.1.site-1", MalformedAlias),
        ("layers_output[-01]", MalformedAlias),
        ("resid_post.1.stream-\u0663", MalformedAlias),
    ],
)
def test_malformed_names_raise_malformed(bad, cls):
    _, trace = traced("gpt2", 2, "sdpa")
    with pytest.raises(cls):
        mi.resolve_alias(trace, bad)


def test_huge_layer_numbers_raise_torchlens_errors():
    _, trace = traced("gpt2", 2, "sdpa")
    huge = "9" * 5000
    for name, cls in (
        (f"blocks.{huge}.hook_resid_post", LayerOutOfRange),
        (f"resid_post.{huge}", LayerOutOfRange),
        (f"layers_output[-{huge}]", LayerOutOfRange),
        (f"resid_post.-{huge}", MalformedAlias),
        (f"resid_post.1.stream-0{huge}", MalformedAlias),
        (f"x{huge}", UnknownAlias),
        (f"layers_output[{huge}", UnknownAlias),
    ):
        with pytest.raises(cls):
            mi.resolve_alias(trace, name)
    # Any stream index is well-formed; a single-stream trunk has no site for it.
    assert mi.resolve_alias(trace, f"resid_post.1.stream-{huge}").status == "structurally_absent"


def test_nnterp_final_norm_says_where_to_read_it():
    _, trace = traced("gpt2", 2, "sdpa")
    with pytest.raises(UnknownAlias) as e:
        mi.resolve_alias(trace, "ln_final.output")
    msg = str(e.value)
    assert "final_norm_input" in msg and "ln_final.hook_out" in msg
    with pytest.raises(UnknownAlias) as e:
        mi.resolve_alias(trace, "ln_final.output", generation="nnterp")
    assert "final_norm_input" in str(e.value)
    # The 4.x name it points at does resolve, to the final norm's output.
    r = mi.resolve_alias(trace, "ln_final.hook_out")
    assert (r.module_address, r.facet) == ("transformer.ln_f", "output")


def test_every_alias_error_is_a_torchlens_error():
    for cls in (AliasError, UnknownAlias, UnknownGeneration, LayerOutOfRange, MalformedAlias):
        assert issubclass(cls, TorchLensError)
    assert issubclass(UnknownAlias, KeyError) and issubclass(MalformedAlias, ValueError)


def test_resolution_tensor_without_site_raises():
    _, trace = traced("gpt2", 2, "sdpa")
    with pytest.raises(AliasError):
        mi.resolve_alias(trace, "q_norm_in").tensor


# -- property-based ----------------------------------------------------------------------------


@functools.cache
def oracle(family: str = "gpt2"):
    """Every valid concrete name of a trace -> {(generation, module_address, facet)}.

    Built from `alias_report` (which instantiates rows without parsing any string) plus the
    spellings a report does not list: interp-engine's refused points with a layer, nnterp's
    negative indices, interp-engine stream coordinates and `path.` addresses.
    """
    _, trace = traced(family, 2, "sdpa")
    n = len(trace.blocks)
    sites: dict[str, set] = defaultdict(set)
    for generation, table in mi.GENERATIONS.items():
        report = mi.alias_report(trace, generation=generation)
        for r in report:
            sites[r.query].add((generation, r.module_address, r.facet))
        for row in table.rows:
            if not row.per_layer:
                continue
            for layer in range(n):
                name = row.name.replace("{L}", str(layer))
                if table.absent_once and row.facet is None:
                    sites[name].add((generation, None, None))
                if table.negative_layers:
                    sites[row.name.replace("{L}", str(layer - n))] |= {
                        s for s in sites[name] if s[0] == generation
                    }
    for address in trace.modules:
        if address:
            sites["path." + address].add(("interp-engine", address, "output"))
    return trace, dict(sites)


_STREAM = re.compile(r"^(resid_pre|resid_mid|resid_post)\.([01])\.stream-(0|[1-9][0-9]{0,5})$")


def expected_sites(name: str, generation: str | None = None):
    """The sites a valid name must resolve to, or None when the name is not valid."""
    _, sites = oracle()
    if generation is None and _STREAM.match(name):
        return {(None, None)}
    found = sites.get(name)
    if found is None:
        return None
    found = {(a, f) for g, a, f in found if generation is None or g == generation}
    return found or None


def check_name(text: str, generation: str | None = None, same_as: str | None = None):
    """The resolver's contract on one string: a correct resolution or a TorchLens error, nothing else."""
    trace, _ = oracle()
    key = text.strip()
    expected = expected_sites(key, generation)
    if same_as is not None:
        assert expected_sites(same_as, generation) is not None
        expected = expected_sites(same_as, generation)
    try:
        r = mi.resolve_alias(trace, text, generation=generation)
    except TorchLensError as e:
        assert expected is None, f"{text!r} is a valid name but raised {type(e).__name__}: {e}"
        return None
    assert isinstance(r, AliasResolution)
    assert expected is not None, f"{text!r} is not a valid name but resolved to {r!r}"
    if len(expected) == 1:
        assert (r.module_address, r.facet) == next(iter(expected)), (text, r)
    elif len({id(trace.modules[a].facets[f]) for a, f in expected}) == 1:
        # Two facets that are one recorded tensor (GPT-2's embedding lookup is its output).
        assert (r.module_address, r.facet) in expected and r.status != "ambiguous", (text, r)
    else:
        assert r.status == "ambiguous", (text, r)
    assert r.query == key
    return r


ALL_ROWS = [(g, row) for g, t in mi.GENERATIONS.items() for row in t.rows]
SEPARATORS = ".-_["
WHITESPACE = " \t\n\r\x0b\x0c\u3000\u2003\u00a0\x1c"

rows_st = st.sampled_from(ALL_ROWS)
ws_st = st.text(alphabet=WHITESPACE, max_size=4)
junk_st = st.text(min_size=1, max_size=6)


def _instantiate(row: mi.Row, layer: int) -> str:
    return row.name.replace("{L}", str(layer))


PROP = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROP
@given(rows_st, st.integers(0, 1), ws_st, ws_st, st.booleans())
def test_property_surrounding_whitespace_is_ignored(row_g, layer, before, after, scoped):
    generation, row = row_g
    name = _instantiate(row, layer)
    r = check_name(before + name + after, generation if scoped else None, same_as=name)
    assert r is not None
    canonical = mi.resolve_alias(oracle()[0], name, generation=generation if scoped else None)
    assert (r.module_address, r.facet, r.status) == (
        canonical.module_address,
        canonical.facet,
        canonical.status,
    )


@PROP
@given(
    rows_st,
    st.integers(0, 1),
    st.sampled_from(["upper", "lower", "swapcase", "title", "capitalize"]),
)
def test_property_case_changes(row_g, layer, how):
    _, row = row_g
    check_name(getattr(_instantiate(row, layer), how)())


@PROP
@given(rows_st, st.integers(0, 1), st.data())
def test_property_separator_swaps(row_g, layer, data):
    _, row = row_g
    name = _instantiate(row, layer)
    positions = [i for i, c in enumerate(name) if c in SEPARATORS + "]"]
    assume(positions)
    i = data.draw(st.sampled_from(positions))
    new = data.draw(st.sampled_from(SEPARATORS + "] "))
    check_name(name[:i] + new + name[i + 1 :])


@PROP
@given(
    rows_st,
    st.integers(0, 1),
    junk_st,
    st.sampled_from(["prefix", "suffix", "both", "inside"]),
    st.data(),
)
@example(("interp-engine", mi.table("interp-engine")[1]), 1, "\u0661", "suffix", None)
def test_property_junk_and_unicode(row_g, layer, junk, where, data):
    generation, row = row_g
    name = _instantiate(row, layer)
    if where == "prefix":
        text = junk + name
    elif where == "suffix":
        text = name + junk
    elif where == "both":
        text = junk + name + junk
    else:
        i = data.draw(st.integers(1, len(name) - 1)) if data is not None else 1
        text = name[:i] + junk + name[i:]
    check_name(text)
    check_name(text, generation)


def _layer_texts():
    ints = st.one_of(st.integers(-3, 4), st.integers(-(10**40), 10**40))
    return st.one_of(
        ints.map(str),
        st.text(alphabet="0123456789", min_size=1, max_size=30),
        st.text(alphabet="0123456789", min_size=4301, max_size=5000),
        st.text(alphabet="0123456789", min_size=1, max_size=30).map(lambda s: "-" + s),
        st.sampled_from(["+1", "1.0", "\u0661", "\uff11", "0x1", "1_0", " 1", "1e0", "--1", "-"]),
    )


@PROP
@given(st.sampled_from([(g, r) for g, r in ALL_ROWS if r.per_layer]), _layer_texts(), st.booleans())
def test_property_random_layer_numbers(row_g, layer_text, scoped):
    generation, row = row_g
    table = mi.GENERATIONS[generation]
    text = row.name.replace("{L}", layer_text)
    gen = generation if scoped else None
    r = check_name(text, gen)
    digits = layer_text[1:] if layer_text.startswith("-") else layer_text
    plain = digits.isascii() and digits.isdigit()
    canonical = plain and (digits == "0" or not digits.startswith("0")) and layer_text != "-0"
    if not plain or r is not None:
        return  # not a layer number (or valid): the generic contract above is all that is promised
    trace = oracle()[0]
    with pytest.raises(TorchLensError) as e:
        mi.resolve_alias(trace, text, generation=gen)
    if not canonical:
        assert isinstance(e.value, MalformedAlias), (text, e.value)
    elif layer_text.startswith("-") and not table.negative_layers:
        assert isinstance(e.value, MalformedAlias), (text, e.value)
    else:
        assert isinstance(e.value, LayerOutOfRange), (text, e.value)


@PROP
@given(st.text(max_size=40), st.sampled_from([None, *mi.GENERATIONS]))
def test_property_arbitrary_text(text, generation):
    check_name(text, generation)


def test_oracle_is_not_vacuous():
    trace, sites = oracle()
    assert len(sites) > 300
    assert expected_sites("layers_output[-1]") == {("transformer.h.1", "resid_post")}
    assert expected_sites("q_norm_in.1") == {(None, None)}
    assert expected_sites("path.transformer.wpe") == {("transformer.wpe", "output")}
    assert expected_sites("blocks.0.hook_resid_post") == {("transformer.h.0", "resid_post")}
    assert expected_sites("ln_final.output") is None


# -- the final norm: one rule, on the bare model as on the LM-head model ---------------------------


@pytest.mark.parametrize("cls", [transformers.GPT2Model, transformers.GPT2LMHeadModel])
def test_final_norm_is_found_with_and_without_the_lm_head(cls):
    """`ln_final.hook_in/out`, the root's `final_norm_input` and the `final_norm` target read the
    same norm on GPT2Model (no unembedding) as on GPT2LMHeadModel; ground truth is a plain
    forward hook on `ln_f`, the module named by hand."""
    torch.manual_seed(0)
    model = cls(
        transformers.GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=64,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
        )
    ).eval()
    ln_f = model.ln_f if cls is transformers.GPT2Model else model.transformer.ln_f
    seen = {}
    handle = ln_f.register_forward_hook(
        lambda m, args, out: seen.update(x=args[0].detach().clone(), y=out.detach().clone())
    )
    with torch.no_grad():
        model(IDS)
    handle.remove()
    trace = tl.trace(model, IDS)
    address = "ln_f" if cls is transformers.GPT2Model else "transformer.ln_f"
    r_in = mi.resolve_alias(trace, "ln_final.hook_in", generation="4.x")
    r_out = mi.resolve_alias(trace, "ln_final.hook_out", generation="4.x")
    assert (r_in.status, r_in.module_address) == ("real", address)
    assert torch.equal(r_in.tensor, seen["x"]) and torch.equal(r_out.tensor, seen["y"])
    assert torch.equal(trace.modules[""].facets["final_norm_input"], seen["x"])
    assert trace.structure.final_norm.address == address


# -- an MLP held by no module of its own (OPT) ---------------------------------------------------------


def _opt(layers=2):
    torch.manual_seed(0)
    cfg = transformers.OPTConfig(
        num_hidden_layers=layers,
        hidden_size=32,
        num_attention_heads=2,
        ffn_dim=64,
        vocab_size=64,
        max_position_embeddings=16,
        word_embed_proj_dim=32,
    )
    return tl.testing.from_config(cfg, transformers.OPTForCausalLM)


@pytest.mark.parametrize("generation", ["2.x", "3.x", "4.x"])
def test_opt_mlp_names_read_its_fc_layers_and_match_plain_hooks(generation):
    """OPT's layer holds fc1, its activation and fc2 itself and flattens [batch, pos] around them;
    the MLP names read those layers (each row's `or_else`), against plain hooks on them."""
    model = _opt()
    ids = testing.token_ids(2, 5)
    seen, handles = {}, []

    def keep(key, from_args=False):
        return (
            (lambda m, args: seen.__setitem__(key, args[0].detach().clone()))
            if from_args
            else (lambda m, args, out: seen.__setitem__(key, out.detach().clone()))
        )

    for i, layer in enumerate(model.model.decoder.layers):
        handles += [
            layer.fc1.register_forward_hook(keep(f"pre.{i}")),
            layer.fc2.register_forward_pre_hook(keep(f"post.{i}", True), with_kwargs=False),
            layer.fc2.register_forward_hook(keep(f"mlp_out.{i}")),
            layer.final_layer_norm.register_forward_pre_hook(keep(f"resid_mid.{i}", True)),
        ]
    try:
        trace = tl.trace(model, ids, save="all")
    finally:
        for h in handles:
            h.remove()
    names = (
        {
            "pre": "blocks.{L}.mlp.hook_pre",
            "post": "blocks.{L}.mlp.hook_post",
            "mlp_out": "blocks.{L}.hook_mlp_out",
            "resid_mid": "blocks.{L}.hook_resid_mid",
        }
        if generation != "4.x"
        else {
            "pre": "blocks.{L}.mlp.in.hook_out",
            "post": "blocks.{L}.mlp.out.hook_in",
            "mlp_out": "blocks.{L}.mlp.hook_out",
            "resid_mid": "blocks.{L}.ln2.hook_in",
        }
    )
    engine = {}
    for key, name in names.items():
        for i in range(2):
            res = mi.resolve_alias(trace, name.replace("{L}", str(i)), generation=generation)
            module = {
                "pre": ".fc1",
                "post": ".fc2",
                "mlp_out": ".fc2",
                "resid_mid": ".final_layer_norm" if generation == "4.x" else "",
            }[key]  # 2.x: the block's add
            assert (res.status, res.module_address) == (
                "real",
                f"model.decoder.layers.{i}{module}",
            ), res
            flat = seen[f"{key}.{i}"]  # [batch * pos, width], as the layer computed it
            engine[name.replace("{L}", str(i))] = flat.reshape(
                2, 5, -1
            )  # an engine's [batch, pos, width]
    report = mi.compare(trace, engine, generation=generation, atol=0, rtol=0)
    assert len(report) == 8 and report.mismatched == [], report
    # An unfolded LayerNorm's output handed as ln2's normalized: the explanation finds it in the
    # flattened layer (where the model computed it), not "matches no tensor".
    out = (
        trace.modules["model.decoder.layers.0.final_layer_norm"].facets["output"].reshape(2, 5, -1)
    )
    name = "blocks.0.ln2.hook_normalized"
    (row,) = mi.compare(trace, {name: out}, generation=generation)
    assert not row.passed and row.layout == "tokens unflattened", row
    assert row.explanation in (
        "equals model.decoder.layers.0.fc1:input",
        "equals blocks.0.mlp.hook_in",
    ), row.explanation  # fc1's input is the norm's output (4.x names it mlp.hook_in)
    # A model with an MLP module keeps reading it: no second site on GPT-2.
    gpt2 = tl.trace(testing.build("gpt2", "sdpa"), ids)
    assert (
        mi.resolve_alias(gpt2, "blocks.0.mlp.hook_pre", generation="2.x").module_address
        == "transformer.h.0.mlp"
    )


def test_a_position_embedding_shared_by_the_batch_compares_against_a_broadcast_one():
    """GPT-2's wpe output is [1, pos, d] for a batch of 2; TransformerLens broadcasts it to [2, pos, d]."""
    model = testing.build("gpt2", "sdpa")
    ids = testing.token_ids(2, 5)
    seen = {}
    handle = model.transformer.wpe.register_forward_hook(
        lambda m, a, o: seen.__setitem__("pos", o.detach().clone())
    )
    try:
        trace = tl.trace(model, ids)
    finally:
        handle.remove()
    assert seen["pos"].shape[0] == 1
    (row,) = mi.compare(
        trace, {"hook_pos_embed": seen["pos"].expand(2, -1, -1)}, generation="2.x", atol=0, rtol=0
    )
    assert row.passed and row.layout == "batch broadcast", row
    wrong = seen["pos"].expand(2, -1, -1).clone()
    wrong[1] += 1  # the second sequence's rows are not the shared ones
    (row,) = mi.compare(trace, {"hook_pos_embed": wrong}, generation="2.x", explain=False)
    assert not row.passed


def test_transformer_lens_qk_norm_hooks_are_rows_without_a_site():
    """TransformerLens 2.x caches q_norm/k_norm hooks on QK-norm models (Qwen3): compare lists
    them as structurally absent with the reason instead of raising UnknownAlias on the cache."""
    trace = tl.trace(testing.build("qwen3", "sdpa"), testing.token_ids())
    names = [f"blocks.0.attn.{w}_norm.hook_{h}" for w in "qk" for h in ("scale", "normalized")]
    report = mi.compare(trace, {n: torch.zeros(3) for n in names}, generation="2.x", explain=False)
    assert [c.name for c in report] == names
    assert all(
        c.status == "structurally_absent" and not c.passed and "QK-norm" in c.hint for c in report
    )


def test_a_norm_copied_per_head_compares_against_the_one_norm():
    """With use_split_qkv_input TransformerLens caches ln1.hook_scale/normalized per head."""
    trace = tl.trace(testing.build("llama", "sdpa"), testing.token_ids())
    norm = trace.modules["model.layers.0.input_layernorm"].facets
    per_head = {
        f"blocks.0.ln1.hook_{n}": norm[n].unsqueeze(2).expand(-1, -1, 4, -1)
        for n in ("scale", "normalized")
    }
    report = mi.compare(trace, per_head, generation="2.x", atol=0, rtol=0)
    assert report.mismatched == [] and {c.layout for c in report} == {"repeated per head"}, report
    bad = dict(per_head)
    bad["blocks.0.ln1.hook_scale"] = bad["blocks.0.ln1.hook_scale"].clone()
    bad["blocks.0.ln1.hook_scale"][:, :, 1] += 1  # one head's copy differs
    assert mi.compare(trace, bad, generation="2.x", explain=False).mismatched == [
        "blocks.0.ln1.hook_scale"
    ]


def test_hooked_encoder_cache_names_resolve_on_bert_against_plain_hooks():
    """Every name a HookedEncoder cache holds has a row (embed.ln, mlm_head.ln and the flag-gated
    ones); the sites hold what plain hooks see; an unknown name's hint reads the encoder table."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        max_position_embeddings=32,
    )
    model = tl.testing.from_config(cfg, transformers.BertForMaskedLM)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    seen, handles = {}, []
    for key, module, pre in [
        ("embed_ln", model.bert.embeddings.LayerNorm, False),
        ("head_ln", model.cls.predictions.transform.LayerNorm, False),
        ("mlp_in", model.bert.encoder.layer[0].attention.output.LayerNorm, True),
    ]:
        handles.append(
            module.register_forward_pre_hook(
                lambda m, a, key=key: seen.__setitem__(key, a[0].clone())
            )
            if pre
            else module.register_forward_hook(
                lambda m, a, o, key=key: seen.__setitem__(key, o.clone())
            )
        )
    try:
        trace = tl.trace(model, ids)
    finally:
        for h in handles:
            h.remove()
    engine = {
        "embed.ln.hook_normalized": seen["embed_ln"],
        "mlm_head.ln.hook_normalized": seen["head_ln"],
        "blocks.0.hook_mlp_in": seen["mlp_in"],
    }
    report = mi.compare(trace, engine, generation="2.x", atol=0, rtol=0)
    assert report.mismatched == [], report
    for name, status in [
        ("embed.ln.hook_scale", "reconstructed_read_only"),
        ("mlm_head.ln.hook_scale", "reconstructed_read_only"),
        ("blocks.1.hook_q_input", "structurally_absent"),
        ("blocks.1.attn.hook_result", "structurally_absent"),
    ]:
        assert mi.resolve_alias(trace, name, generation="2.x").status == status, name
    with pytest.raises(UnknownAlias, match="in 2.x the same site is 'mlm_head.ln.hook_scale'"):
        mi.resolve_alias(trace, "ln_final.hook_scale", generation="2.x")

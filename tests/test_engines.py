"""The peer engines, run for real, against TorchLens traces of the same weights.

Each test takes one engine on one configuration (GPT-2 or Llama, eager or sdpa attention),
reads every site the engine offers under the names TorchLens's tables know, and checks with
`torchlens.mechinterp.compare` that each tensor equals the one TorchLens resolves the name to.
The engine runs live in `tests/fixtures/engine_runs.py` (the engines are the rows of
`tests/fixtures/engines.py`), which `scripts/gen_verified.py` uses as well, so the "Verified
against" page counts exactly these comparisons.

An engine that is not installed skips its tests, except under `CI=true`, where it fails them
(the policy of the docs harness). The engines are imported only when a test needs one.
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from docs_harness import ci_is_on
from fixtures import engine_runs as er
from fixtures.engines import Engine

import torchlens.mechinterp as mi

CONFIGS = [pytest.param(f, i, id=f"{f}-{i}") for f in er.FAMILIES for i in er.IMPLS]


def require(engine: str) -> None:
    """Import the engine (or find its engine environment), or skip (fail under CI) when it is missing."""
    if engine in er.ENV_ENGINES:
        if not er.available(engine):
            message = f"{engine} runs in {er.env_python(engine).parent.parent}, which is not built (make engines)"
            if ci_is_on():
                pytest.fail(f"{message}; CI=true: every engine environment must be built")
            pytest.skip(message)
        return
    module = er.ENGINES[engine].module
    if ci_is_on():
        try:
            importlib.import_module(module)
        except ImportError as error:
            pytest.fail(
                f"{engine} is not importable ({error}); CI=true: every peer engine must be installed"
            )
    else:
        pytest.importorskip(module, reason=f"{engine} is not installed")


def assert_clean(run: er.Run) -> None:
    problems = run.problems()
    assert not problems, f"{run.label}:\n  " + "\n  ".join(problems) + f"\n{run.report!r}"
    assert run.compared == run.matched == len(run.expected) > 0


def _per_layer(names) -> set[str]:
    return {re.sub(r"\d+", "{L}", n) for n in names}


# -- nnsight and nnterp ------------------------------------------------------------------------

PROBS = {"attention_probabilities[0]", "attention_probabilities[1]"}


@pytest.mark.tool_nnsight
@pytest.mark.parametrize("family, impl", CONFIGS)
def test_nnsight_reads_every_nnterp_site(family, impl):
    """Block, attention, MLP, embedding and lm_head reads through plain nnsight module access,
    keyed by nnterp name: every row of the nnterp report is compared, and matches."""
    require("nnsight")
    run = er.nnsight_run(family, impl)
    assert_clean(run)
    assert set(run.expected) == {
        r.query for r in mi.alias_report(er.reference(family, impl), "nnterp")
    }
    assert run.compared == 19
    # Under sdpa the attention returns no weights; the pattern then comes from an eager copy
    # and is compared with TorchLens's reconstruction.
    assert set(run.from_eager_copy) == (set() if impl == "eager" else PROBS)


@pytest.mark.tool_nnterp
@pytest.mark.parametrize("family, impl", CONFIGS)
def test_nnterp_accessors(family, impl):
    """Every StandardizedTransformer accessor in the nnterp table, attention probabilities,
    token embeddings, logits and input ids included."""
    require("nnterp")
    run = er.env_run("nnterp", family, impl)  # in the nnterp environment (envs/nnterp.txt)
    assert_clean(run)
    assert run.compared == 19
    assert {"input_ids", "token_embeddings", "logits", *PROBS} <= {c.name for c in run.report}
    assert set(run.from_eager_copy) == (set() if impl == "eager" else PROBS)
    statuses = {c.name: c.status for c in run.report}
    expected_probs_status = "real" if impl == "eager" else "reconstructed_read_only"
    assert {statuses[p] for p in PROBS} == {expected_probs_status}


# -- interp-engine -----------------------------------------------------------------------------


@pytest.mark.tool_interp_engine
@pytest.mark.parametrize("family, impl", CONFIGS)
def test_interp_engine_captures_every_sited_address(family, impl):
    """Every address the interp-engine report gives a site is captured and matches; under
    eager interp-engine serves all of them, under sdpa all but the attention pair."""
    require("interp-engine")
    run = er.interp_engine_run(family, impl)
    assert_clean(run)
    trace = er.reference(family, impl)
    sited = [r.query for r in mi.alias_report(trace, "interp-engine") if r.status in er.HAS_SITE]
    assert list(run.expected) == sited and run.compared == len(sited)
    assert run.compared == {"gpt2": 28, "llama": 30}[family]
    refused = (
        set()
        if impl == "eager"
        else {"attn_scores.0", "attn_scores.1", "attn_probs.0", "attn_probs.1"}
    )
    assert set(run.from_eager_copy) == refused
    # What interp-engine serves here and the table lists without a site, as the user's spec has it:
    # the sublayer contributions (equal to attn_out / mlp_out on these families) and the final norm.
    assert set(run.no_site) == {
        "attn_out_post.0",
        "attn_out_post.1",
        "mlp_out_post.0",
        "mlp_out_post.1",
        "final_norm",
    }


# -- TransformerLens 4.x bridge ----------------------------------------------------------------


@pytest.mark.tool_transformer_lens
@pytest.mark.parametrize("family, impl", CONFIGS)
def test_transformer_lens_cache_keys(family, impl):
    """Every run_with_cache key is a 3.x name and either matches or is a name the tables mark
    without a site; the 4.x names among the keys match under 4.x, the 2.x names under 2.x."""
    require("transformer-lens")
    result = er.transformer_lens_result(family, impl)
    trace = er.reference(family, impl)
    full, canonical, legacy, flagged = result.runs
    for run in result.runs:
        assert_clean(run)
    assert result.attn_after_boot == "eager"  # boot switches even an sdpa model to eager

    assert set(full.expected) | set(full.no_site) == set(result.keys)
    for key in full.no_site:
        assert mi.resolve_alias(trace, key, generation="3.x").facet is None, (
            key
        )  # the table has no site
    no_site = {
        "gpt2": set(),
        "llama": {
            "rotary_emb.hook_in",
            "rotary_emb.hook_cos",
            "rotary_emb.hook_sin",
            "blocks.{L}.attn.hook_cos",
            "blocks.{L}.attn.hook_sin",
        },
    }[family]
    assert _per_layer(full.no_site) == no_site
    assert (full.compared, len(full.no_site)) == {"gpt2": (93, 0), "llama": (98, 7)}[family]

    # Keys are 4.x canonical names, 2.x names, or both; only hook_unembed is neither.
    assert set(result.keys) - set(canonical.expected) - set(canonical.no_site) - set(
        legacy.expected
    ) - set(legacy.no_site) == {"hook_unembed"}
    for run in (canonical, legacy):
        for c in run.report:  # the same tensor under the generation as under 3.x (2.x hook_embed is
            # the embedding lookup, 3.x's the module output: one tensor on GPT-2 and Llama)
            here = mi.resolve_alias(trace, c.name, generation=run.generation)
            there = mi.resolve_alias(trace, c.name, generation="3.x")
            assert here.module_address == there.module_address, c.name
            assert torch.equal(here.tensor, there.tensor), c.name

    # Every readable 3.x/4.x name appears in some cache, except the GPT-2-only hook_hidden_states.
    missing = {
        "gpt2": (),
        "llama": ("blocks.0.attn.hook_hidden_states", "blocks.1.attn.hook_hidden_states"),
    }
    assert result.not_in_cache["3.x"] == result.not_in_cache["4.x"] == missing[family]
    assert result.not_in_cache["2.x"] == (
        "hook_tokens",
    )  # HookedTransformer-only (cfg.use_hook_tokens)


@pytest.mark.tool_transformer_lens
@pytest.mark.parametrize("family, impl", CONFIGS)
def test_transformer_lens_flag_gated_hooks(family, impl):
    """set_use_attn_result, set_use_split_qkv_input, set_use_hook_mlp_in and set_use_attn_in:
    hook_result (bias excluded) and hook_mlp_in match; the per-head input copies have no
    TorchLens site and are, as the tables say, the pre-norm residual repeated over heads."""
    require("transformer-lens")
    result = er.transformer_lens_result(family, impl)
    flagged = result.runs[3]
    assert_clean(flagged)
    assert _per_layer(flagged.expected) == {"blocks.{L}.attn.hook_result", "blocks.{L}.hook_mlp_in"}
    assert _per_layer(flagged.no_site) == {
        f"blocks.{{L}}.{p}hook_{n}"
        for p in ("", "attn.")
        for n in ("q_input", "k_input", "v_input", "attn_in")
    }
    assert all(v == () for v in result.flag_changed.values()), result.flag_changed
    assert all(result.per_head_resid.values()) and len(result.per_head_resid) == 16, (
        result.per_head_resid
    )
    # The bridge stops firing the q/k/v projection inputs once they are split per head, and the
    # output projection's hook_out once it computes per-head results.
    dropped = {k: _per_layer(v) for k, v in result.flag_dropped.items()}
    assert dropped == {
        "set_use_attn_result+set_use_split_qkv_input+set_use_hook_mlp_in": {
            "blocks.{L}.attn.q.hook_in",
            "blocks.{L}.attn.k.hook_in",
            "blocks.{L}.attn.v.hook_in",
            "blocks.{L}.attn.o.hook_out",
        },
        "set_use_attn_in": {
            "blocks.{L}.attn.q.hook_in",
            "blocks.{L}.attn.k.hook_in",
            "blocks.{L}.attn.v.hook_in",
        },
    }


@pytest.mark.tool_transformer_lens
def test_transformer_lens_norm_conventions_are_discriminating():
    """The bridge's hook_normalized is pre-gain, like TorchLens's `normalized`. The check means
    something only if the gain changes the tensor: the test models perturb every norm gain."""
    require("transformer-lens")
    trace = er.reference("gpt2", "eager")
    pre = mi.resolve_alias(trace, "blocks.0.ln1.hook_normalized", generation="4.x").tensor
    post = mi.resolve_alias(trace, "blocks.0.ln1.hook_out", generation="4.x").tensor
    assert not torch.allclose(pre, post, atol=1e-3)
    run = er.transformer_lens_result("gpt2", "eager").runs[1]
    assert {
        "blocks.0.ln1.hook_normalized",
        "blocks.0.ln1.hook_scale",
        "ln_final.hook_normalized",
    } <= {c.name for c in run.report if c.passed}


# -- TransformerLens 2.x HookedTransformer and vLLM, in their engine environments ---------------


@pytest.mark.tool_transformer_lens
@pytest.mark.parametrize("family", er.FAMILIES)
def test_transformer_lens_2_hooked_transformer_keys(family):
    """Every run_with_cache key of a real TransformerLens 2.x HookedTransformer (weights converted
    by TransformerLens itself) is a 2.x name with a TorchLens site, and matches. With
    fold_ln=False, GPT-2's LayerNorm hooks hook_normalized after the gain (the 2.x convention the
    tables note), so exactly those keys read another tensor; Llama's RMSNorm is unaffected."""
    require("transformer-lens-2")
    folded = er.env_run("transformer-lens-2", family, "sdpa", 0)
    unfolded = er.env_run("transformer-lens-2", family, "sdpa", 1)
    assert_clean(folded)
    assert_clean(unfolded)
    assert folded.no_site == {} and folded.compared == {"gpt2": 38, "llama": 43}[family]
    moved = set(folded.expected) - set(unfolded.expected)
    assert _per_layer(moved) == (
        {"blocks.{L}.ln{L}.hook_normalized", "ln_final.hook_normalized"}
        if family == "gpt2"
        else set()
    )
    assert not any(
        r.family == family and r.impl == "eager" for r in er.env_runs("transformer-lens-2")
    )


@pytest.mark.tool_vllm
@pytest.mark.parametrize("family", ("llama", "qwen3", "gpt2"))
def test_vllm_recipe_matches_every_site(family):
    """The serving-engines page's vLLM recipe, run in the vllm environment: every one of the 24
    sites of the page's table (embedding, eleven per layer, final norm) matches in float32."""
    require("vllm")
    run = er.env_run("vllm", family, "sdpa")
    assert_clean(run)
    assert run.compared == 24
    assert {c.status for c in run.report} == {"real"}


def test_a_missing_engine_skips_locally_and_fails_under_ci(monkeypatch):
    absent = Engine("absent-engine", "Absent", "absent-engine", "torchlens_no_such_engine_module")
    monkeypatch.setitem(er.ENGINES, "absent-engine", absent)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        require("absent-engine")
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception):
        require("absent-engine")


def test_a_missing_engine_environment_skips_locally_and_fails_under_ci(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHLENS_ENGINE_ENVS", str(tmp_path))  # no environment is built there
    monkeypatch.setenv("CI", "true")
    with pytest.raises(
        pytest.fail.Exception, match="CI=true: every engine environment must be built"
    ):
        require("vllm")
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="not built"):
        require("vllm")


# -- conventions compare reports (no engine needed) --------------------------------------------


def test_compare_names_the_unfolded_layernorm_convention():
    """TransformerLens 2.x hooks hook_normalized after the gain on an unfolded LayerNorm (checked
    with TL 2.18: HookedTransformer with fold_ln=False). compare fails such a row and says so;
    the pre-gain tensor of a folded model passes."""
    trace = er.reference(
        "gpt2", "eager"
    )  # norm gains and biases perturbed: pre- and post-gain differ
    post = mi.resolve_alias(trace, "blocks.0.ln2.hook_out", generation="4.x").tensor
    pre = mi.resolve_alias(trace, "blocks.0.ln2.hook_normalized", generation="2.x").tensor
    row = mi.compare(trace, {"blocks.0.ln2.hook_normalized": post}, generation="2.x")[0]
    assert not row.passed and "fold_ln=False" in row.hint
    assert mi.compare(trace, {"blocks.0.ln2.hook_normalized": pre}, generation="2.x").ok
    # A computed (reconstructed) facet that differs for another reason is not blamed on a fused kernel.
    scale = mi.resolve_alias(trace, "blocks.0.ln2.hook_scale", generation="2.x").tensor
    row = mi.compare(trace, {"blocks.0.ln2.hook_scale": 2 * scale}, generation="2.x")[0]
    assert row.status == "reconstructed_read_only" and not row.passed
    assert "fused kernel" not in row.hint and "computed" in row.hint

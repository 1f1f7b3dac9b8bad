"""The model zoo: 33 tiny transformers architectures, each checked against ground truth outside TorchLens.

The zoo, its checks and the coverage page live in `scripts/gen_coverage.py` (the page is generated
from the same run). This file runs the zoo once, asserts every check of every architecture, and
checks that the committed page `docs/guides/coverage.md` is the one this run renders.
"""

from __future__ import annotations

import pathlib

import pytest
import script_modules

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gen_coverage.py"


gen = script_modules.load("gen_coverage")


@pytest.fixture(scope="module")
def results():
    return {r.name: r for r in gen.run_zoo()}


def test_zoo_is_large_and_varied():
    kinds = {a.kind for a in gen.ZOO}
    assert len(gen.ZOO) >= 25
    assert kinds == {"decoder-only", "encoder-only", "encoder-decoder", "multi-tower"}


@pytest.mark.parametrize("arch", [a.name for a in gen.ZOO])
def test_architecture(results, arch):
    r = results[arch]
    assert not r.failures, "\n".join(r.failures)
    assert r.counts.get("structure") == len(r.variants) and r.variants, r.counts
    assert r.counts.get("hooks", 0) >= 4 * len(r.variants)
    spec = next(a for a in gen.ZOO if a.name == arch)
    if spec.hidden:
        assert r.counts.get("hidden_states", 0) >= 2 * len(r.variants)
    if spec.attentions:
        assert r.counts.get("attentions", 0) >= 2
    if spec.unembed:
        assert r.counts.get("logits") == len(r.variants)


def test_every_variant_the_model_supports_ran(results):
    for r in results.values():
        dtypes = {v.split(" ")[0].split("/")[1] for v in r.variants}
        assert dtypes == {"float32", "bfloat16"}, (r.name, r.variants)
        impls = {v.split("/")[0] for v in r.variants}
        assert impls == {"eager", "sdpa"} or (impls == {"eager"} and r.unsupported), (r.name, r.variants)
    padded = [r.name for r in results.values() if any("left-padded" in v for v in r.variants)]
    assert len(padded) >= 20


def test_coverage_page_is_current(results):
    committed = gen.PAGE.read_text(encoding="utf-8")
    rendered = gen.render(list(results.values()))
    assert committed == rendered, "docs/guides/coverage.md is stale: run python scripts/gen_coverage.py"


def test_a_wrong_structure_is_reported():
    """The checks can fail: a spec naming the wrong MLP, and a wrong layer count, are both reported."""
    import dataclasses

    llama = next(a for a in gen.ZOO if a.name == "Llama")
    stack = llama.stacks["model.layers"]
    wrong = dataclasses.replace(llama, stacks={"model.layers": dataclasses.replace(stack, mlp="post_attention_layernorm")})
    r = gen.run_arch(wrong)
    assert r.failures and all("expected 'model.layers.0.post_attention_layernorm'" in f for f in r.failures)
    wrong = dataclasses.replace(llama, stacks={"model.layers": dataclasses.replace(stack, n=3)})
    assert all("stacks model.layers (2 layers)" in f for f in gen.run_arch(wrong).failures)

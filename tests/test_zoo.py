"""The model zoo: 33 tiny transformers architectures, each checked against ground truth outside TorchLens.

The zoo and its checks live in `tests/fixtures/zoo.py`, the families and the structure each must
be found to have in `torchlens.testing.FAMILIES`, and the coverage page is rendered by
`scripts/gen_coverage.py` from the same run. This file runs the zoo once, asserts every check of
every architecture, and checks that the committed page `docs/guides/coverage.md` is the one this
run renders.
"""

from __future__ import annotations

import pytest
import script_modules
from fixtures import zoo

from torchlens import testing

gen = script_modules.load("gen_coverage")


@pytest.fixture(scope="module")
def results():
    return {r.name: r for r in zoo.run_zoo()}


def test_zoo_is_large_and_varied():
    kinds = {testing.FAMILIES[n].structure.kind for n in zoo.ZOO}
    assert len(zoo.ZOO) >= 25
    assert kinds == {"decoder-only", "encoder-only", "encoder-decoder", "multi-tower"}


@pytest.mark.parametrize("arch", [testing.FAMILIES[n].title for n in zoo.ZOO])
def test_architecture(results, arch):
    r = results[arch]
    assert not r.failures, "\n".join(r.failures)
    assert r.counts.get("structure") == len(r.variants) and r.variants, r.counts
    assert r.counts.get("hooks", 0) >= 4 * len(r.variants)
    spec = next(f.structure for f in testing.FAMILIES.values() if f.title == arch)
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
        assert impls == {"eager", "sdpa"} or (impls == {"eager"} and r.unsupported), (
            r.name,
            r.variants,
        )
    padded = [r.name for r in results.values() if any("left-padded" in v for v in r.variants)]
    assert len(padded) >= 20


def test_the_registry_names_the_attention_implementations_transformers_runs(results):
    """A family's `attn_implementations` (what `testing.build` accepts) are the ones the zoo could
    run: the zoo tries both, and transformers refuses the others."""
    for name in zoo.ZOO:
        family = testing.FAMILIES[name]
        ran = {v.split("/")[0] for v in results[family.title].variants}
        assert ran == set(family.attn_implementations), (name, ran)


def test_coverage_page_is_current(results):
    committed = gen.PAGE.read_text(encoding="utf-8")
    rendered = gen.render(list(results.values()))
    assert committed == rendered, (
        "docs/guides/coverage.md is stale: run python scripts/gen_coverage.py"
    )


def test_a_wrong_structure_is_reported():
    """The checks can fail: a spec naming the wrong MLP, a wrong layer count and a wrong embedding
    are each reported."""
    import dataclasses

    llama = testing.FAMILIES["llama"]
    stack = llama.structure.stacks["model.layers"]

    def with_structure(**changes):
        return dataclasses.replace(llama, structure=dataclasses.replace(llama.structure, **changes))

    wrong = with_structure(
        stacks={"model.layers": dataclasses.replace(stack, mlp="post_attention_layernorm")}
    )
    r = zoo.run_family(wrong)
    assert r.failures and all(
        "expected 'model.layers.0.post_attention_layernorm'" in f for f in r.failures
    )
    wrong = with_structure(stacks={"model.layers": dataclasses.replace(stack, n=3)})
    assert all("stacks model.layers (2 layers)" in f for f in zoo.run_family(wrong).failures)
    wrong = with_structure(embed="lm_head")
    assert all(
        "token embedding 'model.embed_tokens', expected 'lm_head'" in f
        for f in zoo.run_family(wrong).failures
    )

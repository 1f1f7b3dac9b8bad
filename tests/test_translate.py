"""`torchlens.mechinterp.translate` against resolving both names on real traces.

The reference for every answer is `resolve_alias` run on a trace of each family of
`torchlens.testing.FAMILIES`, one name at a time: a translation is right when the names it gives
resolve to the module call and facet the translated name resolves to, and no other name does.
That is checked for every name of every generation into every other generation, on every
family; the answers from the tables alone (no model) are checked against the same traces.
"""

from __future__ import annotations

import functools
import itertools

import pytest

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing
from torchlens._naming import targets as _targets
from torchlens.mechinterp import _translate

GENERATIONS = list(mi.GENERATIONS)
PAIRS = [(a, b) for a, b in itertools.permutations(GENERATIONS, 2)]


@functools.cache
def family_trace(family: str) -> tl.Trace:
    """A trace built here, not through translate's cache: the reference side of every check."""
    args, kwargs = testing.inputs(family)
    return tl.trace(testing.build(family), *args, save="all", **kwargs)


def names_of(generation: str, trace: tl.Trace) -> list[str]:
    """Every name of the generation's table as it is written on `trace`: each layer of a per-layer row."""
    table = mi.GENERATIONS[generation]
    table = dict(table.by_kind).get(trace.structure.kind, table)
    out = []
    for row in table.rows:
        if not row.per_layer:
            out.append(row.name)
        elif table.absent_once and row.facet is None:
            out.append(row.bare)
        else:
            out += [row.name.replace("{L}", str(layer)) for layer in range(len(trace.blocks))]
    return out


@functools.cache
def sites(family: str, generation: str) -> dict[str, tuple | None]:
    """name -> the site `resolve_alias` gives it on the family's trace, (module, call, facet), or None."""
    trace = family_trace(family)
    out = {}
    for name in names_of(generation, trace):
        r = mi.resolve_alias(trace, name, generation=generation)
        readable = r.module_address is not None and r.facet is not None
        out[name] = (
            (r.module_address, r.call, r.facet)
            if readable and r.status not in ("structurally_absent", "ambiguous")
            else None
        )
    return out


def expected(family: str, name: str, source: str, target: str) -> tuple[str, list[str]]:
    site = sites(family, source)[name]
    if site is None:
        return "no_site", []
    names = [n for n, s in sites(family, target).items() if s == site]
    return ("same_site" if names else "no_name"), names


@pytest.mark.parametrize("family", list(testing.FAMILIES))
def test_every_answer_on_every_family_is_what_resolving_both_names_gives(family):
    checked, statuses = 0, set()
    for source, target in PAIRS:
        for name in sites(family, source):
            got = mi.translate(name, from_generation=source, to_generation=target, family=family)
            status, names = expected(family, name, source, target)
            assert (got.status, sorted(got.names)) == (status, sorted(names)), (
                family,
                source,
                target,
                name,
                got,
            )
            assert got.family == family and got.reason
            checked += 1
            statuses.add(got.status)
    # Not vacuous: every family reads some name of one generation under another's name.
    assert checked > 200 and "same_site" in statuses, (checked, statuses)


def test_a_trace_passed_in_gives_the_answers_of_its_family():
    trace = family_trace("gemma2")
    for name in ("blocks.1.hook_mlp_out", "blocks.0.attn.hook_pattern", "hook_embed"):
        mine = mi.translate(name, from_generation="2.x", to_generation="4.x", trace=trace)
        status, names = expected("gemma2", name, "2.x", "4.x")
        assert (mine.status, sorted(mine.names), mine.family) == (status, sorted(names), None)


def test_gemma2_hook_mlp_out_has_no_4x_or_nnterp_name():
    """The case a reader hit: 2.x hook_mlp_out reads the post-MLP norm on Gemma-2, which 4.x and nnterp do not name."""
    for target in ("4.x", "nnterp"):
        got = mi.translate(
            "blocks.1.hook_mlp_out", from_generation="2.x", to_generation=target, family="gemma2"
        )
        assert got.status == "no_name" and got.names == ()
        assert got.site == "model.layers.1.post_feedforward_layernorm:output"
    on_gpt2 = mi.translate(
        "blocks.1.hook_mlp_out", from_generation="2.x", to_generation="nnterp", family="gpt2"
    )
    assert on_gpt2.names == ("mlps_output[1]",)


def _table_rows(generation: str):
    table = mi.GENERATIONS[generation]
    for row in table.rows:
        if not row.per_layer:
            yield row, row.name
        elif table.absent_once and row.facet is None:
            yield row, row.bare
        else:
            yield row, row.name.replace("{L}", "1")


@pytest.mark.parametrize("source,target", PAIRS)
def test_answers_from_the_tables_hold_on_every_family(source, target):
    """Without a model: `same_site` names read the site on every family (and `also` lists any other name a
    family gives); `no_name` means no family's trace
    has a name for it; a `depends_on_family` answer lists every name some family gives; `no_site` names have
    no site on any family."""
    seen = set()
    for row, name in _table_rows(source):
        got = mi.translate(name, from_generation=source, to_generation=target)
        seen.add(got.status)
        for family in testing.FAMILIES:
            if family_trace(family).structure.kind != "decoder-only":
                continue
            status, names = expected(family, name, source, target)
            where = (source, target, name, family, got)
            if got.status == "no_site":
                assert status == "no_site", where
            elif got.status == "same_site" and status != "no_site":
                assert set(got.names) <= set(names) <= set(got.names + got.also), where
            elif got.status == "no_name":
                assert names == [], where
            else:
                assert set(names) <= set(got.names), where
    assert "same_site" in seen


def test_without_a_model_a_negative_layer_depends_on_the_depth():
    got = mi.translate("layers_output[-1]", from_generation="nnterp", to_generation="2.x")
    assert got.status == "depends_on_family" and "depth" in got.reason
    on_trace = mi.translate(
        "layers_output[-1]", from_generation="nnterp", to_generation="2.x", family="llama"
    )
    assert on_trace.names == ("blocks.1.hook_resid_post",)
    same = mi.translate("layers_output[-1]", from_generation="nnterp", to_generation="nnterp")
    assert same.status == "same_site" and same.names == ("layers_output[-1]",)


def test_the_shared_modules_are_exactly_the_target_pairs_some_family_finds_on_one_module():
    found = set()
    for family in testing.FAMILIES:
        trace = family_trace(family)
        calls: dict[tuple, set[str]] = {}
        for target, row in _targets.TARGETS.items():
            for layer in range(len(trace.blocks)) if row.per_layer else [None]:
                call, _ = _targets.find_call(trace, target, layer)
                if call is not None:
                    calls.setdefault((call.address, call.index), set()).add(target)
        for targets in calls.values():
            found |= {frozenset(pair) for pair in itertools.combinations(sorted(targets), 2)}
    assert found == _translate.SHARED_MODULES


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(name="blocks.0.hook_resid_pst"), mi.UnknownAlias, "'blocks.0.hook_resid_post'"),
        (dict(name="blocks.0.hook_in"), mi.UnknownAlias, "It is a name of 3.x and 4.x"),
        (dict(name="blocks.01.hook_resid_post"), mi.MalformedAlias, "write the layer as 1"),
        (dict(name="  "), mi.UnknownAlias, "non-empty string"),
        (
            dict(name="blocks.0.hook_resid_post", from_generation="2x"),
            mi.UnknownGeneration,
            "Did you mean '2.x'",
        ),
        (
            dict(name="blocks.0.hook_resid_post", to_generation="nnterpp"),
            mi.UnknownGeneration,
            "'nnterp'",
        ),
        (
            dict(name="blocks.0.hook_resid_post", family="gpt-2"),
            mi.UnknownFamily,
            "Did you mean 'gpt2'",
        ),
        (
            dict(name="blocks.0.hook_resid_post", family="gpt2", trace="any"),
            mi.UnknownFamily,
            "not both",
        ),
        (
            dict(name="blocks.9.hook_resid_post", family="gpt2"),
            mi.LayerOutOfRange,
            "layers are 0..1",
        ),
    ],
)
def test_a_bad_argument_raises_a_torchlens_error_that_says_what_is_accepted(kwargs, error, words):
    kwargs = {"from_generation": "2.x", "to_generation": "4.x", **kwargs}
    with pytest.raises(error) as caught:
        mi.translate(**kwargs)
    assert isinstance(caught.value, tl.TorchLensError)
    assert words in str(caught.value)

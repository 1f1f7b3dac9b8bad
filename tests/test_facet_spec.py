"""The facet specification (torchlens._core.facet_spec, an internal module) and the checks built on it.

- Each row's layout is checked against real tensors: a Llama with grouped-query attention and
  a GPT-2 are traced, and every facet's shape is compared with its axes sized from the model's
  config (not from TorchLens).
- Each import-time invariant of the rows, and of the naming tables (torchlens._naming.tables),
  is shown failing on a planted bad row.
- The sets other modules derive (per-head, kv-head, hook sides, remedies) are compared with
  literals written here.

Tests internals: `torchlens._core.facet_spec` (`FacetSpec`, `FacetSpecError`, `check_rows`, `SPECS`,
`BY_NAME`, `FACETS`, `ALL_FACETS`, `EVERY_MODULE`, `absent_reason` and the derived sets
`PER_HEAD`, `TOKEN_MAJOR`, `HEAD_MAJOR`, `KV_HEADS`, `KERNEL_REBUILT`, `HOOK_SIDES`, `REMEDIES`),
`torchlens._naming.tables` (`Row`, `Table`, `TableError`, imported from there),
`torchlens._naming.targets` (`TARGETS`, `check_targets`) and `torchlens._core.roles.ROLES`.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import transformers

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens._core import facet_spec as spec
from torchlens._core.facet_spec import FacetSpec, FacetSpecError, check_rows
from torchlens._naming.tables import Row, Table, TableError

IDS = torch.tensor([[1, 2, 3, 4]])


def _row(name: str, **changes) -> FacetSpec:
    return dataclasses.replace(spec.BY_NAME[name], **changes)


# -- the rows against real tensors ----------------------------------------------------------------


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        vocab_size=64,
        max_position_embeddings=16,
    )
    cfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(cfg).eval(), cfg


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    cfg._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(cfg).eval(), cfg


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_every_facet_has_the_layout_its_row_gives(build):
    model, cfg = build()
    heads = cfg.num_attention_heads
    d_model = cfg.hidden_size
    size = {
        "batch": 1,
        "pos": 4,
        "query": 4,
        "key": 4,
        "heads": heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "d_head": d_model // heads,
        "d_model": d_model,
        "d_mlp": getattr(cfg, "intermediate_size", None) or 4 * d_model,
        "vocab": cfg.vocab_size,
        "1": 1,
    }
    trace = tl.trace(model, IDS)
    checked = set()
    for rec in trace.modules.values():
        for call in rec.calls:
            for name, site in call.facets.sites.items():
                row = spec.BY_NAME[name]
                assert rec.role in row.roles or spec.EVERY_MODULE in row.roles, (
                    rec.address,
                    name,
                    rec.role,
                )
                if not row.axes or site.kind == "refused":
                    continue
                assert tuple(site.shape) == tuple(size[a] for a in row.axes), (
                    rec.address,
                    name,
                    row.axes,
                )
                checked.add(name)
    # `contribution` exists only where a block changes a sublayer's output before adding it
    # (tests/test_contribution_names.py checks its layout there); Llama and GPT-2 add it as it is.
    absent = {"contribution"} | (
        {"inv_std"} if build is _llama else {"inv_rms", "pre_linear", "gated_out", "rot_q", "rot_k"}
    )
    assert checked == set(spec.ALL_FACETS) - {"input", "output"} - absent


# -- the rows' invariants, each failing on a planted row ----------------------------------------------


@pytest.mark.parametrize(
    "rows,message",
    [
        ((spec.BY_NAME["q"], spec.BY_NAME["q"]), "appears twice"),
        ((_row("q", roles=("attn",)),), "roles ['attn'] unknown"),
        ((_row("q", roles=()),), "roles [] unknown"),
        ((_row("q", axes=("batch", "pos", "heads", "dhead")),), "axes ['dhead'] unknown"),
        ((_row("q", heads_axis=None),), "heads_axis is None"),
        ((_row("q", heads_axis=1),), "must index the one 'heads' axis"),
        ((_row("k", kv_heads=False),), "must index the one 'heads' axis"),
        ((_row("q", kv_heads=True),), "must index the one 'kv_heads' axis"),
        ((_row("resid_pre", kv_heads=True),), "heads_axis is None"),
        ((_row("q", source="real"),), "'real' is not a source"),
        ((_row("q", fused="rebuilt"),), "'rebuilt' is not a source"),
        ((_row("resid_post", hooks=()),), "an 'io' facet names the hooks"),
        ((_row("q", hooks=(("attention", "out"),)),), "an 'io' facet names the hooks"),
        ((_row("resid_post", hooks=(("block", "output"),)),), "must be (a role, 'in' or 'out')"),
        ((_row("result", remedy=""),), "needs a remedy"),
        ((_row("q", remedy="edit something else"),), "needs a remedy"),
        ((_row("q", prose=""),), "prose is empty"),
    ],
)
def test_a_planted_bad_row_is_refused(rows, message):
    with pytest.raises(FacetSpecError, match=re.escape(message)) as info:
        check_rows(rows)
    assert repr(rows[-1].name) in str(info.value)


def test_the_shipped_rows_pass():
    check_rows(spec.SPECS)


# -- what consumers derive, against literals ------------------------------------------------------


def test_derived_sets():
    assert spec.PER_HEAD == {"q", "k", "v", "rot_q", "rot_k", "z", "result"}
    assert spec.TOKEN_MAJOR == {"q", "k", "v", "rot_q", "rot_k", "result"}
    assert spec.HEAD_MAJOR == {"z", "scores", "pattern"}
    assert spec.KV_HEADS == {"k", "v", "rot_k"}
    assert spec.KERNEL_REBUILT == {"scores", "pattern"}
    assert spec.HOOK_SIDES == {
        "input": "in",
        "resid_pre": "in",
        "indices": "in",
        "output": "out",
        "resid_post": "out",
    }
    assert set(spec.REMEDIES) == {
        "scores",
        "pattern",
        "result",
        "normalized",
        "inv_rms",
        "inv_std",
        "scale",
    }
    assert spec.BY_NAME["logits"].retain == () and spec.BY_NAME["final_norm_input"].hooks == (
        ("norm", "in"),
    )
    assert spec.BY_NAME["pattern"].retain == ("attention",)


def test_facets_keeps_its_shape():
    """`FACETS` (role -> facet -> prose) and `ALL_FACETS` are imported elsewhere: same shape, same order."""
    assert list(spec.FACETS) == ["any", "block", "attention", "mlp", "norm", "embedding", "root"]
    assert list(spec.FACETS["attention"]) == [
        "q",
        "k",
        "v",
        "rot_q",
        "rot_k",
        "scores",
        "pattern",
        "z",
        "result",
        "contribution",
    ]
    assert spec.FACETS["block"]["resid_pre"].startswith("[batch, pos, d_model] ")
    assert spec.ALL_FACETS == {n for t in spec.FACETS.values() for n in t}
    assert tl.FACETS is spec.FACETS


def test_absent_reason():
    assert (
        spec.absent_reason("pre_linear")
        == "the MLP is not gated (one input projection, no linear branch)"
    )
    assert spec.absent_reason("q") == "the module does not compute it"
    with pytest.raises(FacetSpecError, match="Did you mean 'resid_post'"):
        spec.absent_reason("resid_pst")


# -- the naming tables, validated at construction ------------------------------------------------------


@pytest.mark.parametrize(
    "rows,kwargs,message",
    [
        (
            (Row("blocks.{L}.hook_x", "block", "resid_pst", "m"),),
            {},
            "facet 'resid_pst' is not a facet",
        ),
        (
            (Row("blocks.{L}.hook_x", "blocks", "resid_post", "m"),),
            {},
            "target 'blocks' is not a target",
        ),
        (
            (Row("blocks.{L}.hook_x", "ln1", "q", "m"),),
            {},
            "facet 'q' belongs to ['attention'] modules",
        ),
        ((Row("blocks.{L}.hook_x", "block", None, "m"),), {}, "a row names both"),
        (
            (Row("blocks.{L}.hook_x", "block", "resid_post", "m", stack="encoders"),),
            {},
            "stack='encoders'",
        ),
        (
            (Row("x", "root", "logits", "m"), Row("x", "unembed", "output", "m")),
            {},
            "appears twice",
        ),
        (
            (
                Row("blocks.{L}.hook_x", "block", "resid_post", "m"),
                Row("blocks.0.hook_x", "block", "resid_pre", "m"),
            ),
            {},
            "also matches 'blocks.0.hook_x'",
        ),
        (
            (Row("x", "root", "logits", "m"),),
            {"unmapped": {"x": "why"}},
            "both a row and an unmapped name",
        ),
        (
            (Row("x.{L}", None, None, "m"), Row("x", "root", "logits", "m")),
            {"absent_once": True},
            "also matches 'x'",
        ),
        (
            (Row("blocks.{L}.hook_x", "mlp", "pre", "m", or_else=("pre_ln_mlp_up", "output")),),
            {},
            "target 'pre_ln_mlp_up' is not a target",
        ),
        (
            (Row("blocks.{L}.hook_x", "mlp", "pre", "m", or_else=("ln2", "q")),),
            {},
            "facet 'q' belongs to ['attention'] modules, but target 'ln2' finds a norm module",
        ),
        (
            (Row("blocks.{L}.hook_x", None, None, "m", or_else=("pre_ln_mlp_in", "output")),),
            {},
            "or_else gives a second site to a row that has none",
        ),
    ],
)
def test_a_planted_bad_table_is_refused(rows, kwargs, message):
    with pytest.raises(TableError, match=re.escape(message)) as info:
        Table("x", "planted", rows, **kwargs)
    assert "'planted'" in str(info.value)


def test_a_mistyped_facet_in_a_shipped_table_fails_at_import():
    """The real tables go through the same check: a mistyped facet in one of them is refused."""
    table = mi.GENERATIONS["nnterp"]
    rows = list(table.rows)
    rows[0] = dataclasses.replace(rows[0], facet="resid_pr")
    with pytest.raises(TableError, match=r"row 'layers_input\[\{L\}\]': facet 'resid_pr'"):
        dataclasses.replace(table, rows=tuple(rows))


def test_every_target_has_roles():
    from torchlens._core.roles import ROLES
    from torchlens._naming import targets as _targets

    assert all(
        t.roles and set(t.roles) <= set(ROLES) and t.name == name
        for name, t in _targets.TARGETS.items()
    )
    block = _targets.TARGETS["block"]
    with pytest.raises(tl.TorchLensError, match="names roles"):
        _targets.check_targets((dataclasses.replace(block, roles=("blok",)),))
    with pytest.raises(tl.TorchLensError, match="two targets"):
        _targets.check_targets((block, block))

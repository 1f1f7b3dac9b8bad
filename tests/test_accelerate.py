"""Models dispatched with accelerate: weights on the meta device, moved in by hooks.

A dispatched model must trace as its undispatched twin does: the same ops with the same data
flow (weights named as parameters, not as outputs of the hooks' moves), facets equal to forward
hooks on the undispatched model and to the undispatched trace's, and the model left exactly as
accelerate set it up (hooks restored, weights back on meta), also when the forward raises.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from accelerate import cpu_offload, disk_offload, dispatch_model
from accelerate.hooks import ModelHook, add_hook_to_module

import torchlens as tl
from torchlens import testing

IDS = testing.token_ids(length=6)


def _dispatch(model, how, tmp_path):
    cpu = torch.device("cpu")
    if how == "cpu_offload":
        return cpu_offload(model, execution_device=cpu)
    if how == "disk_offload":
        return disk_offload(model, str(tmp_path / "offload"), execution_device=cpu)
    # device_map: the embeddings and the first block in memory, the rest offloaded to disk.
    return dispatch_model(
        model, device_map=DEVICE_MAPS[type(model).__name__], offload_dir=str(tmp_path / "offload")
    )


DEVICE_MAPS = {
    "GPT2LMHeadModel": {
        "transformer.wte": "cpu",
        "transformer.wpe": "cpu",
        "transformer.drop": "cpu",
        "transformer.h.0": "cpu",
        "transformer.h.1": "disk",
        "transformer.ln_f": "disk",
        "lm_head": "cpu",
    },  # tied to wte: on the same device
    "LlamaForCausalLM": {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "disk",
        "lm_head": "disk",
    },
}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("how", ["cpu_offload", "disk_offload", "device_map"])
def test_dispatched_model_traces_like_the_undispatched_one(tmp_path, family, how):
    plain = testing.build(family, "sdpa")
    reference = tl.trace(plain, IDS)
    model = _dispatch(testing.build(family, "sdpa"), how, tmp_path)
    assert any(p.is_meta for p in model.parameters())  # weights really are offloaded
    hooks_before = {a: m._hf_hook for a, m in model.named_modules() if hasattr(m, "_hf_hook")}
    t = tl.trace(model, IDS)
    # Same ops, same data flow: weights appear as parameter names, not as the hooks' moves.
    assert [(o.name, o.module, o.inputs, o.shapes) for o in t.ops] == [
        (o.name, o.module, o.inputs, o.shapes) for o in reference.ops
    ]
    # Values: forward hooks on the undispatched model, then every facet of the undispatched trace.
    addresses = t.blocks + t.by_role("attention") + t.by_role("mlp")
    seen = testing.hooked_outputs(plain, addresses, IDS)
    for a in addresses:
        facet = "resid_post" if a in t.blocks else "output"
        torch.testing.assert_close(t.modules[a].facets[facet], seen[a], rtol=0, atol=0)
    for address, rec in reference.modules.items():
        for call, other in zip(rec.calls, t.modules[address].calls, strict=True):
            assert set(call.facets.sites) == set(other.facets.sites), address
            for name, site in call.facets.sites.items():
                got = other.facets.sites[name]
                assert (got.kind, tuple(got.shape)) == (site.kind, tuple(site.shape)), (
                    address,
                    name,
                )
                if site.tensor is not None:
                    assert got.tensor is not None and not got.tensor.is_meta, (address, name)
                    torch.testing.assert_close(got.tensor, site.tensor, rtol=1e-6, atol=1e-6)
    # The model is left as accelerate set it up.
    assert {
        a: m._hf_hook for a, m in model.named_modules() if hasattr(m, "_hf_hook")
    } == hooks_before
    assert any(p.is_meta for p in model.parameters())
    torch.testing.assert_close(model(IDS).logits, plain(IDS).logits, rtol=0, atol=0)


def test_hooks_are_restored_when_a_dispatched_forward_raises(tmp_path):
    model = cpu_offload(testing.build("gpt2", "sdpa"), execution_device=torch.device("cpu"))
    hooks_before = {a: m._hf_hook for a, m in model.named_modules() if hasattr(m, "_hf_hook")}
    with pytest.raises(IndexError):
        tl.trace(model, IDS + testing.VOCAB)  # token ids outside the embedding
    assert {
        a: m._hf_hook for a, m in model.named_modules() if hasattr(m, "_hf_hook")
    } == hooks_before
    t = tl.trace(model, IDS)
    assert len(t.blocks) == 2


class _CopyingHook(ModelHook):
    """What accelerate's hook does on a model spread over devices, on one device: every tensor
    going into the module, and its output, is replaced by a copy (`send_to_device` to another
    device returns a new tensor; to the same device it returns the tensor itself, so the offload
    tests above never see a moved tensor)."""

    @staticmethod
    def _copy(value):
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, (tuple, list)):
            return type(value)(_CopyingHook._copy(v) for v in value)
        if isinstance(value, dict):
            return {k: _CopyingHook._copy(v) for k, v in value.items()}
        return value

    def pre_forward(self, module, *args, **kwargs):
        return self._copy(args), self._copy(kwargs)

    def post_forward(self, module, output):
        return self._copy(output)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_tensors_a_hook_moves_between_modules_keep_their_data_flow_and_values(family):
    plain = testing.build(family, "sdpa")
    reference = tl.trace(plain, IDS)
    model = testing.build(family, "sdpa")
    for address in reference.blocks:
        add_hook_to_module(model.get_submodule(address), _CopyingHook())
    t = tl.trace(model, IDS)
    # The moves are not ops, and the op reading a moved tensor is linked to the original's producer.
    assert [(o.name, o.module, o.inputs, o.shapes) for o in t.ops] == [
        (o.name, o.module, o.inputs, o.shapes) for o in reference.ops
    ]
    seen = testing.hooked_outputs(plain, t.blocks, IDS)
    for a in t.blocks:
        torch.testing.assert_close(t.modules[a].facets["resid_post"], seen[a], rtol=0, atol=0)
    for address, rec in reference.modules.items():
        for call, other in zip(rec.calls, t.modules[address].calls, strict=True):
            assert set(call.facets.sites) == set(other.facets.sites), address
            for name, site in call.facets.sites.items():
                if site.tensor is not None:
                    torch.testing.assert_close(
                        other.facets.sites[name].tensor, site.tensor, rtol=0, atol=0
                    )


def _gpu_maps(family: str) -> dict[str, dict]:
    """Device maps for a model spread over accelerators: on one GPU the second block and the final
    norm are kept in CPU memory and streamed in (accelerate runs them on the GPU); on two GPUs the
    second half runs on the second one. The tied unembedding stays with the embeddings."""
    if family == "gpt2":
        head = {
            "transformer.wte": 0,
            "transformer.wpe": 0,
            "transformer.drop": 0,
            "transformer.h.0": 0,
            "lm_head": 0,
        }
        tail = ("transformer.h.1", "transformer.ln_f")
    else:
        head = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "lm_head": 0}
        tail = ("model.layers.1", "model.norm")
    return {
        "one_gpu_cpu_offload": {**head, **dict.fromkeys(tail, "cpu")},
        "two_gpus": {**head, **dict.fromkeys(tail, 1)},
    }


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("layout,gpus", [("one_gpu_cpu_offload", 1), ("two_gpus", 2)])
def test_a_model_spread_over_devices_traces_like_the_undispatched_one(family, layout, gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA device(s)")
    plain = testing.build(family, "sdpa")
    reference = tl.trace(plain, IDS)
    model = dispatch_model(testing.build(family, "sdpa"), device_map=_gpu_maps(family)[layout])
    t = tl.trace(model, IDS.to("cuda:0"))
    assert [(o.name, o.module, o.inputs, o.shapes) for o in t.ops] == [
        (o.name, o.module, o.inputs, o.shapes) for o in reference.ops
    ]
    seen = testing.hooked_outputs(plain, t.blocks, IDS)
    for a in t.blocks:  # float32 on the GPU against the CPU: kernels differ, values agree closely
        torch.testing.assert_close(
            t.modules[a].facets["resid_post"].cpu(), seen[a], rtol=1e-4, atol=1e-4
        )
    for address, rec in reference.modules.items():
        for call, other in zip(rec.calls, t.modules[address].calls, strict=True):
            for name, site in call.facets.sites.items():
                got = other.facets.sites.get(name)
                if site.tensor is not None and got is not None and got.tensor is not None:
                    torch.testing.assert_close(got.tensor.cpu(), site.tensor, rtol=1e-4, atol=1e-4)


class _Halve(ModelHook):
    """An ablation written as an accelerate hook: the module's output (or input) scaled by 0.5,
    returned as a new tensor, or written into the same tensor through `.data` (in place, or by
    giving it other memory). `received` is the tensor as the hook got it (cloned)."""

    def __init__(self, side: str, how: str):
        super().__init__()
        self.side, self.how, self.received = side, how, None

    def _halve(self, t):
        self.received = t.detach().clone()
        if self.how == "new":
            return t * 0.5
        if self.how == "data_inplace":
            t.data.mul_(0.5)
        else:
            t.data = t.data * 0.5
        return t

    def pre_forward(self, module, *args, **kwargs):
        if self.side == "in":
            args = (self._halve(args[0]),) + tuple(args[1:])
        return args, kwargs

    def post_forward(self, module, output):
        if self.side != "out":
            return output
        if isinstance(output, tuple):
            return (self._halve(output[0]),) + tuple(output[1:])
        return self._halve(output)


@pytest.mark.parametrize(
    "outer", [None, "device"]
)  # "device": inside `with torch.device("cpu")`, a mode below
@pytest.mark.parametrize("how", ["new", "data_inplace", "data_assign"])
@pytest.mark.parametrize("side", ["in", "out"])
@pytest.mark.parametrize(
    "where", ["transformer.h.0", "transformer.h.0.attn", "transformer.h.0.mlp.c_fc"]
)
def test_an_accelerate_hook_that_changes_values_is_recorded_as_computing_them(
    side, where, how, outer
):
    model = testing.build("gpt2", "sdpa")
    hook = _Halve(side, how)
    add_hook_to_module(model.get_submodule(where), hook)
    addresses = [
        a for a, _ in model.named_modules() if a.startswith("transformer.h.") or a == "lm_head"
    ]
    # Ground truth: what every module received and returned, seen by plain hooks outside accelerate's.
    seen_in, handles = {}, []

    def look(address):
        def pre_hook(module, args):  # returns None: the module gets its own arguments
            if args:
                seen_in.setdefault(address, args[0].detach().clone())

        return pre_hook

    for a in addresses:
        handles.append(model.get_submodule(a).register_forward_pre_hook(look(a)))
    seen_out = testing.hooked_outputs(model, addresses, IDS)  # also runs the pre-hooks above
    for h in handles:
        h.remove()
    with torch.device("cpu") if outer == "device" else contextlib.nullcontext():
        t = tl.trace(model, IDS, save="all")
    for a in addresses:
        facets = t.modules[a].facets
        if a in seen_out and "output" in facets:
            torch.testing.assert_close(
                facets["output"], seen_out[a], rtol=0, atol=0, msg=f"{a} output"
            )
        if a in seen_in and "input" in facets and facets.sites["input"].dtype.is_floating_point:
            torch.testing.assert_close(
                facets["input"], seen_in[a], rtol=0, atol=0, msg=f"{a} input"
            )
    for a in t.blocks:
        torch.testing.assert_close(t.modules[a].facets["resid_post"], seen_out[a], rtol=0, atol=0)
    # The hook's change is an op of its own, whose input is the op that produced what the hook got,
    # and that op keeps what it returned, not what the hook then wrote into its memory.
    changed = [op for op in t.ops if op.name in ("accelerate_hook", "written_in_place")]
    assert [op.name for op in changed] == [
        "accelerate_hook" if how == "new" else "written_in_place"
    ]
    before = t.ops[changed[0].inputs[0].op]
    assert torch.equal(before.tensor, hook.received)


def _conv_bn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3)
    ).eval()


def test_a_buffer_loaded_where_a_freed_weight_was_is_not_named_as_that_weight(tmp_path):
    """With `offload_buffers`, accelerate frees each meta placeholder as it loads the weight, then
    loads the buffers, which can take a freed placeholder's address: the op reading a buffer must
    not name it as the weight that address once held (it named `running_mean` `1.bias` in about
    one trace in five). Ground truth: the undispatched model's op inputs, and its own structure."""
    x = torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    want = [op.inputs for op in tl.trace(_conv_bn(), x).ops]
    assert ("1.weight", "1.bias") == tuple(
        i
        for i in next(o for o in tl.trace(_conv_bn(), x).ops if o.name == "batch_norm").inputs
        if isinstance(i, str)
    )
    for i in range(12):
        offload = cpu_offload if i % 2 else disk_offload
        extra = {} if i % 2 else {"offload_dir": str(tmp_path / f"o{i}")}
        model = offload(
            _conv_bn(), execution_device=torch.device("cpu"), offload_buffers=True, **extra
        )
        for _ in range(2):
            assert [op.inputs for op in tl.trace(model, x).ops] == want


def test_a_generation_on_an_offloaded_model_records_each_steps_inputs(tmp_path):
    """Each decode step's inputs are new tensors, which can take the address of a weight an
    earlier step loaded and freed: they must be recorded as the step's `input` ops, not named as
    that weight (29 of 80 steps were, and an edit then found its op moved). Ground truth: the same
    generation of the undispatched model."""
    ids = testing.token_ids(batch=2, length=6, seed=3, vocab=60) + 3
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    twin = tl.trace_generate(testing.build("llama", "eager"), ids, **kw)
    want = [[(o.name, o.module, o.inputs) for o in s.ops] for s in twin.steps]
    for i in range(6):
        model = testing.build("llama", "eager")
        model = (
            cpu_offload(model, execution_device=torch.device("cpu"))
            if i % 2
            else disk_offload(model, str(tmp_path / f"o{i}"), execution_device=torch.device("cpu"))
        )
        g = tl.trace_generate(model, ids, **kw)
        assert torch.equal(g.sequences, twin.sequences)
        assert [[(o.name, o.module, o.inputs) for o in s.ops] for s in g.steps] == want


class _HalveAndDrop(ModelHook):
    """Halves the block's hidden states and drops (or adds) a tensor keyword argument."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode

    def pre_forward(self, module, *args, **kwargs):
        if args:
            args = (args[0] * 0.5, *args[1:])
        else:
            kwargs["hidden_states"] = kwargs["hidden_states"] * 0.5
        if self.mode == "drop":
            kwargs.pop("position_ids", None)
        else:
            kwargs["extra"] = torch.zeros(1)
        return args, kwargs


@pytest.mark.parametrize("mode", ["drop", "add"])
def test_a_hook_that_adds_or_drops_a_tensor_argument_is_recorded_as_computing_its_tensors(mode):
    """A hook that changes how many tensors the module gets pairs none of them with what it was
    given: each tensor it passes on that it was not given is an `accelerate_hook` op (it was left
    unrecorded, so the next op read it as a model input). Ground truth: a plain pre-hook on the
    block's first norm sees the halved tensor."""
    model = testing.build("llama", "eager")
    add_hook_to_module(model.model.layers[0], _HalveAndDrop(mode), append=True)
    seen = {}
    handle = model.model.layers[0].input_layernorm.register_forward_pre_hook(
        lambda m, a: seen.setdefault("x", a[0].detach().clone())
    )
    try:
        model(IDS)
    finally:
        handle.remove()
    t = tl.trace(model, IDS, save="all")
    norm = t.modules["model.layers.0.input_layernorm"].calls[0]
    source = t.ops[norm.input_ref.op]
    assert source.name == "accelerate_hook" and source.inputs == ()
    torch.testing.assert_close(source.tensor, seen["x"], rtol=0, atol=0)

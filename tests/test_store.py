"""`store=`: where a trace's saved tensors live once `trace` returns.

Ground truth is a plain forward hook on the model: a trace whose tensors went to a directory
(memory-mapped safetensors) or to the CPU must serve the same values, keep views as views, and
hold no tensor memory of its own when the directory store is used.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing

IDS = testing.token_ids(length=6)


def _mapped_file(ptr: int) -> str | None:
    """The file mapped at address `ptr` in this process (Linux /proc/self/maps), if any."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5].strip() if len(parts) == 6 else None
    return None


def _held(trace):
    """Every tensor the trace holds, computing nothing: op outputs, the tensors of sites that are
    not pending, and what pending checks will compute from (`FacetSite._inputs`)."""
    out, lists = [], set()
    for op in trace.ops:
        out += [t for t in op.tensors if t is not None]
    for rec in trace.modules.values():
        for call in rec.calls:
            for s in call.facets.sites.values():
                if s._value is not None:
                    out.append(s._value)
                if s._inputs is not None and id(s._inputs) not in lists:
                    lists.add(id(s._inputs))
                    out += [t for t in s._inputs if isinstance(t, torch.Tensor)]
    return out


def _facet_values(trace):
    return {
        (a, c.index, n): s.tensor
        for a, rec in trace.modules.items()
        for c in rec.calls
        for n, s in c.facets.sites.items()
    }


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_directory_store_serves_hook_values_from_memory_mapped_files(tmp_path, family):
    model = testing.build(family, "sdpa")
    reference = tl.trace(model, IDS, save="all")
    stored = tl.trace(model, IDS, save="all", store=tmp_path / "store")
    files = sorted(os.listdir(tmp_path / "store"))
    assert files and all(f.startswith("tensors-") and f.endswith(".safetensors") for f in files)
    addresses = stored.blocks + stored.by_role("attention") + stored.by_role("mlp")
    seen = testing.hooked_outputs(model, addresses, IDS)
    for a in addresses:
        facet = "resid_post" if a in stored.blocks else "output"
        torch.testing.assert_close(stored.modules[a].facets[facet], seen[a], rtol=0, atol=0)
    # Every tensor the trace holds (what pending facets compute from included) equals the default
    # store's and lives in a file; computed facets, computed on first read, equal the default's.
    tensors, ref_tensors = _held(stored), _held(reference)
    assert len(tensors) == len(ref_tensors)
    for t, r in zip(tensors, ref_tensors):
        assert torch.equal(t, r)
        mapped = _mapped_file(t.data_ptr()) if t.numel() else str(tmp_path / "store" / "x")
        assert mapped is not None and os.path.dirname(mapped) == str(tmp_path / "store"), mapped
    # Views of one tensor stay views of one copy: the same byte distances between them.
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(ref_tensors):
        groups.setdefault(r.untyped_storage().data_ptr(), []).append(i)
    shared = [g for g in groups.values() if len(g) > 1]
    assert shared
    for g in shared:
        assert [tensors[i].data_ptr() - tensors[g[0]].data_ptr() for i in g] == [
            ref_tensors[i].data_ptr() - ref_tensors[g[0]].data_ptr() for i in g
        ]
    values, ref_values = _facet_values(stored), _facet_values(reference)
    assert values.keys() == ref_values.keys()
    for k, v in values.items():
        assert (v is None) == (ref_values[k] is None) and (
            v is None or torch.equal(v, ref_values[k])
        ), k
    # Names resolve and read the stored values.
    res = mi.resolve_alias(stored, "blocks.1.hook_resid_post")
    torch.testing.assert_close(res.tensor, seen[stored.blocks[1]], rtol=0, atol=0)


def test_cpu_store_keeps_values_and_devices(tmp_path, monkeypatch):
    """`store="cpu"` moves tensors in memory: no file is written anywhere (not even a directory
    named "cpu" in the working directory) and no kept tensor is file-backed."""
    monkeypatch.chdir(tmp_path)
    model = testing.build("gpt2", "sdpa")
    stored = tl.trace(model, IDS, save="all", store="cpu")
    assert list(tmp_path.iterdir()) == []
    assert not [
        f
        for t in _held(stored)
        if (f := _mapped_file(t.untyped_storage().data_ptr())) and f.startswith("/")
    ]
    seen = testing.hooked_outputs(model, stored.blocks, IDS)
    for a in stored.blocks:
        t = stored.modules[a].facets["resid_post"]
        assert t.device.type == "cpu"
        torch.testing.assert_close(t, seen[a], rtol=0, atol=0)


def test_a_second_trace_into_the_same_directory_leaves_the_first_unchanged(tmp_path):
    """Each trace's files replace the names, not the contents, of the files a trace stored there
    before: the first trace keeps serving its own forward's values."""
    model = testing.build("gpt2", "sdpa")
    other = testing.token_ids(length=6, seed=1)
    assert not torch.equal(other, IDS)
    first = tl.trace(model, IDS, save="all", store=tmp_path)
    seen = testing.hooked_outputs(model, first.blocks, IDS)
    second = tl.trace(model, other, save="all", store=tmp_path)
    for a in first.blocks:
        torch.testing.assert_close(first.modules[a].facets["resid_post"], seen[a], rtol=0, atol=0)
    seen2 = testing.hooked_outputs(model, second.blocks, other)
    for a in second.blocks:
        torch.testing.assert_close(second.modules[a].facets["resid_post"], seen2[a], rtol=0, atol=0)


def test_a_directory_stored_trace_saves_and_loads(tmp_path):
    model = testing.build("gpt2", "sdpa")
    stored = tl.trace(model, IDS, save="all", store=tmp_path / "store")
    with pytest.warns(UserWarning):
        stored.save(tmp_path / "saved")
    loaded = tl.load(tmp_path / "saved")
    seen = testing.hooked_outputs(model, loaded.blocks, IDS)
    for a in loaded.blocks:
        torch.testing.assert_close(loaded.modules[a].facets["resid_post"], seen[a], rtol=0, atol=0)


@pytest.mark.parametrize(
    "bad, words",
    [
        (3, "is not accepted"),
        ("gpu", "is not a store name"),
        ("", "is not accepted"),
    ],
)
def test_bad_store_values_are_refused_before_the_forward(bad, words):
    model = testing.build("gpt2", "sdpa")
    ran = []
    handle = model.register_forward_pre_hook(lambda m, a: ran.append(1))
    try:
        with pytest.raises(tl.StoreSpecError, match=words) as info:
            tl.trace(model, IDS, store=bad)
    finally:
        handle.remove()
    assert "'cpu'" in str(info.value) and not ran


def test_an_existing_file_is_not_a_directory_store(tmp_path):
    file = tmp_path / "file.bin"
    file.write_bytes(b"x")
    with pytest.raises(tl.StoreSpecError, match="existing file"):
        tl.trace(testing.build("gpt2", "sdpa"), IDS, store=pathlib.Path(file))


def test_a_directory_store_writes_as_capture_goes(tmp_path, monkeypatch):
    """Each block's tensors are in files before the forward ends (when the final norm starts, a
    file per block exists), and (read inside TorchLens, an internal) when the trace is assembled
    every op output capture held is a view of a file, not of the model's memory."""
    import torchlens._tracing as tracing

    model = testing.build("gpt2", "sdpa")
    store = tmp_path / "store"
    files_at_ln_f = []
    handle = model.transformer.ln_f.register_forward_pre_hook(
        lambda m, a: files_at_ln_f.append(sorted(os.listdir(store)) if store.exists() else [])
    )
    in_memory = []
    real = tracing.assemble

    def spy(rec, *rest):
        in_memory.extend(
            op.index
            for op in rec.ops
            for t in op.tensors
            if t is not None and t.numel() and _mapped_file(t.data_ptr()) is None
        )
        return real(rec, *rest)

    monkeypatch.setattr(tracing, "assemble", spy)
    try:
        stored = tl.trace(model, IDS, save="all", store=store)
    finally:
        handle.remove()
    assert len(files_at_ln_f[0]) == len(stored.blocks) == 2, files_at_ln_f
    assert not in_memory, in_memory
    seen = testing.hooked_outputs(model, stored.blocks, IDS)
    for a in stored.blocks:
        torch.testing.assert_close(stored.modules[a].facets["resid_post"], seen[a], rtol=0, atol=0)


class _Stack(torch.nn.Module):
    """Two chained blocks. Block 0 writes its own residual sum in place where the capture cannot
    see it; after the stack the model writes the last block's output in place (seen)."""

    class Block(torch.nn.Module):
        def __init__(self, hidden: bool):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.hidden = hidden

        def forward(self, x):
            y = self.lin(x) + x
            if self.hidden:
                with torch._C.DisableTorchFunction():
                    y.mul_(2)  # the mode never sees this write
            return y

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([self.Block(True), self.Block(False)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.mul_(3)


def test_a_directory_store_writes_only_values_the_ops_produced(tmp_path):
    torch.manual_seed(0)
    model = _Stack()
    x = torch.randn(2, 3, 4)
    seen = {}
    handles = [
        m.register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, o.detach().clone()))
        for n, m in model.named_modules()
        if n
    ]
    with torch.no_grad():
        model(x.clone())
    for h in handles:
        h.remove()
    with pytest.warns(UserWarning, match="written in place by code the capture could not see"):
        stored = tl.trace(model, x.clone(), save="all", store=tmp_path / "store")
    assert stored.blocks == ["layers.0", "layers.1"]
    # The sum block 0 overwrote unseen is not kept, neither in memory nor in a file ...
    add = next(op for op in stored.ops if op.module == "layers.0" and op.name == "add")
    assert add.tensors == (None,)
    # ... and every value served is the model's, the blocks' outputs as their hooks saw them.
    for n in ("layers.0", "layers.1", "layers.0.lin", "layers.1.lin"):
        facet = "resid_post" if n.count(".") == 1 else "output"
        torch.testing.assert_close(stored.modules[n].facets[facet], seen[n], rtol=0, atol=0)
        assert _mapped_file(stored.modules[n].facets[facet].data_ptr()).startswith(
            str(tmp_path / "store")
        )


def _served(trace):
    """Every facet value and check error of `trace`, its pending checks run."""
    trace.check()
    return {
        (a, c.index, n): (s.tensor, s.check_error)
        for a, rec in trace.modules.items()
        for c in rec.calls
        for n, s in c.facets.sites.items()
    }


_EVERY_VARIANT = [
    (f, impl) for f in testing.SUITE for impl in testing.FAMILIES[f].attn_implementations
]


@pytest.mark.parametrize(
    "family, impl", _EVERY_VARIANT, ids=[f"{f}-{i}" for f, i in _EVERY_VARIANT]
)
def test_no_store_changes_a_served_value_bit_for_bit(tmp_path, family, impl):
    """What a trace serves does not depend on where its tensors were put: the computed and
    reconstructed facets (rebuilt scores and pattern, per-head results, norm statistics) and
    every check error are the same bits under `store=<dir>` (memory-mapped files, at whatever
    alignment the file gives) and `store="cpu"` as in memory. A matrix product computed from the
    tensors where they sit takes an alignment-dependent kernel path on some CPUs (AMD EPYC:
    GPT-2's rebuilt scores differed in the last bit)."""
    model = testing.build(family, impl)
    for length, store in [(n, s) for n in (3, 6) for s in (tmp_path / f"store{n}", "cpu")]:
        ids = testing.token_ids(length=length)
        reference = _served(tl.trace(model, ids, save="all"))
        served = _served(tl.trace(model, ids, save="all", store=store))
        assert served.keys() == reference.keys()
        for key, (value, error) in served.items():
            ref_value, ref_error = reference[key]
            assert (value is None) == (ref_value is None), (store, key)
            assert value is None or torch.equal(value, ref_value), (store, key)
            assert error == ref_error, (store, key, error, ref_error)


def test_a_check_computes_the_same_bits_wherever_its_inputs_sit():
    """The pending checks compute from their inputs wherever those sit: move each input of every
    pending check to a shifted, strided place in a larger buffer (values unchanged), and every
    computed facet and check error stays the same bits. Internals: `FacetSite._inputs`."""
    model = testing.build("gpt2", "sdpa")
    ids = testing.token_ids(length=6)
    reference = _served(tl.trace(model, ids, save="all"))
    for shift in range(1, 9):
        trace = tl.trace(model, ids, save="all")
        lists = {}
        for rec in trace.modules.values():
            for call in rec.calls:
                for site in call.facets.sites.values():
                    if site._inputs is not None:
                        lists[id(site._inputs)] = site._inputs
        assert lists
        for inputs in lists.values():
            for i, t in enumerate(inputs):
                if isinstance(t, torch.Tensor) and t.numel() and t.is_floating_point():
                    buffer = torch.empty(t.numel() * 2 + shift, dtype=t.dtype)
                    moved = buffer[shift : shift + 2 * t.numel() : 2].view(t.shape)
                    moved.copy_(t)
                    inputs[i] = moved
        for (
            rec
        ) in trace.modules.values():  # the moved inputs are new tensors: no version to compare with
            for call in rec.calls:
                for site in call.facets.sites.values():
                    if site._pending is not None:
                        site._pending.marks = None
        served = _served(trace)
        for key, (value, error) in served.items():
            ref_value, ref_error = reference[key]
            assert value is None or torch.equal(value, ref_value), (shift, key)
            assert error == ref_error, (shift, key)


def test_a_file_renamed_over_a_stores_file_never_changes_its_trace(tmp_path, monkeypatch):
    """Two traces storing into one directory at the same time write files of the same names: each
    renames its file over the name, and the other may rename its own over it a moment later. A
    trace's tensors are mapped from the file it wrote, so whatever lands on the name afterwards
    (here: another trace's file of the same layout, renamed over each file as soon as it is in
    place) changes none of its values."""
    from torchlens._capture import stores

    model = testing.build("gpt2")
    blocks = [f"transformer.h.{i}" for i in range(len(model.transformer.h))]
    other_ids = testing.token_ids(length=6, seed=7)
    decoy_dir = tmp_path / "decoy"
    tl.trace(model, other_ids, save=["resid_post"], store=str(decoy_dir))
    decoys = sorted(decoy_dir.glob("tensors-*.safetensors"))
    real_replace = os.replace

    def then_the_other_store(src, dst):
        real_replace(src, dst)
        decoy = decoys[int(pathlib.Path(dst).name.split("-")[1].split(".")[0])]
        copy = f"{dst}.decoy"
        with open(decoy, "rb") as f, open(copy, "wb") as g:
            g.write(f.read())
        real_replace(copy, dst)

    truth = testing.hooked_outputs(model, blocks, IDS)
    monkeypatch.setattr(stores.os, "replace", then_the_other_store)
    trace = tl.trace(model, IDS, save=["resid_post"], store=str(tmp_path / "shared"))
    monkeypatch.undo()
    for b in blocks:
        assert torch.equal(trace.modules[b].facets["resid_post"], truth[b])


def test_a_failed_forward_leaves_no_file_of_its_store(tmp_path):
    """A forward that raises after the first block's tensors were written leaves nothing in the
    store's directory: the files serve no trace."""

    class Fails(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = testing.build("gpt2")

        def forward(self, ids):
            self.inner(ids)
            raise ValueError("after the blocks")

    where = tmp_path / "store"
    with pytest.raises(ValueError, match="after the blocks"):
        tl.trace(Fails(), IDS, store=str(where))
    assert not list(where.glob("*")) if where.exists() else True


def test_a_complex_view_of_a_float_storage_is_stored_aligned(tmp_path):
    """Rotary embeddings written with `view_as_complex` (Meta's Llama) read a float32 storage as
    complex64, 8 bytes an element: the store lays each storage out at the widest element a tensor
    on it reads, so an odd-sized float32 storage before it no longer breaks the trace."""

    class Rotates(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 3), torch.nn.Linear(8, 8)  # a: 12 bytes a row

        def forward(self, x):
            c = torch.view_as_complex(self.b(x).reshape(1, 4, 2))
            c = c * torch.polar(torch.ones(4), torch.arange(4.0))
            return torch.view_as_real(c).flatten(1) + self.a(x).sum()

    torch.manual_seed(0)
    model, x = Rotates().eval(), torch.randn(1, 8)
    with torch.no_grad():
        truth = model(x)
    plain = tl.trace(model, x)
    stored = tl.trace(model, x, store=str(tmp_path / "s"))
    assert torch.equal(stored.output, truth)
    for a, b in zip(plain.ops, stored.ops):
        assert (a.tensor is None) == (b.tensor is None)
        if a.tensor is not None:
            assert torch.equal(a.tensor, b.tensor), a.name


def test_a_directory_in_the_way_of_a_store_file_is_named_in_the_error(tmp_path):
    """A directory where the store's first file goes: the error names that, not a full disk, and
    the forward's files are gone."""
    store = tmp_path / "store"
    (store / "tensors-00000.safetensors").mkdir(parents=True)
    with pytest.raises(tl.StoreSpecError) as info:
        tl.trace(testing.build("gpt2", "sdpa"), IDS, save="all", store=store)
    message = str(info.value)
    assert "A directory is in the way" in message and "free space" not in message.lower()
    assert "store='cpu'" in message
    assert sorted(p.name for p in store.iterdir()) == ["tensors-00000.safetensors"]

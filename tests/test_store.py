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

import _models
import torchlens as tl
import torchlens.mechinterp as mi

IDS = _models.token_ids(length=6)


def _mapped_file(ptr: int) -> str | None:
    """The file mapped at address `ptr` in this process (Linux /proc/self/maps), if any."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5].strip() if len(parts) == 6 else None
    return None


def _storages(trace):
    out = []
    for op in trace.ops:
        out += [t for t in op.tensors if t is not None]
    for rec in trace.modules.values():
        for call in rec.calls:
            out += [s.tensor for s in call.facets.sites.values() if s.tensor is not None]
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_directory_store_serves_hook_values_from_memory_mapped_files(tmp_path, family):
    model = _models.build(family, "sdpa")
    reference = tl.trace(model, IDS, save="all")
    stored = tl.trace(model, IDS, save="all", store=tmp_path / "store")
    files = sorted(os.listdir(tmp_path / "store"))
    assert files and all(f.startswith("tensors-") and f.endswith(".safetensors") for f in files)
    addresses = stored.blocks + stored.by_role("attention") + stored.by_role("mlp")
    seen = _models.hooked_outputs(model, addresses, IDS)
    for a in addresses:
        facet = "resid_post" if a in stored.blocks else "output"
        torch.testing.assert_close(stored.modules[a].facets[facet], seen[a], rtol=0, atol=0)
    # Every saved tensor, computed facets included, equals the default store's and lives in a file.
    tensors, ref_tensors = _storages(stored), _storages(reference)
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
        assert [tensors[i].data_ptr() - tensors[g[0]].data_ptr() for i in g] == \
               [ref_tensors[i].data_ptr() - ref_tensors[g[0]].data_ptr() for i in g]
    # Names resolve and read the stored values.
    res = mi.resolve_alias(stored, "blocks.1.hook_resid_post")
    torch.testing.assert_close(res.tensor, seen[stored.blocks[1]], rtol=0, atol=0)


def test_cpu_store_keeps_values_and_devices(tmp_path):
    model = _models.build("gpt2", "sdpa")
    stored = tl.trace(model, IDS, save=["resid_post"], store="cpu")
    seen = _models.hooked_outputs(model, stored.blocks, IDS)
    for a in stored.blocks:
        t = stored.modules[a].facets["resid_post"]
        assert t.device.type == "cpu"
        torch.testing.assert_close(t, seen[a], rtol=0, atol=0)


def test_a_directory_stored_trace_saves_and_loads(tmp_path):
    model = _models.build("gpt2", "sdpa")
    stored = tl.trace(model, IDS, save="all", store=tmp_path / "store")
    with pytest.warns(UserWarning):
        stored.save(tmp_path / "saved")
    loaded = tl.load(tmp_path / "saved")
    seen = _models.hooked_outputs(model, loaded.blocks, IDS)
    for a in loaded.blocks:
        torch.testing.assert_close(loaded.modules[a].facets["resid_post"], seen[a], rtol=0, atol=0)


@pytest.mark.parametrize("bad, words", [
    (3, "is not accepted"),
    ("gpu", "is not a store name"),
    ("", "is not accepted"),
])
def test_bad_store_values_are_refused_before_the_forward(bad, words):
    model = _models.build("gpt2", "sdpa")
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
        tl.trace(_models.build("gpt2", "sdpa"), IDS, store=pathlib.Path(file))

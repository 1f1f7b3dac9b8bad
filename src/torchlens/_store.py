"""`store=`: where a trace's saved tensors live once [`trace`][torchlens.trace] returns.

- `None` / `"device"` (default): where the model computed them; nothing is moved.
- `"cpu"`: every saved tensor is copied to host memory (through pinned memory, non-blocking,
  when it sits on an accelerator), one copy per storage, so tensors that were views of one
  tensor stay views of one copy.
- a directory (a `str` or `os.PathLike`): every saved storage is written to
  `tensors-<n>.safetensors` files there and the trace's tensors become memory-mapped views of
  those files (copy-on-write, read back lazily by the operating system). The trace then no
  longer pins the model's activations in memory: its resident size after the call is what has
  been read since.

The tensors are moved when the trace is assembled, after the forward and the facet checks: the
peak memory *during* capture is that of the default store; what the directory store saves is
the memory the trace holds afterwards.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import torch

from ._errors import TorchLensError

__all__ = ["StoreSpecError", "parse_store", "apply_store"]

#: Bytes per safetensors file the directory store writes (one storage may exceed it).
SHARD_BYTES = 1 << 30


class StoreSpecError(TorchLensError, ValueError):
    """The `store=` argument of [`trace`][torchlens.trace] is not one TorchLens accepts."""


def parse_store(store: Any) -> Any:
    """`None` (leave tensors where they are), `"cpu"`, or the directory path, or raise."""
    accepted = "store= accepts None or 'device' (the default), 'cpu', or a directory path (str or os.PathLike)"
    if store is None or store == "device":
        return None
    if store == "cpu":
        return "cpu"
    if isinstance(store, os.PathLike) or (isinstance(store, str) and store):
        path = os.fspath(store)
        if isinstance(store, str) and store.lower() in ("gpu", "cuda", "disk", "mmap", "meta"):
            raise StoreSpecError(f"store={store!r} is not a store name; {accepted}. To write to a directory "
                                 f"named {store!r}, pass pathlib.Path({store!r}).")
        if os.path.exists(path) and not os.path.isdir(path):
            raise StoreSpecError(f"store={store!r} is an existing file; a directory store needs a directory "
                                 f"(it is created if missing). {accepted}.")
        return path
    raise StoreSpecError(f"store={store!r} is not accepted; {accepted}.")


def _saved_tensors(trace) -> list[tuple[Any, Any, torch.Tensor]]:
    """(holder, key, tensor) for every tensor the trace saved: op outputs, fused-kernel inputs,
    facet sites."""
    found = []
    for op in trace.ops:
        for slot, t in enumerate(op.tensors):
            if t is not None:
                found.append((op, slot, t))
        extra = op.extra
        if isinstance(extra, dict):
            for i, a in enumerate(extra.get("args", ())):
                if isinstance(a, torch.Tensor):
                    found.append((extra, ("args", i), a))
            for k, v in extra.get("kwargs", {}).items():
                if isinstance(v, torch.Tensor):
                    found.append((extra, ("kwargs", k), v))
    for rec in trace.modules.values():
        for call in rec.calls:
            if call.facets is None:
                continue
            for site in call.facets.sites.values():
                t = site.__dict__.get("tensor")  # the stored value, not a lazily computed one
                if isinstance(t, torch.Tensor):
                    found.append((site, "tensor", t))
    return found


def _put(holder: Any, key: Any, new: torch.Tensor) -> None:
    if isinstance(holder, dict):
        part, k = key
        if part == "args":
            args = list(holder["args"])
            args[k] = new
            holder["args"] = tuple(args)
        else:
            holder["kwargs"][k] = new
    elif isinstance(key, int):  # an OpRecord output slot
        tensors = list(holder.tensors)
        tensors[key] = new
        holder.tensors = tuple(tensors)
    else:
        setattr(holder, key, new)


def _view(storage: torch.UntypedStorage, byte_offset: int, t: torch.Tensor) -> torch.Tensor:
    """`t`'s view (offset, size, stride) on `storage`, whose byte `byte_offset` is `t`'s storage start."""
    item = t.element_size()
    if byte_offset % item:
        raise TorchLensError(f"torchlens store: a {t.dtype} storage landed at byte {byte_offset}, not a multiple "
                             f"of {item}")
    return torch.empty(0, dtype=t.dtype, device=storage.device).set_(
        storage, byte_offset // item + t.storage_offset(), t.size(), t.stride())


def apply_store(trace, store: Any):
    """Move `trace`'s saved tensors to `store` (a value `parse_store` returned); returns `trace`."""
    if store is None:
        return trace
    found = _saved_tensors(trace)
    storages: dict[tuple[str, int], tuple[torch.UntypedStorage, torch.dtype]] = {}
    for _, _, t in found:
        st = t.untyped_storage()
        storages.setdefault((str(t.device), st.data_ptr()), (st, t.dtype))
    placed: dict[tuple[str, int], tuple[torch.UntypedStorage, int]] = {}
    with torch.no_grad():
        if store == "cpu":
            pending = False
            for key, (st, _) in storages.items():
                if st.device.type == "cpu":
                    continue
                host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                host.copy_(torch.empty(0, dtype=torch.uint8, device=st.device).set_(st), non_blocking=True)
                placed[key] = (host.untyped_storage(), 0)
                pending = True
            if pending and torch.cuda.is_available():
                torch.cuda.synchronize()
        else:
            placed = _write_directory(store, storages)
        for holder, key, t in found:
            where = placed.get((str(t.device), t.untyped_storage().data_ptr()))
            if where is not None:
                _put(holder, key, _view(where[0], where[1], t))
    return trace


def _write_directory(path: str, storages: dict) -> dict:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    names: dict[tuple[str, int], tuple[int, str]] = {}
    size = 0
    for n, (key, (st, dtype)) in enumerate(storages.items()):
        flat = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st).cpu()
        item = torch.empty(0, dtype=dtype).element_size()
        if dtype.is_complex or flat.numel() % item:
            dtype = torch.uint8
        else:
            flat = flat.view(dtype)  # typed, so the file reads as ordinary tensors
        if size and size + st.nbytes() > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][f"s{n}"] = flat
        names[key] = (len(shards) - 1, f"s{n}")
        size += st.nbytes()
    files = []
    for i, tensors in enumerate(shards):
        name = os.path.join(path, f"tensors-{i:05d}.safetensors")
        save_file(tensors, name, metadata={"format": "torchlens-store"})
        files.append(name)
    maps = [_mapped(f) for f in files]
    placed = {}
    for key, (i, name) in names.items():
        storage, offsets = maps[i]
        placed[key] = (storage, offsets[name])
    return placed


def _mapped(file: str) -> tuple[torch.UntypedStorage, dict[str, int]]:
    """The file memory-mapped (private, read lazily) and each tensor's byte offset in it."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    start = 8 + n
    offsets = {k: start + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    storage = torch.UntypedStorage.from_file(file, shared=False, nbytes=os.path.getsize(file))
    return storage, offsets

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

A directory store writes *as capture goes*: each time a top-level block call (a module whose
role before the forward is `"block"`, not inside another block) ends, the tensors capture has
held since the last write are written and replaced by their memory-mapped views, so the peak
memory during capture stays near the plain forward's plus one layer's saved tensors. A tensor
is written only while it is still the value its op produced: capture clones a saved alias
before any write it sees, and one whose version counter moved by a write it could not see is
left in memory for the end-of-trace check, which drops it. What is left (tensors of a model
without blocks, those held after the last block, computed facets) is written when the trace
is assembled. The `"cpu"` store moves the tensors when the trace is assembled, after the forward.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import struct
from typing import Any

import torch

from torchlens._core.errors import TorchLensError, write_remedy
from torchlens._core.holdings import Holding, storage_ptr, trace_holdings

__all__ = ["DirectoryStore", "StoreSpecError", "apply_store", "parse_store"]

#: Bytes per safetensors file the directory store writes (one storage may exceed it).
SHARD_BYTES = 1 << 30


class StoreSpecError(TorchLensError, ValueError):
    """The `store=` argument of [`trace`][torchlens.trace] is not one TorchLens accepts, or its
    directory cannot hold the tensors: it lies under a file, it is read-only, or a write there
    failed (a full disk). The OS error, if any, is its `__cause__`."""


def parse_store(store: Any) -> Any:
    """`None` (leave tensors where they are), `"cpu"`, or a `DirectoryStore` for a directory path, or raise."""
    accepted = "store= accepts None or 'device' (the default), 'cpu', or a directory path (str or os.PathLike)"
    if store is None or store == "device":
        return None
    if store == "cpu":
        return "cpu"
    if isinstance(store, os.PathLike) or (isinstance(store, str) and store):
        path = os.fspath(store)
        if isinstance(store, str) and store.lower() in ("cpu", "device"):  # "CPU", "Device"
            raise StoreSpecError(
                f"store={store!r}: store names are lower case; did you mean {store.lower()!r}? "
                f"{accepted}. To write to a directory named {store!r}, pass pathlib.Path({store!r})."
            )
        if isinstance(store, str) and store.lower() in ("gpu", "cuda", "disk", "mmap", "meta"):
            raise StoreSpecError(
                f"store={store!r} is not a store name; {accepted}. To write to a directory "
                f"named {store!r}, pass pathlib.Path({store!r})."
            )
        if os.path.exists(path) and not os.path.isdir(path):
            raise StoreSpecError(
                f"store={store!r} is an existing file; a directory store needs a directory "
                f"(it is created if missing). {accepted}."
            )
        _check_writable(path, store)
        return DirectoryStore(path)
    raise StoreSpecError(f"store={store!r} is not accepted; {accepted}.")


def _check_writable(path: str, store: Any) -> None:
    """Refuse, before the forward, a directory store that cannot be made or written: one under a
    file, or in a directory this process may not write (a read-only file system, no permission)."""
    above = os.path.abspath(path)
    while not os.path.exists(above) and os.path.dirname(above) != above:
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise StoreSpecError(
            f"store={store!r}: {above!r} is a file, so no directory can be made at {path!r}; a "
            f"directory store needs a directory (it is created if missing). Pass another path."
        )
    if not os.access(above, os.W_OK | os.X_OK):
        what = (
            "the directory"
            if above == os.path.abspath(path)
            else f"{above!r}, the directory it would be made in,"
        )
        raise StoreSpecError(
            f"store={store!r}: {what} is not writable by this process (a read-only file system, "
            f"or no permission), so the trace's tensors cannot be written there. Pass a writable "
            f"directory, or store='cpu'."
        )


def _view(
    storage: torch.UntypedStorage, byte_offset: int, t: torch.Tensor, bases: dict
) -> torch.Tensor:
    """`t`'s view (offset, size, stride) on `storage`, whose byte `byte_offset` is `t`'s storage start.

    The view is made from one base tensor per (storage, byte_offset, dtype), kept in `bases`, so
    every tensor placed on one copy of a storage shares the base's version counter (a write
    through one of them moves it for all, which is what `Pending.seal` relies on).
    """
    item = t.element_size()
    if byte_offset % item:
        raise TorchLensError(
            f"torchlens store: a {t.dtype} storage landed at byte {byte_offset}, not a multiple "
            f"of {item}"
        )
    key = (storage.data_ptr(), byte_offset, t.dtype)
    base = bases.get(key)
    if base is None:
        base = bases[key] = torch.empty(0, dtype=t.dtype, device=storage.device).set_(
            storage, 0, (0,), (1,)
        )
    return base.as_strided(t.size(), t.stride(), byte_offset // item + t.storage_offset())


def _storages(found: list[Holding], skip: set[int] | frozenset[int] = frozenset()) -> dict:
    """(device, data_ptr) -> (storage, dtype) of each distinct storage in `found`, less those whose
    data_ptr is in `skip`."""
    storages: dict[tuple[str, int], tuple[torch.UntypedStorage, torch.dtype]] = {}
    for _, _, t in found:
        ptr = storage_ptr(t)
        if ptr is not None and ptr not in skip:  # one with no storage of its own is not written
            storages.setdefault((str(t.device), ptr), (t.untyped_storage(), t.dtype))
    return storages


def _replace(found: list[Holding], placed: dict, bases: dict) -> None:
    for h in found:
        where = placed.get((str(h.tensor.device), storage_ptr(h.tensor)))
        if where is not None:
            h.put(_view(where[0], where[1], h.tensor, bases))


def apply_store(trace, store: Any):
    """Move `trace`'s saved tensors to `store` (a value `parse_store` returned, or the
    `DirectoryStore` capture wrote to); returns `trace`."""
    if store is None:
        return trace
    found = trace_holdings(trace)
    with torch.no_grad():
        if store == "cpu":
            storages = _storages(found)
            placed: dict[tuple[str, int], tuple[torch.UntypedStorage, int]] = {}
            pending = False
            for key, (st, _) in storages.items():
                if st.device.type == "cpu":
                    continue
                host = torch.empty(
                    st.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available()
                )
                host.copy_(
                    torch.empty(0, dtype=torch.uint8, device=st.device).set_(st), non_blocking=True
                )
                placed[key] = (host.untyped_storage(), 0)
                pending = True
            if pending and torch.cuda.is_available():
                torch.cuda.synchronize()
            _replace(found, placed, {})
            for h in found:  # no storage of its own (sparse, a wrapper subclass): moved whole
                if h.tensor.device.type != "cpu" and storage_ptr(h.tensor) is None:
                    h.put(h.tensor.cpu())
        else:  # a directory: a tensor with no storage of its own stays in memory
            store.write(found)
    return trace


class DirectoryStore:
    """A `store=<directory>`: writes storages to `tensors-<n>.safetensors` files there, numbered
    on across writes, and serves them as memory-mapped views.

    Args:
        path: the directory (created if missing).
    """

    def __init__(self, path: str):
        self.path = path
        self._files = 0
        #: data_ptr of each mapped file storage this store handed out: tensors on them are stored.
        self._mapped: set[int] = set()
        #: (device, data_ptr) of a model storage written earlier -> (a weak reference to it, the
        #: version counter and the count of seen writes into it then, where it was written).
        self._written: dict[
            tuple[str, int], tuple[Any, int, int, tuple[torch.UntypedStorage, int]]
        ] = {}
        #: storage data_ptr -> writes the capture saw into it (the recorder's `_writes`).
        self.writes: dict[int, int] = {}
        #: the base tensors `_view` makes views of, kept across writes: a later view of a storage
        #: written earlier shares the version counter of the views made then.
        self._bases: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        #: the files this store wrote, removed if a later write fails (the trace then fails)
        self._paths: list[str] = []
        #: each of those files -> (device, inode) of the file this store wrote there
        self._inodes: dict[str, tuple[int, int]] = {}

    def write(self, found: list[Holding]) -> None:
        """Write the storages of the tensors in `found` and put each tensor's view on its file
        back into its holder. Tensors this store mapped already
        are left as they are.

        A tensor on a storage an earlier write wrote (a view, in a later layer, of a tensor an
        earlier layer made: RoPE's cos and sin) becomes a view of that copy, so views stay views
        of one copy, if the storage is still the same one (it was not freed) and is unchanged:
        its version counter (shared by views) and the count of writes the capture saw into it
        are what they were. Otherwise it is written again.
        """
        from torch.multiprocessing.reductions import StorageWeakRef

        storages = _storages(found, self._mapped)
        if not storages:
            return
        placed, fresh = {}, {}
        for key, (st, dtype) in storages.items():
            t = next(t for _, _, t in found if (str(t.device), storage_ptr(t)) == key)
            old = self._written.get(key)
            if (
                old is not None
                and not old[0].expired()
                and not t.is_inference()
                and t._version == old[1]
                and self.writes.get(key[1], 0) == old[2]
            ):
                placed[key] = old[3]
            else:
                fresh[key] = (st, dtype, t)
        if fresh:
            widest: dict[tuple[str, int | None], int] = {}  # the widest element read there
            for _, _, t in found:
                key = (str(t.device), storage_ptr(t))
                if key in fresh:
                    widest[key] = max(widest.get(key, 1), t.element_size())
            written = self._write({k: v[:2] for k, v in fresh.items()}, widest)
            for key, (st, _, t) in fresh.items():
                version = -1 if t.is_inference() else t._version
                self._written[key] = (
                    StorageWeakRef(st),
                    version,
                    self.writes.get(key[1], 0),
                    written[key],
                )
            placed.update(written)
        _replace(found, placed, self._bases)

    def discard(self) -> None:
        """Remove the files this store wrote (the trace it stored for failed: they serve nothing).
        A file another store has renamed over its name since is that store's, and left alone."""
        for name in self._paths:
            with contextlib.suppress(OSError):
                if _same_file(name, self._inodes.get(name)):
                    os.remove(name)
        self._paths.clear()

    def _write(self, storages: dict, widest: dict | None = None) -> dict:
        try:
            return self._write_files(storages, widest or {})
        except OSError as exc:
            # The trace being captured fails with this error: the files it wrote are of no use.
            self.discard()
            raise StoreSpecError(
                f"store={self.path!r}: writing the trace's tensors there failed: {exc.strerror or exc} "
                f"({errno.errorcode.get(exc.errno or 0, exc.errno)}"
                + (f", at {exc.filename!r}" if exc.filename else "")
                + "). The trace was not made, and the files it had written there were removed. "
                + (write_remedy(exc.errno) or "Pass a writable directory with room.")
                + " Or keep the tensors in memory: store='cpu' or store=None."
            ) from exc

    def _write_files(self, storages: dict, widest: dict) -> dict:
        os.makedirs(self.path, exist_ok=True)
        shards: list[dict[str, torch.Tensor]] = [{}]
        names: dict[tuple[str, int], tuple[int, str]] = {}
        #: each entry's alignment in its file: the widest element a tensor on it reads (a complex
        #: view of a float storage: 8 bytes), 1 for a storage whose bytes are not whole elements
        aligns: dict[str, int] = {}
        size = 0
        for n, (key, (st, dtype)) in enumerate(storages.items()):
            flat = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st).cpu()
            item = torch.empty(0, dtype=dtype).element_size()
            wide = max(item, widest.get(key, 1))
            aligns[f"s{n}"] = 1 if flat.numel() % wide else wide
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
        maps = []
        for tensors in shards:
            name = os.path.join(self.path, f"tensors-{self._files:05d}.safetensors")
            self._files += 1
            # Written beside under a name no other store uses, memory-mapped, then renamed over
            # the name: the maps are on the file this store wrote (its inode), so its tensors never
            # change, whatever is renamed over the name later (a trace stored here before keeps
            # its maps on its file; another trace storing here at the same time, its own).
            part = f"{name}.{os.getpid()}-{id(self):x}.part"
            try:
                _save_file(tensors, part, aligns)
                maps.append(_mapped(part))
                info = os.stat(part)
                os.replace(part, name)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.remove(part)
                raise
            self._paths.append(name)
            self._inodes[name] = (info.st_dev, info.st_ino)
        del shards
        for storage, _ in maps:
            self._mapped.add(storage.data_ptr())
        placed = {}
        for key, (i, name) in names.items():
            storage, offsets = maps[i]
            placed[key] = (storage, offsets[name])
        return placed


#: torch dtype -> its safetensors name, the dtypes of this torch that safetensors names. A directory
#: store writes a tensor of any other dtype as its bytes (U8); `Trace.save` leaves it out, with a note.
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        SAFETENSORS_DTYPES[getattr(torch, _name)] = _code


def _save_file(
    tensors: dict[str, torch.Tensor], file: str, aligns: dict[str, int] | None = None
) -> None:
    """Write 1-d CPU tensors to `file` in the safetensors format, streaming each tensor's bytes
    from its own memory (no serialized copy of the whole shard is built first). `aligns` gives
    the alignment a tensor's bytes need (a complex storage written as bytes: its element size),
    its element size where it gives none."""
    header: dict[str, Any] = {"__metadata__": {"format": "torchlens-store"}}
    offset, parts = 0, []
    aligns = aligns or {}
    # widest alignment first: each tensor's bytes are a whole number of its alignment, so every
    # tensor then starts at a multiple of its own
    order = sorted(tensors.items(), key=lambda kv: -aligns.get(kv[0], kv[1].element_size()))
    for name, t in order:
        dtype = SAFETENSORS_DTYPES.get(t.dtype)
        raw = (
            t.contiguous().view(torch.uint8)
            if dtype is not None
            else t.contiguous().view(-1).view(torch.uint8)
        )
        if dtype is None:
            dtype = "U8"
        n = raw.numel()
        shape = [n // t.element_size()] if dtype != "U8" or t.dtype == torch.uint8 else [n]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        parts.append(raw)
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (
        -(8 + len(text)) % 8
    )  # the data starts 8-byte aligned, as safetensors writes it
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in parts:
            if raw.numel():
                f.write(raw.numpy().data)


def _same_file(path: str, ident: tuple[int, int] | None) -> bool:
    """Whether `path` is still the file `ident` (device, inode) names."""
    if ident is None:
        return False
    info = os.stat(path)
    return (info.st_dev, info.st_ino) == ident


def _mapped(file: str) -> tuple[torch.UntypedStorage, dict[str, int]]:
    """The file memory-mapped (private, read lazily) and each tensor's byte offset in it."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    start = 8 + n
    offsets = {k: start + v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    storage = torch.UntypedStorage.from_file(file, shared=False, nbytes=os.path.getsize(file))
    assert isinstance(storage, torch.UntypedStorage)
    return storage, offsets

"""The tensor file of a saved trace, in the safetensors format: the dtypes it can hold, its layout
and bytes on save, the SHA-256 of each tensor, and reading it back checked against trace.json
(size, save token, header, digests) before and as tensors are allocated."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from torchlens._capture.stores import SAFETENSORS_DTYPES
from torchlens._persist.format import CHUNK, FORMAT, TraceFileError, plain_name
from torchlens._persist.schema import is_shape

_INLINE = 1 << 20  # a tensor this small is digested at once; a larger one in a worker thread
_MAX_HEADER = 100 << 20  # the largest safetensors header read (safetensors' own limit)

#: torch dtype -> its safetensors name; a tensor of any other dtype is left out on save, with a note.
ST_DTYPES = SAFETENSORS_DTYPES

#: safetensors dtype name -> torch dtype (the names `ST_DTYPES` writes)
TORCH_DTYPES = {code: dt for dt, code in ST_DTYPES.items()}
_TORN = (
    "the tensor file and trace.json are not from one save (a save that did not finish, with "
    "another TorchLens or by hand, or a file changed since)"
)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of the CPU tensor `t`: without a copy when it is contiguous."""
    t = t.resolve_conj().resolve_neg().contiguous()
    if not t.numel():
        return memoryview(b"")
    # flat with stride 1: a contiguous tensor's size-1 dims may carry any stride
    flat = t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy()
    return memoryview(flat)  # type: ignore[arg-type]  # numpy's stubs give ndarray __buffer__ only on Python 3.12+


def layout(
    tensors: dict[str, torch.Tensor], token: str
) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
    """The safetensors prefix (length and header) and the tensors in file order: widest elements
    first, so each starts at a multiple of its element size (the data starts 8-byte aligned)."""
    order = sorted(tensors.items(), key=lambda kv: -kv[1].element_size())
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT, "save": token}}
    offset = 0
    for key, t in order:
        n = t.numel() * t.element_size()
        header[key] = {
            "dtype": ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text, order


def _sha256(view: memoryview) -> str:
    return hashlib.sha256(view).hexdigest()


class Digests:
    """SHA-256 of tensors' bytes: small ones at once, larger ones in worker threads (hashlib lets
    go of the GIL), so digesting overlaps reading or writing and uses several cores. The threads
    end when the `with` block does, also on an error."""

    def __init__(self):
        self.pool: ThreadPoolExecutor | None = None
        self.done: dict[str, str | Future] = {}

    def __enter__(self) -> Digests:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def add(self, key: str, view: memoryview) -> None:
        if len(view) < _INLINE:
            self.done[key] = _sha256(view)
            return
        if self.pool is None:
            self.pool = ThreadPoolExecutor(
                max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="torchlens-sha256"
            )
        self.done[key] = self.pool.submit(_sha256, view)

    def results(self) -> dict[str, str]:
        return {k: v if isinstance(v, str) else v.result() for k, v in self.done.items()}


def _tensor_file(root: str, name: Any) -> str:
    """The path of a tensor file named in trace.json, refused unless it lies inside `root`."""
    if not plain_name(name):
        raise TraceFileError(
            f"torchlens.load: trace.json names the tensor file {name!r}; only a plain *.safetensors file "
            f"name inside the trace directory is accepted, so it was refused."
        )
    full = os.path.join(root, name)
    if os.path.dirname(os.path.realpath(full)) != os.path.realpath(root):
        raise TraceFileError(
            f"torchlens.load: the tensor file {name!r} links outside the trace directory "
            f"{root!r}; refused."
        )
    if not os.path.isfile(full):
        raise TraceFileError(
            f"torchlens.load: the tensor file {name!r} named in trace.json is missing from {root!r}."
        )
    return full


def _read_into(f: Any, view: memoryview, full: str) -> None:
    """Fill `view` from `f`; a short read means the file is truncated."""
    pos = 0
    while pos < len(view):
        n = f.readinto(view[pos : pos + CHUNK])
        if not n:
            raise TraceFileError(f"torchlens.load: {full} ends early; it is truncated, or {_TORN}.")
        pos += n


def _read_tensor_file(
    full: str, entry: dict, expected: dict[str, tuple[torch.dtype, list[int], str]]
) -> dict:
    """The tensors of one tensor file, each checked against trace.json: the file's size and save
    token, its header (exactly the expected tensors, with their dtypes and shapes, packed end to
    end, all checked before anything is allocated) and each tensor's SHA-256."""

    def bad(why: str) -> TraceFileError:
        return TraceFileError(
            f"torchlens.load: {full} is not a readable safetensors file ({why}); it is malformed "
            f"or truncated. Only safetensors is read, never pickle."
        )

    size = os.path.getsize(full)
    if size != entry["bytes"]:
        cut = "it is truncated, or " if size < entry["bytes"] else ""
        raise TraceFileError(
            f"torchlens.load: {full} is {size} bytes; trace.json recorded {entry['bytes']}: "
            f"{cut}{_TORN}."
        )
    with open(full, "rb", buffering=0) as f:
        head = bytearray(8)
        _read_into(f, memoryview(head), full)
        (n,) = struct.unpack("<Q", bytes(head))
        if n > min(size - 8, _MAX_HEADER):
            raise bad(f"its header would be {n} bytes")
        text = bytearray(n)
        _read_into(f, memoryview(text), full)
        try:
            header = json.loads(bytes(text))
        except (ValueError, RecursionError) as exc:
            raise bad(f"its header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise bad("its header is not a JSON object")
        meta = header.pop("__metadata__", None)
        token = meta.get("save") if isinstance(meta, dict) else None
        if token != entry.get("save"):
            raise TraceFileError(
                f"torchlens.load: {full} was written by the save {token!r}; trace.json names the "
                f"file of the save {entry.get('save')!r}: {_TORN}."
            )
        if set(header) != set(expected):
            extra, missing = (
                sorted(set(header) - set(expected)),
                sorted(set(expected) - set(header)),
            )
            raise TraceFileError(
                f"torchlens.load: {full} holds other tensors than trace.json names (not named "
                f"there: {extra[:5]}; missing: {missing[:5]}): {_TORN}."
            )
        spans = []
        for key, e in header.items():
            dtype, shape, _ = expected[key]
            ok = (
                isinstance(e, dict)
                and isinstance(e.get("shape"), list)
                and isinstance(e.get("data_offsets"), list)
                and len(e["data_offsets"]) == 2
                and all(type(x) is int and x >= 0 for x in e["data_offsets"] + e["shape"])
            )
            if not ok:
                raise bad(f"tensor {key!r} has the header entry {str(e)[:120]}")
            if e.get("dtype") != ST_DTYPES[dtype] or e["shape"] != shape:
                raise TraceFileError(
                    f"torchlens.load: {full} holds tensor {key!r} as {e.get('dtype')} {e['shape']}; trace.json "
                    f"recorded {ST_DTYPES[dtype]} ({str(dtype).removeprefix('torch.')}) {shape}: {_TORN}."
                )
            begin, end = e["data_offsets"]
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise bad(f"tensor {key!r}: {shape} {dtype} does not fill bytes {begin} to {end}")
            spans.append((begin, end, key))
        spans.sort()
        at = 0
        for begin, end, key in spans:
            if begin != at:
                raise bad(
                    f"tensor {key!r} starts at byte {begin}, not {at}: the tensors overlap or leave a gap"
                )
            at = end
        if 8 + n + at != size:
            raise bad(f"its tensors end at byte {8 + n + at} of {size}")
        out = {}
        with Digests() as hashing:
            for _, _, key in spans:  # in file order: one pass over the file
                dtype, shape, _ = expected[key]
                t = torch.empty(shape, dtype=dtype)
                _read_into(f, tensor_bytes(t), full)
                hashing.add(key, tensor_bytes(t))
                out[key] = t
            digests = hashing.results()
    for key, digest in digests.items():
        if digest != expected[key][2]:
            raise TraceFileError(
                f"torchlens.load: the bytes of tensor {key!r} in {full} have the SHA-256 {digest}; "
                f"trace.json recorded {expected[key][2]}: {_TORN}."
            )
    return out


def read_tensors(root: str, doc: dict) -> dict[str, torch.Tensor]:
    """Every tensor trace.json's table names, read from its files and checked against it."""
    files, table = doc.get("tensor_files"), doc.get("tensors")
    entry_ok = lambda e: (
        isinstance(e, dict)
        and type(e.get("bytes")) is int
        and isinstance(e.get("save"), str)
        and "name" in e
    )
    if not isinstance(files, list) or not all(entry_ok(e) for e in files):
        raise TraceFileError(
            "torchlens.load: trace.json's tensor_files is not a list of {name, bytes, save} "
            "entries; the file is malformed."
        )
    if not isinstance(table, dict):
        raise TraceFileError(
            "torchlens.load: trace.json's tensors table is not a JSON object; the file is malformed."
        )
    by_file: list[dict[str, tuple[torch.dtype, list[int], str]]] = [{} for _ in files]
    for key, e in table.items():
        dtype = (
            getattr(torch, e.get("dtype", ""), None)
            if isinstance(e, dict) and isinstance(e.get("dtype"), str)
            else None
        )
        shape = e.get("shape") if isinstance(e, dict) else None
        if (
            not isinstance(dtype, torch.dtype)
            or dtype not in ST_DTYPES
            or type(e.get("file")) is not int
            or not 0 <= e["file"] < len(files)
            or not isinstance(shape, list)
            or not is_shape(tuple(shape))
            or not isinstance(e.get("sha256"), str)
        ):
            raise TraceFileError(
                f"torchlens.load: trace.json's tensors table has the entry {key!r}: {str(e)[:120]}; "
                f"an entry is {{file, dtype, shape, sha256}} (a shape of ints >= 0 whose product is "
                f"below 2**63); the file is malformed."
            )
        by_file[e["file"]][key] = (dtype, shape, e["sha256"])
    tensors: dict[str, torch.Tensor] = {}
    for entry, expected in zip(files, by_file):
        full = _tensor_file(root, entry["name"])
        try:
            tensors.update(_read_tensor_file(full, entry, expected))
        except OSError as exc:
            raise TraceFileError(f"torchlens.load: {full} could not be read: {exc}.") from exc
    return tensors

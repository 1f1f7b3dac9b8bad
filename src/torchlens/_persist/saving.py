"""`Trace.save`: a trace written to a directory, atomically (the tensor file first, then trace.json
renamed over the old one, then the old files removed)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import warnings
from collections.abc import Iterator
from typing import Any

from torchlens._persist.directory import (
    clean,
    fsync_dir,
    locked,
    make_dir,
    named_before,
    os_error,
    write_new,
)
from torchlens._persist.encode import Encoder
from torchlens._persist.format import (
    FORMAT,
    FORMAT_VERSION,
    JSON_NAME,
    TraceFileError,
    running_versions,
)
from torchlens._persist.schema import record_classes
from torchlens._persist.tensor_files import Digests, layout, tensor_bytes


def _model_info(model: Any) -> dict | None:
    """The model's class and its config as a JSON object, for trace.json (None without a model)."""
    if model is None:
        return None
    info: dict[str, Any] = {"class": f"{type(model).__module__}.{type(model).__qualname__}"}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        info["config"] = json.loads(json.dumps(config.to_dict(), default=str))
    return info


def save(trace: Any, path: str | os.PathLike, model: Any = None) -> list[str]:
    """Write `trace` to the directory `path` (created if missing), atomically.

    The tensors go to a new `tensors.<token>.safetensors`, flushed to disk; `trace.json` (naming
    that file with its size and token, and each tensor with its SHA-256) is written last, under a temporary name renamed over
    the old one. Then the old trace's tensor file and the leftovers of stopped saves are
    removed. Other files in the directory are left alone.

    Returns:
        What could not be stored portably (also issued as one warning), empty when nothing.

    Raises:
        TraceFileError: `path` is a file or lies under one, or the directory or its files
            cannot be written (read-only, no permission, disk full). The trace that was there
            before is then unchanged, and no partial file is left; the OS error is the cause.
    """
    if not isinstance(path, (str, os.PathLike)) or path == "":
        raise TraceFileError(
            f"Trace.save({path!r}): pass a directory to write the trace to, as a str or os.PathLike."
        )
    path = os.fspath(path)
    call = f"Trace.save({path!r})"
    make_dir(path, call)
    # Every pending facet check runs first, so the file holds final tensors and statuses and a
    # loaded trace has nothing left to compute (it has no model to compute from).
    trace.check()
    for rec in trace.modules.values():  # and the derived gradients of a trace taken with grads=
        for call_ in rec.calls:
            if getattr(call_, "grads", None) is not None:
                call_.grads.check()
    enc = Encoder(record_classes())
    # Every module call first, so that dicts keyed by id(call) find their keys.
    for rec in trace.modules.values():
        for call_ in rec.calls:
            enc.record(call_, "ModuleCall", f"modules[{call_.address!r}].calls[{call_.index}]")
    root = enc.record(trace, "Trace", "trace")
    token = secrets.token_hex(8)
    tensor_name = f"tensors.{token}.safetensors"
    made: list[str] = []  # the files this save created, removed unless it finished
    committed = False
    had_trace = os.path.isfile(os.path.join(path, JSON_NAME))
    what = f"the directory {path!r}"
    try:
        with locked(path, exclusive=True) as dir_fd:
            had_trace = os.path.isfile(os.path.join(path, JSON_NAME))
            files, digests = [], {}
            if enc.tensors:
                prefix, order = layout(enc.tensors, token)
                full = os.path.join(path, tensor_name)
                what = f"the tensor file {full!r}"
                made.append(full)

                def parts(hashing: Digests) -> Iterator[memoryview | bytes]:
                    yield prefix
                    for (
                        key,
                        t,
                    ) in order:  # a copy made for one tensor is dropped once written and digested
                        view = tensor_bytes(t)
                        hashing.add(key, view)
                        yield view

                with Digests() as hashing:
                    size = write_new(full, parts(hashing))
                    digests = hashing.results()
                files.append({"name": tensor_name, "bytes": size, "save": token})
            doc = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "versions": running_versions(),
                "model_class": trace.model_class,
                "model": _model_info(model),
                "tensor_files": files,
                "tensors": {
                    key: {
                        "file": 0,
                        "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape),
                        "sha256": digests[key],
                    }
                    for key, t in enc.tensors.items()
                },
                "root": root,
                "objects": enc.objects,
                "notes": [f"dropped on save: {d}" for d in enc.dropped],
            }
            text = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")
            before = named_before(path)
            part = os.path.join(path, f"{JSON_NAME}.{token}.part")
            what = f"{JSON_NAME} ({part!r})"
            made.append(part)
            write_new(part, [text])
            os.replace(
                part, os.path.join(path, JSON_NAME)
            )  # the one step from the old trace to the new
            committed = True
            fsync_dir(dir_fd)
            clean(path, {JSON_NAME, tensor_name}, before)
    except BaseException as exc:
        if not committed:
            for f in made:
                with contextlib.suppress(OSError):
                    os.remove(f)
        if isinstance(exc, OSError):
            raise os_error(call, path, exc, what, had_trace) from exc
        raise
    if enc.dropped:
        shown = "; ".join(enc.dropped[:3]) + (
            f"; and {len(enc.dropped) - 3} more" if len(enc.dropped) > 3 else ""
        )
        warnings.warn(
            f"torchlens: Trace.save could not store {len(enc.dropped)} value(s) portably and left "
            f"them out: {shown}. The loaded trace lists them in trace.load_notes.",
            stacklevel=3,
        )
    return enc.dropped

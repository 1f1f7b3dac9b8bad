"""[`torchlens.load`][torchlens.load]: a saved trace read back, from JSON and safetensors only,
every part checked against the others."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from torchlens._persist.decode import Decoder, check_held
from torchlens._persist.directory import locked
from torchlens._persist.format import (
    FORMAT,
    FORMAT_VERSION,
    JSON_NAME,
    TraceFileError,
    running_versions,
)
from torchlens._persist.schema import record_classes
from torchlens._persist.tensor_files import read_tensors

if TYPE_CHECKING:
    from torchlens._trace import Trace


def _read_doc(doc_path: str) -> dict:
    try:
        with open(doc_path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TraceFileError(f"torchlens.load: {doc_path} could not be read: {exc}.") from exc
    try:
        doc = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise TraceFileError(
            f"torchlens.load: {doc_path} nests its values too deeply to be read (a trace.json "
            f"TorchLens writes nests a few levels); the file is malformed."
        ) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise TraceFileError(
            f"torchlens.load: {doc_path} is not valid JSON ({exc}); the file is malformed "
            f"or truncated."
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise TraceFileError(
            f'torchlens.load: {doc_path} is not a TorchLens trace (no "format": {FORMAT!r}).'
        )
    return doc


def load(path: str | os.PathLike) -> Trace:
    """Read a trace written by [`Trace.save`][torchlens.Trace.save].

    Only JSON and safetensors are read; nothing is unpickled, so loading a trace cannot run
    code. The loaded [`Trace`][torchlens.Trace] holds CPU tensors and no model; `mechinterp`'s
    `resolve_alias`, `alias_report` and `compare` work on it.

    Loading checks that `trace.json` and its tensor file are from one save: the file's size and
    save token must be the ones `trace.json` recorded, its header must list exactly the tensors
    of `trace.json`'s table with their dtypes and shapes, each tensor's bytes must have the
    SHA-256 the table recorded, and every op output and facet tensor must have the shape and
    dtype of its record. Each record must have exactly the fields its class
    stores, each of its type.

    Args:
        path: the directory `Trace.save` wrote.

    Returns:
        The trace. `trace.saved_with` holds the versions that wrote it, `trace.model_info` the
        model's class and config (when `save` was given the model), and `trace.load_notes` what
        could not be stored.

    Raises:
        TraceFileError: `path` is not a trace directory; a file is malformed, truncated, or names
            something outside the directory or outside TorchLens's record types; `trace.json` and
            the tensor file are not from one save, or a tensor's shape or dtype is not its
            record's; or the file format version is not the one this TorchLens reads (the message
            lists the versions that differ).

    Examples:
        >>> import tempfile, torch, torchlens
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
        >>> t = torchlens.trace(model, torch.ones(2, 3))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     dropped = t.save(d)
        ...     back = torchlens.load(d)
        >>> dropped
        []
        >>> torch.equal(back.modules["0"].facets["output"], t.modules["0"].facets["output"])
        True
    """
    if not isinstance(path, (str, os.PathLike)) or path == "":
        raise TraceFileError(
            f"load({path!r}): pass the directory Trace.save wrote, as a str or os.PathLike."
        )
    root = os.fspath(path)
    doc_path = os.path.join(root, JSON_NAME)
    if not os.path.isdir(root) or not os.path.isfile(doc_path):
        what = (
            "a file"
            if os.path.isfile(root)
            else "missing"
            if not os.path.exists(root)
            else "a directory without trace.json"
        )
        raise TraceFileError(
            f"torchlens.load({root!r}): that path is {what}; a saved trace is a directory "
            f"holding {JSON_NAME} and the tensor file it names, as written by Trace.save."
        )
    with locked(root, exclusive=False):  # a save into it waits until the files are read
        doc = _read_doc(doc_path)
        if doc.get("format_version") != FORMAT_VERSION:
            theirs = v if isinstance(v := doc.get("versions"), dict) else {}
            ours = running_versions()
            diffs = [
                f"{k} {theirs.get(k)} there, {ours.get(k)} here"
                for k in sorted(set(theirs) | set(ours), key=str)
                if theirs.get(k) != ours.get(k)
            ]
            raise TraceFileError(
                f"torchlens.load: {root!r} is trace format version {repr(doc.get('format_version'))[:40]}; this "
                f"TorchLens reads version {FORMAT_VERSION}. Versions that differ: {'; '.join(diffs) or 'none recorded'}. "
                f"Load it with the TorchLens that wrote it, or save it again with this one."
            )
        versions, notes, objects = doc.get("versions", {}), doc.get("notes", []), doc.get("objects")
        if (
            not isinstance(versions, dict)
            or not all(isinstance(v, str) for v in versions.values())
            or not isinstance(notes, list)
            or not all(isinstance(n, str) for n in notes)
            or not isinstance(doc.get("model"), (dict, type(None)))
            or not isinstance(objects, list)
        ):
            raise TraceFileError(
                f"torchlens.load: {doc_path} is malformed (versions, notes, model or objects is not "
                f"of its type: a dict of str, a list of str, a dict or null, a list)."
            )
        tensors = read_tensors(root, doc)
    try:
        dec = Decoder(objects, record_classes(), tensors)
        trace = dec.obj(doc.get("root"))
        if type(trace).__name__ != "Trace":
            raise TraceFileError("torchlens.load: trace.json's root record is not a Trace.")
        check_held(trace, {id(t): k for k, t in tensors.items()})
    except TraceFileError:
        raise
    except RecursionError:
        raise TraceFileError(
            f"torchlens.load: {doc_path} nests its records too deeply to be read; the file is "
            f"malformed."
        ) from None
    except (
        KeyError,
        TypeError,
        ValueError,
        AttributeError,
        IndexError,
        RuntimeError,
        OverflowError,
    ) as exc:
        raise TraceFileError(
            f"torchlens.load: {doc_path} is malformed ({type(exc).__name__}: {exc})."
        ) from None
    trace.saved_with = versions
    trace.model_info = doc.get("model")
    trace.load_notes = list(notes)
    return trace

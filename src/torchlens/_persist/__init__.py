"""Portable traces: [`Trace.save`][torchlens.Trace.save] and [`torchlens.load`][torchlens.load].

A saved trace is a directory holding:

- `trace.json`: the module tree, the module calls, the op records, the facet sites, dtypes and
  shapes, the `save=` selection, the model's class and config, the versions that wrote it, and
  a table of the tensors: each one's dtype, shape and SHA-256 digest, and the file it is in. It
  names its tensor file with that file's size and the token of the save that wrote it.
- `tensors.<16 hex digits>.safetensors` (absent when the trace holds no tensor): every tensor the
  trace holds, in the safetensors format. Each save writes a file of a new name.

A save is atomic: the tensor file is written and flushed to disk first, under its new name, then
`trace.json` is written under a temporary name and renamed over the old one, which is the one
step that switches the directory from the old trace to the new one. Only then are the old
trace's tensor file and the leftovers of a save that was stopped removed. Each file is flushed to disk
before the next step, so whatever stops a save (a full disk, `SIGKILL`, a power cut), the
directory holds the old trace or the new one, never a mix. Saves and loads of one directory in several threads or
processes take a lock on it (an advisory `flock`, where the platform has one), so a load never
sees a save's clean-up half done.

Saving runs every pending facet check first ([`Trace.check`][torchlens.Trace.check]), and the
derivation of every pending gradient of a trace taken with `grads=` (`GradMap.check`), so the file
holds each facet's and each gradient's final tensor and status and a loaded trace has no pending
check.

Loading reads only JSON and safetensors, so a trace file cannot run code: no pickle is ever
opened, JSON names classes only from a fixed list of TorchLens record types, each record's
fields are the ones it stores and are checked for type, and tensor files must lie inside the
trace directory. `load` ties `trace.json` to its tensors: the tensor file must have the size and save
token `trace.json` recorded, its header must list exactly the tensors of the table with their
dtypes and shapes, packed end to end (checked before any tensor is allocated), each tensor's
bytes must have the SHA-256 digest the table recorded, and every op output and facet must have
the shape and dtype its record says. Whatever fails raises `TraceFileError` saying
what is wrong. A loaded trace has no model; `mechinterp.resolve_alias`, `alias_report` and
`compare` work on it as on the trace it was saved from.

What cannot be stored portably (a `save=` predicate, a model's KV cache object in the output,
complex tensors, attributes that are not a record's stored fields) is dropped with a warning on
save and listed in `trace.load_notes` after load.
"""

from __future__ import annotations

from torchlens._persist.format import FORMAT, FORMAT_VERSION, TraceFileError
from torchlens._persist.loading import load
from torchlens._persist.saving import save

__all__ = ["TraceFileError", "save", "load", "FORMAT", "FORMAT_VERSION"]

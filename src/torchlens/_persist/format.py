"""What a saved trace directory is: the format's name and version, the names of its files, the
versions a save records, and `TraceFileError`, which every failure to write or read one raises."""

from __future__ import annotations

import os
import platform
import re
import sys
from typing import Any, TypeGuard

import torch

from torchlens._core.errors import TorchLensError
from torchlens._core.version import __version__

FORMAT = "torchlens-trace"
#: 2: the tensor file has a name of its own per save, recorded in trace.json with its size and save
#: token, and trace.json holds a table of the tensors' dtypes, shapes and SHA-256 digests.
#: (1: one `tensors.safetensors`, replaced in place, nothing recorded of it.)
FORMAT_VERSION = 2
JSON_NAME = "trace.json"
#: The files a save writes, besides trace.json: `tensors.<token>.safetensors` and, while it writes,
#: `trace.json.<token>.part`. A name of this form that trace.json does not name is a leftover.
OWN_FILE = re.compile(r"(tensors\.[0-9a-f]{16}\.safetensors|trace\.json\.[0-9a-f]{16}\.part)")
#: What a format-1 save left: its tensor file and its temporary names.
V1_FILES = ("tensors.safetensors", "tensors.safetensors.tmp", "trace.json.tmp")
CHUNK = 16 << 20  # bytes per write and read


class TraceFileError(TorchLensError, ValueError):
    """A trace directory could not be written or read: not a trace, malformed, truncated, torn
    (its `trace.json` and tensor file are not from one save), unsafe, written in a format version
    this TorchLens does not read, or on a disk that refused the write (full, read-only). The
    underlying error, if any, is its `__cause__`."""


def running_versions() -> dict[str, str]:
    """The versions of TorchLens, torch, Python (and transformers, once imported) running here:
    a save records them, and a load that refuses a format version names those that differ."""
    out = {
        "torchlens": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if "transformers" in sys.modules:
        out["transformers"] = sys.modules["transformers"].__version__
    return out


def plain_name(name: Any) -> TypeGuard[str]:
    """Whether `name` is a plain `*.safetensors` file name (no directory part)."""
    return (
        isinstance(name, str)
        and bool(name)
        and not os.path.isabs(name)
        and os.sep not in name
        and "/" not in name
        and name not in (".", "..")
        and name.endswith(".safetensors")
    )

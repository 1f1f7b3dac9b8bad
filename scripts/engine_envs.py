"""The engine environments: which peers run outside the main environment, and from where.

A peer whose pins conflict with the main environment gets one virtual environment of its own.
`envs/NAME.txt` pins environment NAME, `envs/build.sh NAME` builds it, and the Makefile's
`engines` target builds one per file into `.venv-engines/NAME`, or `$TORCHLENS_ENGINE_ENVS/NAME`
when that is set. This module is where the Python side reads that rule. The docs harness runs a
`tool=NAME` block in `python(NAME)`, and `engine_runs` runs engine NAME there. An environment and
the tool or engine that runs in it share one name.

It imports only the standard library, so the docs harness can load it while pytest starts.
"""

from __future__ import annotations

import os
import pathlib

__all__ = ["NAMES", "ROOT", "python"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: One environment per pinned file, as the Makefile lists them (`envs/*.txt`).
NAMES: tuple[str, ...] = tuple(sorted(p.stem for p in (ROOT / "envs").glob("*.txt")))


def python(name: str, root: pathlib.Path = ROOT) -> pathlib.Path:
    """The interpreter of environment `name` under checkout `root` (it may not be built yet)."""
    envs = os.environ.get("TORCHLENS_ENGINE_ENVS") or pathlib.Path(root) / ".venv-engines"
    return pathlib.Path(envs) / name / "bin" / "python"

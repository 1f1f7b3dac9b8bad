"""`import engine_runs` in the tests: the engine runs of `scripts/engine_runs.py`.

The runs live beside `scripts/gen_verified.py`, which counts them for the "Verified against"
page and imports them as its sibling; the tests assert on the same runs. Scripts import nothing
from `tests/`, so the dependency goes one way, tests to scripts. This module loads that file by
path and puts it in `sys.modules` under the name `engine_runs` in its own place: the tests and
`gen_verified` (loaded by `tests/test_verified_page.py`) then share one module, and its caches,
so a test session runs each engine once.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

_PATH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "engine_runs.py"
_spec = importlib.util.spec_from_file_location("engine_runs", _PATH)
_module = importlib.util.module_from_spec(_spec)
sys.modules["engine_runs"] = _module  # replaces this module: `import engine_runs` returns the script's
_spec.loader.exec_module(_module)

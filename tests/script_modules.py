"""The repository's scripts, imported as modules by the tests that check them.

`scripts/` holds programs, not a package, and the scripts import nothing from `tests/`: the
dependency goes one way, tests to scripts. A test reaches a script through `load`, which
imports `scripts/NAME.py` under the module name `NAME` once per session, so that a script's
sibling import (`gen_verified` imports `engine_runs`) and every test share one module and its
caches (a test session runs each engine once). The engine runs that `tests/test_engines.py`,
`tests/test_edits.py` and `scripts/gen_verified.py` share are `engine_runs` here.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"


def load(name: str) -> types.ModuleType:
    """`scripts/NAME.py` as the module `NAME` (imported on the first call, the same module after)."""
    path = SCRIPTS / f"{name}.py"
    module = sys.modules.get(name)
    if module is not None and pathlib.Path(getattr(module, "__file__", "") or "").resolve() == path:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


engine_runs = load("engine_runs")

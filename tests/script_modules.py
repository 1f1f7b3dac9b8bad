"""The repository's scripts, imported as modules by the tests that check them.

`scripts/` holds programs, not a package, and the scripts import nothing from `tests/`: the
dependency goes one way, tests to scripts. A test reaches a script through `load`, which
imports `scripts/NAME.py` under the module name `NAME` once per session, so that a script's
sibling import and every test share one module. What a script and a test both run (the engine
runs, the model zoo, the engine rows) is not a script: it is the package `tests/fixtures`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
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


def json_per_hash_seed(
    code: str,
    args: list[str],
    seeds: tuple[str, ...],
    *,
    env: dict | None = None,
    timeout: float = 300,
) -> list:
    """What `python -c code *args` prints as JSON, once per seed, each run in a fresh interpreter
    started with that `PYTHONHASHSEED` (in parallel, from the repository root). A run that fails
    fails the test with the end of its stderr."""
    base = {**os.environ, **(env or {})}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *args],
            cwd=SCRIPTS.parent,
            env={**base, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in seeds
    ]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout))
    return out

"""Docstrings and comments under `src/torchlens/` cite only modules and names that exist.

A module or name written in backticks (`_analysis.structure.find`, `torchlens._capture.stores`,
`torchlens.mechinterp.compare`) must resolve the way `tests/test_code_map.py` resolves the code
map's references, and a Python file or repository path written in backticks (`bench.py`,
`scripts/bench.py`) must exist.
Moving or renaming a module therefore fails here until every comment that cites it follows.
"""

from __future__ import annotations

import re

from test_code_map import _TICKED, ROOT, is_path, symbol_problems

_SOURCES = sorted((ROOT / "src" / "torchlens").rglob("*.py"))


def _file_exists(token: str) -> bool:
    if "/" in token or "*" in token:
        return any(ROOT.glob(token)) if "*" in token else (ROOT / token).exists()
    return any(ROOT.rglob(token))


def test_every_module_or_name_a_source_file_cites_exists():
    problems = [
        f"{p.relative_to(ROOT)}: {x.split(': ', 1)[1]}"
        for p in _SOURCES
        for x in symbol_problems(ROOT, p.read_text(encoding="utf-8"))
    ]
    assert not problems, "\n".join(problems)


def test_every_file_a_source_file_cites_exists():
    problems = []
    for p in _SOURCES:
        for token in _TICKED.findall(p.read_text(encoding="utf-8")):
            cited = token.endswith(".py") or token.split("/")[0] in (
                "src",
                "scripts",
                "tests",
                "docs",
                "envs",
            )
            if (
                cited
                and is_path(token)
                and re.fullmatch(r"[\w./*-]+", token)
                and not _file_exists(token)
            ):
                problems.append(f"{p.relative_to(ROOT)}: `{token}` names no file")
    assert not problems, "\n".join(problems)

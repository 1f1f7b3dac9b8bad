"""Docstrings and comments under `src/torchlens/` cite only modules and names that exist.

A module or name written in backticks (`_analysis.structure.find`, `torchlens._capture.stores`,
`torchlens.mechinterp.compare`) must resolve the way `tests/test_code_map.py` resolves the code
map's references, and a Python file or repository path written in backticks (`bench.py`,
`scripts/bench.py`) must exist.
Moving or renaming a module therefore fails here until every comment that cites it follows.
The documentation pages and the scripts are held to the same rule: a page that sends a reader to
`src/torchlens/_structure.py` after the module moved is as stale as a comment. A path with a part
in capitals (`envs/NAME.txt`, `docs/aliases/SLUG.md`) is a pattern the text explains, not a file.
"""

from __future__ import annotations

import re

from test_code_map import _TICKED, ROOT, is_path, symbol_problems

_SOURCES = sorted((ROOT / "src" / "torchlens").rglob("*.py"))
_FENCED = re.compile(r"^ *(```|~~~).*?^ *\1", re.M | re.S)
_INLINE = re.compile(r"`[^`\n]+`")
_PAGES_AND_SCRIPTS = sorted((ROOT / "docs").rglob("*.md")) + sorted(
    (ROOT / "scripts").rglob("*.py")
)


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


def _text(p) -> str:
    """The text whose backticked tokens cite things: a page without its fenced code blocks (whose
    backtick fences would pair with inline code), one line per inline token."""
    text = p.read_text(encoding="utf-8")
    if p.suffix != ".md":
        return text
    return "\n".join(_INLINE.findall(_FENCED.sub("", text)))


def _missing_files(paths: list) -> list[str]:
    problems = []
    for p in paths:
        for token in _TICKED.findall(_text(p)):
            cited = token.endswith(".py") or token.split("/")[0] in (
                "src",
                "scripts",
                "tests",
                "docs",
                "envs",
            )
            placeholder = any(part.isupper() for part in re.split(r"[/.]", token))
            if (
                cited
                and not placeholder
                and is_path(token)
                and re.fullmatch(r"[\w./*-]+", token)
                and not _file_exists(token)
            ):
                problems.append(f"{p.relative_to(ROOT)}: `{token}` names no file")
    return problems


def test_every_file_a_source_file_cites_exists():
    problems = _missing_files(_SOURCES)
    assert not problems, "\n".join(problems)


def test_every_module_name_or_file_a_page_or_script_cites_exists():
    problems = [
        f"{p.relative_to(ROOT)}: {x.split(': ', 1)[1]}"
        for p in _PAGES_AND_SCRIPTS
        for x in symbol_problems(ROOT, _text(p))
    ]
    problems += _missing_files(_PAGES_AND_SCRIPTS)
    assert not problems, "\n".join(problems)

"""docs/contributing/code-map.md stays true to the code.

The page has one table row per kind of knowledge: the file that holds it (the **File** column),
the names to look for in it (**Names**) and what reads it. These tests read the page's tables and
the source as text and syntax trees (nothing is imported), and require that:

- every module under `src/torchlens/` (recursively) is the file of some row;
- every path the page names exists (a glob such as `envs/*.txt` matches at least one file);
- every name in a row's Names column is defined in that row's file: at its top level, or
  `Class.attribute` in one of its classes (a file that is not Python must contain the name);
- every `module.NAME` the page names (`_save.parse_save`, `mechinterp._resolver.alias_report`,
  `docs_harness.DocItem`; modules of `src/torchlens/` by their dotted name under `torchlens`,
  those of `tests/` and `scripts/` by their file name) is defined or imported in that module, and
  no name that looks like a module reference (`_something.NAME`, `torchlens.X`) points at a
  module that does not exist.

The last test plants a stale row, a stale path and a module without a row in a small tree and
checks that each check reports it.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = pathlib.Path("docs/contributing/code-map.md")

_TICKED = re.compile(r"`([^`]+)`")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_FILE_NAME = re.compile(r"[\w.-]+\.(?:py|md|txt|sh|json|ya?ml|toml|svg|cfg)")


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table line; a `|` inside backticks does not split."""
    cells, cell, ticked = [], "", False
    for char in line.strip().strip("|"):
        if char == "`":
            ticked = not ticked
        if char == "|" and not ticked:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += char
    return [*cells, cell.strip()]


def tables(text: str) -> list[tuple[list[str], list[tuple[int, dict[str, str]]]]]:
    """Each table of the page: its header cells and its rows as ``(line, {header: cell})``."""
    found, lines = [], text.split("\n")
    i = 0
    while i < len(lines):
        if (
            lines[i].startswith("|")
            and i + 1 < len(lines)
            and re.fullmatch(r"\|[\s|:-]+\|", lines[i + 1].strip())
        ):
            header, rows, i = _cells(lines[i]), [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append((i + 1, dict(zip(header, _cells(lines[i])))))
                i += 1
            found.append((header, rows))
        else:
            i += 1
    return found


def is_path(token: str) -> bool:
    """Whether a backticked token is a file or folder path (not a symbol, a literal or prose)."""
    if " " in token or token.startswith(("#", "-", '"', "'")) or ":" in token:
        return False
    return "/" in token or token == "Makefile" or _FILE_NAME.fullmatch(token) is not None


def page_paths(text: str) -> list[str]:
    return sorted({t for t in _TICKED.findall(text) if is_path(t)})


def missing_paths(root: pathlib.Path, text: str) -> list[str]:
    """The paths the page names that do not exist under ``root``."""
    return [
        p for p in page_paths(text) if not (any(root.glob(p)) if "*" in p else (root / p).exists())
    ]


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Module name -> file: ``src/torchlens`` modules by dotted name (with and without ``torchlens.``),
    ``tests/`` and ``scripts/`` modules by file name."""
    out: dict[str, pathlib.Path] = {}
    for folder in ("tests", "scripts"):
        out.update({path.stem: path for path in sorted((root / folder).glob("*.py"))})
    package = root / "src" / "torchlens"
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        out[".".join(("torchlens", *parts))] = path
        if parts:
            out[".".join(parts)] = path
    return out


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _bound(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a block binds at its own level (definitions and assignments, inside ``if``/``try`` too)."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = node
        elif isinstance(node, (ast.If, ast.Try)):
            for block in (
                node.body,
                node.orelse,
                getattr(node, "finalbody", []),
                *(h.body for h in getattr(node, "handlers", [])),
            ):
                names.update(_bound(block))
    return names


def defined(path: pathlib.Path) -> dict[str, ast.AST]:
    return _bound(_tree(path).body)


def imported(path: pathlib.Path) -> set[str]:
    return {
        alias.asname or alias.name.split(".")[0]
        for node in _tree(path).body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }


def class_attributes(node: ast.ClassDef) -> set[str]:
    """What a class defines: its body's names, and the ``self.X`` its methods assign."""
    names = set(_bound(node.body))
    for leaf in ast.walk(node):
        if (
            isinstance(leaf, ast.Attribute)
            and isinstance(leaf.ctx, ast.Store)
            and isinstance(leaf.value, ast.Name)
            and leaf.value.id == "self"
        ):
            names.add(leaf.attr)
    return names


def has_name(path: pathlib.Path, name: str, *, imports: bool = False) -> bool:
    """Whether ``name`` (``NAME`` or ``Class.attribute``) is defined in the Python file ``path``."""
    first, _, rest = name.partition(".")
    node = defined(path).get(first)
    if node is None:
        return imports and not rest and first in imported(path)
    return not rest or (
        isinstance(node, ast.ClassDef) and "." not in rest and rest in class_attributes(node)
    )


def file_rows(text: str):
    """``(line, File cell, Names cell)`` of every row of a table with a File column."""
    for header, rows in tables(text):
        if "File" in header:
            for line, row in rows:
                yield line, row.get("File", ""), row.get("Names", "")


def row_problems(root: pathlib.Path, text: str) -> list[str]:
    """A row without exactly one file, or a name its file does not define."""
    problems = []
    for line, file_cell, names_cell in file_rows(text):
        files = [t for t in _TICKED.findall(file_cell) if is_path(t)]
        if len(files) != 1:
            problems.append(f"{PAGE}:{line}: the File cell must name one file, not {files}")
            continue
        paths = sorted(root.glob(files[0])) if "*" in files[0] else [root / files[0]]
        for name in _TICKED.findall(names_cell):
            for path in (p for p in paths if p.is_file()):
                there = (
                    has_name(path, name)
                    if path.suffix == ".py"
                    else name in path.read_text(encoding="utf-8")
                )
                if not there:
                    problems.append(
                        f"{PAGE}:{line}: `{name}` is not defined in {path.relative_to(root)}"
                    )
    return problems


def symbol_problems(root: pathlib.Path, text: str) -> list[str]:
    """A ``module.NAME`` the page names that its module lacks, or a module reference to no module."""
    known, problems = modules(root), []
    for token in sorted(
        {t for t in _TICKED.findall(text) if _DOTTED.fullmatch(t) and not is_path(t)}
    ):
        parts = token.split(".")
        prefix = next((n for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in known), 0)
        if not prefix:
            if parts[0].startswith("_") or parts[0] in ("torchlens", "mechinterp"):
                problems.append(f"{PAGE}: `{token}` names a module that does not exist")
            continue
        module, rest = known[".".join(parts[:prefix])], ".".join(parts[prefix:])
        if rest and not has_name(module, rest, imports=True):
            problems.append(f"{PAGE}: `{token}`: {module.relative_to(root)} has no `{rest}`")
    return problems


def modules_without_a_row(root: pathlib.Path, text: str) -> list[str]:
    files = {t for _, cell, _ in file_rows(text) for t in _TICKED.findall(cell)}
    return [
        path.relative_to(root).as_posix()
        for path in sorted((root / "src" / "torchlens").rglob("*.py"))
        if path.relative_to(root).as_posix() not in files
    ]


def _page() -> str:
    return (ROOT / PAGE).read_text(encoding="utf-8")


def test_every_module_under_src_has_a_row():
    missing = modules_without_a_row(ROOT, _page())
    assert not missing, f"{PAGE} has no row for {missing}: add one saying what each holds"


def test_every_path_the_page_names_exists():
    assert page_paths(_page()), "no path found on the page: the parser is broken"
    missing = missing_paths(ROOT, _page())
    assert not missing, f"{PAGE} names paths that do not exist: {missing}"


def test_every_name_in_a_row_is_defined_in_its_file():
    rows = list(file_rows(_page()))
    assert len(rows) >= 40, f"only {len(rows)} rows found: the table parser is broken"
    problems = row_problems(ROOT, _page())
    assert not problems, "\n".join(problems)


def test_every_module_name_on_the_page_exists():
    problems = symbol_problems(ROOT, _page())
    assert not problems, "\n".join(problems)


def test_the_checks_catch_a_stale_row_a_stale_path_and_a_module_without_a_row(tmp_path):
    package = tmp_path / "src" / "torchlens"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from ._a import f\n\n__all__ = ['f']\n")
    (package / "_a.py").write_text(
        "class C:\n    x = 1\n    def __init__(self):\n        self.y = 2\n\ndef f():\n    pass\n"
    )
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "_b.py").write_text("B = 1\n")
    (tmp_path / "tests").mkdir()
    page = (
        "| Knowledge | File | Names | Read by |\n| --- | --- | --- | --- |\n"
        "| surface | `src/torchlens/__init__.py` | `__all__` | `torchlens.f`, `_a.C.y` |\n"
        "| a | `src/torchlens/_a.py` | `f`, `C.x`, `C.y` | `sub._b.B` |\n"
        "| sub | `src/torchlens/sub/__init__.py` | | |\n"
    )
    assert not (
        row_problems(tmp_path, page)
        or symbol_problems(tmp_path, page)
        or missing_paths(tmp_path, page)
    )
    assert modules_without_a_row(tmp_path, page) == [
        "src/torchlens/sub/_b.py"
    ]  # a module without a row

    stale = (
        page
        + "| old | `src/torchlens/_a.py` | `g`, `C.z` | `_a.h`, `_gone.X`, `torchlens.nope` |\n"
    )
    assert row_problems(tmp_path, stale) == [
        f"{PAGE}:6: `g` is not defined in src/torchlens/_a.py",
        f"{PAGE}:6: `C.z` is not defined in src/torchlens/_a.py",
    ]
    assert symbol_problems(tmp_path, stale) == [
        f"{PAGE}: `_a.h`: src/torchlens/_a.py has no `h`",
        f"{PAGE}: `_gone.X` names a module that does not exist",
        f"{PAGE}: `torchlens.nope`: src/torchlens/__init__.py has no `nope`",
    ]
    moved = page + "| moved | `src/torchlens/_moved.py` | `f` | `scripts/gen_*.py` |\n"
    assert missing_paths(tmp_path, moved) == ["scripts/gen_*.py", "src/torchlens/_moved.py"]
    reexport = (
        page + "| surface | `src/torchlens/__init__.py` | `f` | |\n"
    )  # imported there, defined in _a.py
    assert row_problems(tmp_path, reexport) == [
        f"{PAGE}:6: `f` is not defined in src/torchlens/__init__.py"
    ]
    assert row_problems(
        tmp_path, page + "| two | `src/torchlens/_a.py`, `src/torchlens/__init__.py` | | |\n"
    )

"""The package is built in layers, as docs/contributing/code-map.md says.

The page's "Layers" table ranks the layers; every row of a module under `src/torchlens/` names
the module's layer in its **Layer** column. These tests read the page and the source as syntax
trees (nothing is imported) and require that:

- every module has a layer, and the layer is one the table ranks;
- no module imports a module of a higher-ranked layer (imports inside `if TYPE_CHECKING:` run
  only for type checkers and may reach up; imports inside functions count like any other);
- no TorchLens module is imported inside a function, unless the line says why (`# import here:`);
- no two modules import each other, directly or through others (imports inside
  `if TYPE_CHECKING:` left out, as Python leaves them out).

The last test plants an upward import, a function-level import and a cycle in a small tree and
checks that each is reported.
"""

from __future__ import annotations

import ast
import pathlib

from test_code_map import PAGE, ROOT, file_rows, tables

_REASON = "# import here:"


def layer_ranks(text: str) -> dict[str, int]:
    """Layer name -> rank, from the page's table with a Rank column."""
    for header, rows in tables(text):
        if "Layer" in header and "Rank" in header:
            return {row["Layer"]: int(row["Rank"]) for _, row in rows}
    return {}


def module_layers(text: str) -> dict[str, str]:
    """`src/torchlens/...` path -> the layer its row names (an empty cell for a row without one)."""
    out: dict[str, str] = {}
    for header, rows in tables(text):
        if "File" not in header or "Layer" not in header:
            continue
        for _, row in rows:
            path = row["File"].strip("`")
            if path.startswith("src/torchlens/"):
                out[path] = row.get("Layer", "").strip()
    return out


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = path.relative_to(root / "src").with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an `ImportFrom` names (relative imports resolved against `importer`)."""
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(root: pathlib.Path, path: pathlib.Path) -> list[tuple[str, int, bool, bool, str]]:
    """(imported torchlens module, line, inside a function, inside `if TYPE_CHECKING:`, the line's
    text) for every import of a TorchLens module in `path`. `from X import name` counts as an
    import of `X.name` where that is a module, else of `X`."""
    known = {module_name(root, p) for p in (root / "src" / "torchlens").rglob("*.py")}
    me = module_name(root, path)
    lines = path.read_text(encoding="utf-8").split("\n")
    found = []

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            fn = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            )
            guard = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "torchlens":
                        found.append(
                            (alias.name, child.lineno, fn, type_only, lines[child.lineno - 1])
                        )
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(me, path.name == "__init__.py", child)
                if base.split(".")[0] != "torchlens":
                    continue
                for alias in child.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                    found.append((target, child.lineno, fn, type_only, lines[child.lineno - 1]))
            if guard:
                for part in child.body:
                    visit(ast.Module(body=[part], type_ignores=[]), fn, True)
                for part in child.orelse:
                    visit(ast.Module(body=[part], type_ignores=[]), fn, type_only)
            else:
                visit(child, fn, type_only)

    visit(ast.parse("\n".join(lines), filename=str(path)), False, False)
    return found


def layer_problems(root: pathlib.Path, text: str) -> list[str]:
    """Modules without a ranked layer, upward imports, function-level imports without a reason,
    and import cycles."""
    ranks, layers = layer_ranks(text), module_layers(text)
    problems = []
    paths = sorted((root / "src" / "torchlens").rglob("*.py"))
    by_module = {module_name(root, p): p for p in paths}
    rank_of: dict[str, int] = {}
    for p in paths:
        rel = p.relative_to(root).as_posix()
        layer = layers.get(rel)
        if layer not in ranks:
            problems.append(f"{rel}: its row names no layer of the Layers table ({layer!r})")
        else:
            rank_of[module_name(root, p)] = ranks[layer]
    graph: dict[str, set[str]] = {m: set() for m in by_module}
    for m, p in by_module.items():
        rel = p.relative_to(root).as_posix()
        for target, line, in_function, type_only, source in imports(root, p):
            if target not in by_module:
                continue
            if in_function and _REASON not in source:
                problems.append(
                    f"{rel}:{line}: imports {target} inside a function; import it at the top "
                    f"(or say why not with '{_REASON} ...')"
                )
            if (
                not type_only
                and m in rank_of
                and target in rank_of
                and rank_of[target] > rank_of[m]
            ):
                problems.append(
                    f"{rel}:{line}: imports {target}, a layer above its own "
                    f"({layers[by_module[target].relative_to(root).as_posix()]} over "
                    f"{layers[rel]})"
                )
            if not type_only and not in_function and target != m:
                graph[m].add(target)
    # package initialization: importing a.b.c runs a/__init__ and a/b/__init__ first
    for m in by_module:
        parts = m.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in graph and parent != m:
                for importer, targets in graph.items():
                    if (
                        m in targets
                        and importer != parent
                        and not importer.startswith(parent + ".")
                    ):
                        targets.add(parent)
    problems += [f"import cycle: {' -> '.join(c)}" for c in _cycles(graph)]
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp) + [sorted(comp)[0]])

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_every_module_has_a_ranked_layer_and_imports_only_downward():
    text = (ROOT / PAGE).read_text(encoding="utf-8")
    assert len(layer_ranks(text)) >= 5, "the Layers table was not found: the parser is broken"
    assert len(list(file_rows(text))) >= 40
    problems = layer_problems(ROOT, text)
    assert not problems, "\n".join(problems)


def test_the_checks_catch_an_upward_import_a_function_level_import_and_a_cycle(tmp_path):
    package = tmp_path / "src" / "torchlens"
    (package / "_low").mkdir(parents=True)
    (package / "__init__.py").write_text("from torchlens._top import f\n")
    (package / "_low" / "__init__.py").write_text("")
    (package / "_low" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
        "    from torchlens._top import f\n\nX = 1\n"
    )
    (package / "_top.py").write_text(
        "from torchlens._low import a\n\n\ndef f():\n"
        "    from torchlens._low.a import X  # import here: a reason\n    return X\n"
    )
    page = (
        "| Layer | Rank | Where | What |\n| --- | --- | --- | --- |\n| low | 0 | x | x |\n| top | 1 | x | x |\n\n"
        "| Knowledge | File | Layer | Names | Read by |\n| --- | --- | --- | --- | --- |\n"
        "| a | `src/torchlens/__init__.py` | top | | |\n| b | `src/torchlens/_low/__init__.py` | low | | |\n"
        "| c | `src/torchlens/_low/a.py` | low | | |\n| d | `src/torchlens/_top.py` | top | | |\n"
    )
    assert (
        layer_problems(tmp_path, page) == []
    )  # a type-only upward import and a function import with a reason
    (package / "_low" / "a.py").write_text(
        "from torchlens._top import f\n\nX = 1\n"
    )  # upward, and a cycle
    problems = layer_problems(tmp_path, page)
    assert any(
        "src/torchlens/_low/a.py:1: imports torchlens._top, a layer above its own (top over low)"
        in p
        for p in problems
    ), problems
    assert any(
        p.startswith("import cycle:") and "torchlens._low.a" in p and "torchlens._top" in p
        for p in problems
    )
    (package / "_low" / "a.py").write_text(
        "def g():\n    from torchlens._low import b\n\n\nX = 1\n"
    )
    (package / "_low" / "b.py").write_text("")
    problems = layer_problems(tmp_path, page + "| e | `src/torchlens/_low/b.py` | low | | |\n")
    assert problems == [
        "src/torchlens/_low/a.py:2: imports torchlens._low.b inside a function; import it at the "
        "top (or say why not with '# import here: ...')"
    ]
    problems = layer_problems(
        tmp_path,
        page.replace(
            "| d | `src/torchlens/_top.py` | top |", "| d | `src/torchlens/_top.py` | mid |"
        ),
    )
    assert "src/torchlens/_top.py: its row names no layer of the Layers table ('mid')" in problems

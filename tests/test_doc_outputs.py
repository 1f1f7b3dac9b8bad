"""The site shows what each example printed: the recorder (tests/doc_outputs.py) and the page side
(scripts/mkdocs_hooks.py) must agree on which block an output belongs to.

The recorder is loaded for every session by ``-p doc_outputs`` in pyproject.toml's addopts, so a
run of one page (``pytest docs/page.md``) updates ``build/doc-outputs.json`` too.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest
from pytest_markdown_docs.plugin import FenceSyntax

from docs_harness import block_body, extract_blocks, read_page

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", REPO / "scripts" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recorder():
    """The recorder module, as pytest loaded it (`-p doc_outputs`)."""
    import doc_outputs

    return doc_outputs


def _pages():
    return sorted((REPO / "docs").rglob("*.md"))


def test_the_page_side_finds_every_block_the_harness_runs(hooks):
    """Same blocks, same hashes: the hook's fence scan and the harness's parser agree on every page."""
    checked = 0
    for path in _pages():
        text = read_page(path)
        display = path.relative_to(REPO).as_posix()
        harness = [_recorder().code_sha256(block_body(b.definition))
                   for b in extract_blocks(text, path, display, FenceSyntax.superfences)]
        lines = text.split("\n")
        page_side = [
            hooks.code_sha256("\n".join(hooks._dedent(line, indent) for line in lines[opening + 1 : closing]))
            for opening, closing, indent in hooks.python_blocks(text)
        ]
        assert page_side == harness, display
        checked += len(harness)
    assert checked > 30


def test_an_output_lands_under_its_block_and_the_header_becomes_a_badge(hooks):
    page = "Text.\n\n=== \"Tab\"\n\n    ```python\n    # migration-test: tool=nnsight expected=(1, 'a')\n" \
           "    print('hi')\n    RESULT = (1, 'a')\n    ```\n\nAfter.\n"
    code = "# migration-test: tool=nnsight expected=(1, 'a')\nprint('hi')\nRESULT = (1, 'a')"
    rendered = hooks.render_examples(page, [{"code_sha256": hooks.code_sha256(code), "stdout": "hi\n",
                                             "outcome": "passed"}])
    assert "# migration-test" not in rendered
    assert "`RESULT == (1, 'a')`" in rendered and "with nnsight" in rendered
    assert "    ```{.text .tl-output}\n    hi\n    ```" in rendered
    assert rendered.endswith("\nAfter.\n")
    # An edited block (another hash) gets no output; a page that explains headers keeps them.
    edited = hooks.render_examples(page.replace("print('hi')", "print('ho')"), [
        {"code_sha256": hooks.code_sha256(code), "stdout": "hi\n", "outcome": "passed"}])
    assert "tl-output" not in edited
    assert "# migration-test" in hooks.render_examples(page, [], show_headers=True)


def test_the_recorder_writes_what_a_block_printed(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makefile(".md", page="# P\n\n```python\nprint('first line')\nprint(2 + 2)\n```\n\n"
                                   "```python\nx = 1\n```\n")
    pytester.makeini(
        "[pytest]\naddopts = -p pytest_markdown_docs.plugin -p docs_harness -p doc_outputs\n"
        "    --markdown-docs --markdown-docs-syntax=superfences\n"
        "filterwarnings = ignore::pytest.PytestAssertRewriteWarning\n"
    )
    result = pytester.runpytest("-q", "page.md")
    result.assert_outcomes(passed=2)
    data = json.loads((pytester.path / "build" / "doc-outputs.json").read_text())
    blocks = data["pages"]["page.md"]["blocks"]
    assert [(b["line"], b["stdout"], b["outcome"]) for b in blocks] == [(3, "first line\n4\n", "passed")]
    assert blocks[0]["code_sha256"] == _recorder().code_sha256("print('first line')\nprint(2 + 2)")


def test_names_with_a_layer_placeholder_are_set_as_code_in_prose(hooks):
    """Browsers break "blocks.{L}.hook_in" before the brace; as inline code it never breaks."""
    page = ("read blocks.{L}.hook_in and layers_output[{L}].\n"
            "| model.layers.{i}.self_attn | `blocks.{L}.x` | [link](a.{L}.b) <b title='c.{L}.d'>e</b> |\n"
            "```python\nname = 'blocks.{L}.x'\n```\n{L} alone, and a set {1, 2}")
    assert hooks.code_placeholder_names(page) == (
        "read `blocks.{L}.hook_in` and `layers_output[{L}]`.\n"
        "| `model.layers.{i}.self_attn` | `blocks.{L}.x` | [link](a.{L}.b) <b title='c.{L}.d'>e</b> |\n"
        "```python\nname = 'blocks.{L}.x'\n```\n{L} alone, and a set {1, 2}")

"""The site shows what each example printed and how many passed: the recorder (tests/doc_outputs.py)
and the page side (scripts/mkdocs_hooks.py) must agree on which block an entry belongs to.

The recorder is loaded for every session by ``-p doc_outputs`` in pyproject.toml's addopts, so a
run of one page (``pytest docs/page.md``) updates ``tests/doc_outputs.json`` too. That file is committed,
and the last test here fails when it is stale for a page of the site.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pathlib
import re

import pytest
from docs_harness import block_body, page_blocks, scan_python_headers

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hooks():
    spec = importlib.util.spec_from_file_location(
        "mkdocs_hooks", REPO / "scripts" / "mkdocs_hooks.py"
    )
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
        text = path.read_text(encoding="utf-8-sig")
        display = path.relative_to(REPO).as_posix()
        harness = [
            _recorder().code_sha256(block_body(block)) for _, block in page_blocks(text, path)
        ]
        lines = text.split("\n")
        page_side = [
            hooks.code_sha256(
                "\n".join(hooks._dedent(line, indent) for line in lines[opening + 1 : closing])
            )
            for opening, closing, indent in hooks.python_blocks(text)
        ]
        assert page_side == harness, display
        checked += len(harness)
    assert checked > 30


def test_an_output_lands_under_its_block_and_the_header_becomes_a_badge(hooks):
    page = (
        "Text.\n\n=== \"Tab\"\n\n    ```python\n    # migration-test: tool=nnsight expected=(1, 'a')\n"
        "    print('hi')\n    RESULT = (1, 'a')\n    ```\n\nAfter.\n"
    )
    code = "# migration-test: tool=nnsight expected=(1, 'a')\nprint('hi')\nRESULT = (1, 'a')"
    rendered = hooks.render_examples(
        page, [{"code_sha256": hooks.code_sha256(code), "stdout": "hi\n", "outcome": "passed"}]
    )
    assert "# migration-test" not in rendered
    assert "`RESULT == (1, 'a')`" in rendered and "with nnsight" in rendered
    assert "    ```{.text .tl-output}\n    hi\n    ```" in rendered
    assert rendered.endswith("\nAfter.\n")
    # An edited block (another hash) gets no output; a page that explains headers keeps them.
    edited = hooks.render_examples(
        page.replace("print('hi')", "print('ho')"),
        [{"code_sha256": hooks.code_sha256(code), "stdout": "hi\n", "outcome": "passed"}],
    )
    assert "tl-output" not in edited
    assert "# migration-test" in hooks.render_examples(page, [], show_headers=True)


def test_the_recorder_writes_what_a_block_printed(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makefile(
        ".md",
        page="# P\n\n```python\nprint('first line')\nprint(2 + 2)\n```\n\n```python\nx = 1\n```\n",
    )
    pytester.makeini(
        "[pytest]\naddopts = -p pytest_markdown_docs.plugin -p timeout -p docs_harness -p doc_outputs\n"
        "    --markdown-docs --markdown-docs-syntax=superfences\n"
        "filterwarnings = ignore::pytest.PytestAssertRewriteWarning\n"
    )
    result = pytester.runpytest("-q", "page.md")
    result.assert_outcomes(passed=2)
    data = json.loads((pytester.path / "tests" / "doc_outputs.json").read_text())
    blocks = data["pages"]["page.md"]["blocks"]
    assert [(b["line"], b["stdout"], b["outcome"]) for b in blocks] == [
        (3, "first line\n4\n", "passed"),
        (8, "", "passed"),
    ]
    assert blocks[0]["code_sha256"] == _recorder().code_sha256("print('first line')\nprint(2 + 2)")


def test_names_with_a_layer_placeholder_are_set_as_code_in_prose(hooks):
    """Browsers break "blocks.{L}.hook_in" before the brace; as inline code it never breaks."""
    page = (
        "read blocks.{L}.hook_in and layers_output[{L}].\n"
        "| model.layers.{i}.self_attn | `blocks.{L}.x` | [link](a.{L}.b) <b title='c.{L}.d'>e</b> |\n"
        "```python\nname = 'blocks.{L}.x'\n```\n{L} alone, and a set {1, 2}"
    )
    assert hooks.code_placeholder_names(page) == (
        "read `blocks.{L}.hook_in` and `layers_output[{L}]`.\n"
        "| `model.layers.{i}.self_attn` | `blocks.{L}.x` | [link](a.{L}.b) <b title='c.{L}.d'>e</b> |\n"
        "```python\nname = 'blocks.{L}.x'\n```\n{L} alone, and a set {1, 2}"
    )


INNER_INI = (
    "[pytest]\naddopts = -p pytest_markdown_docs.plugin -p timeout -p docs_harness -p doc_outputs\n"
    "    --markdown-docs --markdown-docs-syntax=superfences\n"
    "filterwarnings = ignore::pytest.PytestAssertRewriteWarning\n"
)
PAGE = (
    "# P\n\n```python\nx = 1\n```\n\n```python\nraise ValueError('no')\n```\n\n"
    "```python\n# migration-test: tool=absent-engine expected=1\nRESULT = 1\n```\n\n"
    "```{.python notest}\n# migration-test: tool=torchlens expected=1\n```\n"
)


class _Config:
    def __init__(self, root):
        self.config_file_path = str(root / "mkdocs.yml")


class _Page:
    def __init__(self, path):
        self.file = type(
            "File", (), {"abs_src_path": str(path), "content_string": path.read_text()}
        )()


def _run_page(pytester, monkeypatch, hooks, text):
    """Run one page in an inner session; return the note the site puts on it."""
    import docs_harness

    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setitem(docs_harness.TOOL_IMPORTS, "absent-engine", "absent_engine")
    pytester.makeini(INNER_INI)
    path = pytester.makefile(".md", page=text)
    pytester.runpytest("-q", "page.md")
    hooks.on_config(_Config(pytester.path))
    out = hooks.on_page_markdown(path.read_text(), _Page(path), _Config(pytester.path), None)
    return path, out


def test_the_note_counts_the_outcomes_of_the_blocks_on_the_page(pytester, monkeypatch, hooks):
    """Passed, failed, skipped, and a page problem (an uncollected header) counted as a failure."""
    path, out = _run_page(pytester, monkeypatch, hooks, PAGE)
    data = json.loads((pytester.path / "tests" / "doc_outputs.json").read_text())
    entry = data["pages"]["page.md"]
    assert [(b["line"], b["outcome"]) for b in entry["blocks"]] == [
        (3, "passed"),
        (7, "failed"),
        (11, "skipped"),
        (17, "failed"),
    ]
    assert {"sha256", "timestamp", "torchlens_version"} <= set(entry)
    assert '!!! failure "1/3 examples verified"' in out and "2 failed, 1 skipped." in out
    # An edited block counts as not run; an edited page is stale.
    edited = path.read_text().replace("x = 1", "x = 2")
    status = hooks._status(entry, edited)
    assert (status["examples"], status["passed"], status["failed"], status["skipped"]) == (
        3,
        0,
        2,
        1,
    )
    assert hooks._note(status, "another hash").startswith('!!! warning "stale: page changed')


def test_the_note_says_verified_when_every_block_passed(pytester, monkeypatch, hooks):
    _, out = _run_page(
        pytester, monkeypatch, hooks, "# P\n\n```python\nx = 1\n```\n\n```python\nprint(2)\n```\n"
    )
    assert '!!! success "2/2 examples verified"' in out
    assert "```{.text .tl-output}\n2\n```" in out


def test_hook_puts_the_note_under_the_title_and_tolerates_a_missing_file(tmp_path, hooks):
    markdown = "```python\n# not a title\n```\n# Title\n\nText"
    assert hooks._insert_after_title(markdown, "NOTE").split("\n")[3:6] == ["# Title", "", "NOTE"]
    assert hooks._load_status(_Config(tmp_path)) == {}
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "doc_outputs.json").write_text("{not json")
    assert hooks._load_status(_Config(tmp_path)) == {}
    assert hooks._note({"examples": 0, "sha256": "a"}, "a") is None


def test_a_long_output_is_cut_to_its_start_and_end_for_the_site(pytester, monkeypatch, hooks):
    """An engine's log can run to thousands of lines; the site keeps its start and its end."""
    _run_page(
        pytester,
        monkeypatch,
        hooks,
        "# P\n\n```python\nprint('first' + 'x' * 9000 + 'last')\n```\n",
    )
    stdout = json.loads((pytester.path / "tests" / "doc_outputs.json").read_text())["pages"][
        "page.md"
    ]["blocks"][0]["stdout"]
    assert (
        stdout.startswith("firstx")
        and stdout.endswith("xlast\n")
        and "[... 6010 characters cut ...]" in stdout
    )
    assert len(stdout) < 3100


_FENCE_INFO = re.compile(r"^ *(?:`{3,}|~{3,})(?P<info>[^`]*)$")


def unrenderable_python_fences(text: str) -> list[tuple[int, str]]:
    """``(line, info)`` of the Python fences whose info string Material would show as plain text.

    PyMdown's superfences takes ``python`` followed by ``key="value"`` options, or the brace form
    ``{.python notest}``; a bare word after the language (```` ```python notest ````) silently
    turns the whole block into text on the site, while the harness still runs or skips it.
    """
    found, fence = [], None
    for number, line in enumerate(text.split("\n"), start=1):
        stripped = line.strip()
        if fence is not None:
            fence = None if len(stripped) >= len(fence) and set(stripped) == {fence[0]} else fence
        elif match := _FENCE_INFO.match(line):
            fence, info = stripped[: len(stripped) - len(match["info"])], match["info"].strip()
            words = re.findall(r'[^\s=]+="[^"]*"|\S+', info)
            if (
                words
                and words[0].lower() in ("py", "python", "python3")
                and any("=" not in w for w in words[1:])
            ):
                found.append((number, info))
    return found


def test_no_page_has_a_python_fence_the_site_would_show_as_text():
    sample = '```python notest\nx = 1\n```\n\n```python title="a.py" hl_lines="1 2"\nx\n```\n\n```{.python notest}\n```\n'
    assert unrenderable_python_fences(sample) == [(1, "python notest")]
    found = {
        path.relative_to(REPO).as_posix(): bad
        for path in _pages()
        if (bad := unrenderable_python_fences(path.read_text(encoding="utf-8-sig")))
    }
    assert not found, f"write these fences in the brace form, e.g. ```{{.python notest}}: {found}"


@pytest.mark.after_docs
def test_the_recorded_outputs_are_current(request):
    """tests/doc_outputs.json is committed so that every build shows the outputs and the notes; it must hold,
    for every page with examples, the page as it is and a passing record of each of its blocks. Runs after
    this session's docs blocks (marker `after_docs`) and counts what they recorded."""
    import doc_outputs

    pages = doc_outputs.merged(request.config)["pages"]
    stale = {}
    for path in _pages():
        display = path.relative_to(REPO).as_posix()
        text = path.read_text(encoding="utf-8-sig")
        hashes = [
            (block.start_line, _recorder().code_sha256(block_body(block)))
            for _, block in page_blocks(text, path)
        ]
        if not hashes and not scan_python_headers(text):
            continue
        entry = pages.get(display)
        if entry is None:
            stale[display] = "never recorded"
            continue
        problems = []
        if entry.get("sha256") != hashlib.sha256(text.encode("utf-8")).hexdigest():
            problems.append("the page changed since its blocks were recorded")
        outcomes = {b.get("code_sha256"): b.get("outcome") for b in entry.get("blocks", [])}
        problems += [
            f"line {line}: {outcomes.get(code, 'not run')}"
            for line, code in hashes
            if outcomes.get(code) != "passed"
        ]
        problems += [
            f"line {b['line']}: a header that was not collected"
            for b in entry.get("blocks", [])
            if b.get("code_sha256") is None
        ]
        if problems:
            stale[display] = problems
    listing = "\n".join(f"  {page}: {why}" for page, why in stale.items())
    assert not stale, (
        f"{doc_outputs.OUTPUTS_FILE} is stale; run these pages (pytest docs/PAGE.md, with "
        f"TORCHLENS_ENGINE_ENVS set for engine blocks) and commit the file:\n{listing}"
    )


def test_the_recording_is_kept_for_a_skip_and_unchanged_by_a_run_that_changes_nothing(
    pytester, monkeypatch
):
    import docs_harness

    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("CI", raising=False)
    pytester.makeini(INNER_INI)
    page = "# P\n\n```python\n# migration-test: tool=absent-engine expected=1\nprint('seen')\nRESULT = 1\n```\n"
    pytester.makefile(".md", page=page)
    monkeypatch.setitem(
        docs_harness.TOOL_IMPORTS, "absent-engine", "json"
    )  # "installed": the block runs
    pytester.runpytest("-q", "page.md").assert_outcomes(passed=1)
    recorded = (pytester.path / "tests" / "doc_outputs.json").read_text()
    assert '"outcome": "passed"' in recorded and "seen" in recorded
    pytester.runpytest("-q", "page.md").assert_outcomes(passed=1)
    assert (
        pytester.path / "tests" / "doc_outputs.json"
    ).read_text() == recorded  # timestamp kept too
    monkeypatch.setitem(
        docs_harness.TOOL_IMPORTS, "absent-engine", "absent_engine"
    )  # now missing: skipped
    pytester.runpytest("-q", "page.md").assert_outcomes(skipped=1)
    assert (pytester.path / "tests" / "doc_outputs.json").read_text() == recorded


def test_every_block_of_the_site_runs_as_a_script():
    """A reader copies a block into a file: it must compile as a module (no top-level `await`, which the
    harness would run but `python script.py` rejects with a SyntaxError)."""
    bad = {}
    for path in _pages():
        text = path.read_text(encoding="utf-8-sig")
        for name, block in page_blocks(text, path):
            try:
                compile(block_body(block), f"{path.name}:{block.start_line}", "exec")
            except SyntaxError as error:
                bad[f"{path.relative_to(REPO).as_posix()}:{block.start_line}"] = error.msg
    assert not bad, bad


def test_the_cross_engine_checks_compare_with_compare_not_by_hand():
    """The cross-engine guide teaches `mi.compare`, which converts layouts and explains a mismatch; a block
    that compares tensors with a hand-written `allclose` teaches the check without either."""
    path = REPO / "docs" / "guides" / "cross-engine.md"
    by_hand = [
        block.start_line
        for _, block in page_blocks(path.read_text(encoding="utf-8"), path)
        if re.search(r"\ballclose\(|\bisclose\(", block_body(block))
    ]
    assert not by_hand, f"docs/guides/cross-engine.md: blocks at lines {by_hand} compare by hand"

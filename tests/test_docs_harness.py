"""Tests of the docs harness (tests/docs_harness.py), run on throwaway pages with pytester."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import sys
import textwrap

import docs_harness
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# Inner runs load only the plugins they need (plugin autoloading is off in the `docs` fixture),
# which keeps each run well under a second.
INI = """\
[pytest]
addopts = -p pytest_markdown_docs.plugin -p timeout -p docs_harness
    --markdown-docs --markdown-docs-syntax=superfences --strict-markers
testpaths = docs
filterwarnings = ignore::pytest.PytestAssertRewriteWarning
"""


def page(text: str) -> str:
    """Dedent a page and turn ''' into ``` so pages can be written inside this file."""
    return textwrap.dedent(text).lstrip("\n").replace("'''", "```")


@pytest.fixture
def docs(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    """Write pages into a fresh project; return a function that writes one page."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makefile(".ini", pytest=INI)
    (pytester.path / "docs").mkdir()

    def write(text: str, name: str = "page.md") -> pathlib.Path:
        path = pytester.path / "docs" / name
        path.write_text(page(text), encoding="utf-8")
        return path

    return write


def expect_lines(result: pytest.RunResult, patterns: list[str]) -> None:
    """Like ``fnmatch_lines``, but only ``*`` is special (pages are full of brackets)."""
    result.stdout.re_match_lines(
        ["^" + ".*".join(re.escape(part) for part in p.split("*")) + "$" for p in patterns]
    )


def line_of(path: pathlib.Path, needle: str) -> int:
    """The 1-based line of the first line of ``path`` that contains ``needle``."""
    return next(
        n for n, line in enumerate(path.read_text().splitlines(), start=1) if needle in line
    )


CHECKED = """
    # Page

    Some prose.

    '''python
    # migration-test: tool=torchlens expected=(2, 'ab')
    def build():
        return (1 + 1, "a" + "b")

    RESULT = build()
    '''
    """


def test_passing_block(docs, pytester):
    docs(CHECKED)
    pytester.runpytest().assert_outcomes(passed=1)


def test_changed_expected_fails_with_page_and_line_and_update_restores_it(docs, pytester):
    path = docs(CHECKED)
    original = path.read_text()
    path.write_text(original.replace("expected=(2, 'ab')", "expected=(3, 'ab')"))
    fence = line_of(path, "```python")
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    expect_lines(
        result,
        [
            f"docs/page.md:{fence}: RESULT != expected (tool=torchlens, header on line {fence + 1})",
            "  expected: (3, 'ab')",
            "  RESULT:   (2, 'ab')",
            "  if the change is intended: pytest docs/page.md --update-expected",
        ],
    )
    result = pytester.runpytest("--update-expected")
    result.assert_outcomes(passed=1)
    expect_lines(
        result,
        [
            "rewrote 1 expected= literal(s):",
            f"  docs/page.md:{fence + 1}: expected=(3, 'ab')  ->  expected=(2, 'ab')",
        ],
    )
    assert path.read_text() == original
    pytester.runpytest().assert_outcomes(passed=1)


def test_update_keeps_a_trailing_timeout_and_the_rest_of_the_page(docs, pytester):
    path = docs("""
        '''python
        # migration-test: tool=torchlens expected=[1, 2] timeout=50
        RESULT = [1, 2, 3]
        '''
        Text after.\r
        """)
    pytester.runpytest("--update-expected").assert_outcomes(passed=1)
    assert (
        path.read_bytes()
        == page("""
        '''python
        # migration-test: tool=torchlens expected=[1, 2, 3] timeout=50
        RESULT = [1, 2, 3]
        '''
        Text after.\r
        """).encode()
    )


def test_long_values_are_shown_as_a_diff(docs, pytester):
    expected = {f"site_{i}": i for i in range(12)}
    docs(f"""
        '''python
        # migration-test: tool=torchlens expected={expected!r}
        RESULT = {dict(expected, site_7=70)!r}
        '''
        """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    expect_lines(
        result, ["*diff (- expected, + RESULT):*", "*-*'site_7': 7,*", "*+*'site_7': 70,*"]
    )


def test_update_refuses_values_that_do_not_round_trip(docs, pytester):
    path = docs("""
        '''python
        # migration-test: tool=torchlens expected=[0, 1, 2]
        RESULT = range(3)
        '''

        '''python
        # migration-test: tool=torchlens expected=[0, 1, 2]
        class Odd:  # its repr reads back, as an int, which is not what RESULT is
            def __repr__(self):
                return "1"
        RESULT = Odd()
        '''
        """)
    before = path.read_text()
    result = pytester.runpytest("--update-expected")
    result.assert_outcomes(failed=2)
    assert result.stdout.str().count("not updated: repr(RESULT) does not read back") == 2
    expect_lines(result, ["no expected= literal needed rewriting"])
    assert path.read_text() == before


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (
            "# migration-test: tool=torchlens expected=len([1])",
            "expected= is not a Python literal*ast.Call*",
        ),
        (
            "# migration-test: tool=torchlens expected=(1,",
            "expected= is not a Python literal: '(1,' (SyntaxError*",
        ),
        ("# migration-test: tool=torchlens", "the header has no `expected=LITERAL`*"),
        ("# migration-test tool=torchlens expected=1", "write the header as*"),
        (
            "# migration-test: tool=torchlens colour=red expected=1",
            "the fields before expected= must be tool=NAME and timeout=SECONDS, each at most once, "
            "not `tool=torchlens colour=red`",
        ),
        (
            "# migration-test: tool=torchlens tool=nnsight expected=1",
            "*each at most once, not `tool=torchlens tool=nnsight`",
        ),
        ("# migration-test: expected=1", "the header has no `tool=NAME`"),
        (
            "# migration-test: tool=nnsigth expected=1",
            "unknown tool `nnsigth` (did you mean ['nnsight']?)*",
        ),
        (
            "# migration-test: tool=torchlens timeout=soon expected=1",
            "timeout=`soon` is not a positive number*",
        ),
        (
            "# migration-test: tool=torchlens timeout=0 expected=1",
            "timeout=`0` is not a positive number*",
        ),
    ],
)
def test_malformed_header_fails(docs, pytester, header, message):
    docs(f"""
        '''python
        {header}
        RESULT = 1
        '''
        """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    expect_lines(
        result, ["docs/page.md:1: malformed `# migration-test:` header (line 2): " + message]
    )


def test_a_malformed_header_is_a_migration_test_too(docs, pytester):
    docs("""
        '''python
        # migration-test: tool=torchlens expected=len([1])
        RESULT = 1
        '''

        '''python
        x = 1
        '''
        """)
    pytester.runpytest("-m", "migration_test").assert_outcomes(failed=1, deselected=1)


def test_expected_is_read_as_a_literal_never_run(docs, pytester):
    docs("""
        '''python
        # migration-test: tool=torchlens expected=open("ran", "w").close()
        RESULT = None
        '''
        """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    expect_lines(result, ["*expected= is not a Python literal*ast.Call*"])
    assert not (pytester.path / "ran").exists()


def test_block_that_never_binds_result_fails(docs, pytester):
    docs("""
        '''python
        # migration-test: tool=torchlens expected=1
        result = 1  # lower case: not RESULT
        '''
        """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    expect_lines(
        result,
        ["docs/page.md:1: the block has a `# migration-test:` header but never binds RESULT"],
    )


def test_result_whose_comparison_is_not_a_bool_fails_with_a_hint(docs, pytester):
    docs("""
        '''python
        # migration-test: tool=torchlens expected=1
        class Vector:
            def __eq__(self, other):
                raise ValueError("ambiguous")
        RESULT = Vector()
        '''
        """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    expect_lines(
        result,
        ["docs/page.md:1: RESULT is a Vector, whose `==` gives no True or False; bind RESULT*"],
    )


def test_syntax_error_names_page_and_line(docs, pytester):
    docs("""
        # Page

        '''python
        x = 1
        def broken(:
            pass
        '''
        """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    expect_lines(
        result,
        [
            "docs/page.md:3: SyntaxError: invalid syntax",
            "4   x = 1",
            "5   def broken(:",
            '*File "*docs/page.md", line 5*',
        ],
    )


def test_traceback_points_into_the_page(docs, pytester):
    docs("""
        # Page

        '''python
        def helper(mapping):
            return mapping["missing"]

        helper({})
        '''
        """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    expect_lines(
        result,
        [
            "docs/page.md:3: KeyError: 'missing' (raised at line 5)",
            '*5   *return mapping["missing"]',
            "Traceback (most recent call last):",
            '  File "*docs/page.md", line 7, in <module>',
            "    helper({})",
            '  File "*docs/page.md", line 5, in helper',
            '    return mapping["missing"]',
            "KeyError: 'missing'",
        ],
    )


def test_code_that_reads_its_own_source_sees_python(docs, pytester):
    """Tools such as nnsight parse their caller's source; the page's prose must not show."""
    docs("""
        # Page

        Prose that is not Python: don't parse me.

        !!! note

            '''python
            # migration-test: tool=torchlens expected=(True, 'def helper():')
            import ast
            import inspect

            def helper():
                return 1

            frame = inspect.currentframe()
            ast.parse("".join(inspect.getsourcelines(frame)[0]))
            RESULT = (frame.f_lineno > 5, inspect.getsource(helper).splitlines()[0])
            '''
        """)
    pytester.runpytest().assert_outcomes(passed=1)


def test_plain_blocks_run_too_and_top_level_await_works(docs, pytester):
    docs("""
        '''python
        assert 1 + 1 == 2
        '''

        '''py
        raise RuntimeError("plain blocks are executed")
        '''

        '''{.python notest}
        raise RuntimeError("notest blocks are not")
        '''

        '''bash
        exit 1
        '''

        '''python
        # migration-test: tool=torchlens expected=3
        import asyncio
        RESULT = await asyncio.sleep(0, result=3)
        '''
        """)
    result = pytester.runpytest()
    result.assert_outcomes(passed=2, failed=1)
    expect_lines(result, ["*RuntimeError: plain blocks are executed*"])


MISSING_TOOL = """
    '''python
    # migration-test: tool=absent-engine expected=1
    import absent_engine
    RESULT = 1
    '''

    '''python
    # migration-test: tool=torchlens expected=1
    RESULT = 1
    '''
    """


@pytest.fixture
def absent_tool(monkeypatch):
    """Register a tool whose module is certainly not installed (real engines may be)."""
    assert importlib.util.find_spec("absent_engine") is None
    monkeypatch.setitem(docs_harness.TOOL_IMPORTS, "absent-engine", "absent_engine")


def test_missing_tool_is_skipped_with_the_reason(docs, pytester, absent_tool):
    docs(MISSING_TOOL)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=1)
    expect_lines(
        result,
        [
            "SKIPPED [1] docs/page.md:1: tool=absent-engine needs `import absent_engine`, which is not installed"
        ],
    )


def test_missing_tool_fails_under_ci(docs, pytester, monkeypatch, absent_tool):
    docs(MISSING_TOOL)
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    expect_lines(
        result,
        ["docs/page.md:1: tool=absent-engine needs `import absent_engine`*(CI=true: every tool*"],
    )


def test_tool_markers_select_blocks(docs, pytester, absent_tool):
    docs(MISSING_TOOL)
    result = pytester.runpytest("-m", "tool_torchlens", "--collect-only", "-q")
    expect_lines(result, ["docs/page.md::top[2]", "*1/2 tests collected (1 deselected)*"])
    result = pytester.runpytest(
        "-m", "tool_absent_engine and migration_test", "--collect-only", "-q"
    )
    expect_lines(result, ["docs/page.md::top[1]", "*1/2 tests collected (1 deselected)*"])


def test_blocks_in_tabs_and_admonitions_are_collected(docs, pytester):
    docs("""
        # Engines

        === "TorchLens"

            '''python
            # migration-test: tool=torchlens expected=1
            RESULT = 1
            '''

        === "Other"

            ??? note "Collapsed"

                '''python
                # migration-test: tool=torchlens expected=2
                RESULT = 2
                '''

        !!! warning

            '''python
            # migration-test: tool=torchlens expected=3
            RESULT = 3
            '''

        ???+ tip

            '''markdown
            !!! note
                this is shown, not parsed
            '''
        """)
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=3)
    expect_lines(
        result,
        [
            "docs/page.md::engines[1] PASSED*",
            "docs/page.md::engines[2] PASSED*",
            "docs/page.md::engines[3] PASSED*",
        ],
    )


def test_tracebacks_in_containers_keep_page_lines(docs, pytester):
    path = docs("""
        !!! note

            '''python
            x = 1
            raise ValueError("inside an admonition")
            '''
        """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    expect_lines(
        result, [f'  File "*docs/page.md", line {line_of(path, "raise ValueError")}, in <module>']
    )


def test_uncollected_headers_fail(docs, pytester):
    docs("""
        '''python
        x = 1
        # migration-test: tool=torchlens expected=1
        RESULT = 1
        '''

        '''{.python notest}
        # migration-test: tool=torchlens expected=1
        RESULT = 1
        '''

        '''markdown
        # migration-test: tool=torchlens expected=1
        '''
        """)
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=2)
    expect_lines(
        result,
        [
            "docs/page.md:3: a `# migration-test:` header was not collected: it must open a Python block*",
            "docs/page.md:8: a `# migration-test:` header was not collected*",
        ],
    )


def test_time_limit_names_the_page_line_it_was_running(docs, pytester):
    docs("""
        # Page

        '''python
        # migration-test: tool=torchlens expected=1 timeout=0.3
        while True:
            pass
        '''

        '''python
        import time
        time.sleep(2)
        '''
        """)
    pytester.makefile(".ini", pytest=INI + "doc_example_timeout = 0.5\n")
    result = pytester.runpytest()
    result.assert_outcomes(failed=2)
    expect_lines(
        result,
        [
            "docs/page.md:3: Failed: Timeout (>0.3s) from pytest-timeout. (raised at line 5)",
            "docs/page.md:9: Failed: Timeout (>0.5s) from pytest-timeout. (raised at line 11)",
        ],
    )


def test_output_is_pytests_capture(docs, pytester):
    docs("""
        '''python
        print("noise from a passing block")
        '''

        '''python
        import sys
        print("said before failing")
        print("to stderr", file=sys.stderr)
        raise RuntimeError("after output")
        '''
        """)
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    expect_lines(
        result,
        ["*Captured stdout call*", "said before failing", "*Captured stderr call*", "to stderr"],
    )
    assert "noise from a passing block" not in result.stdout.str()


def test_ids_are_stable_when_other_sections_change(docs, pytester):
    body = """
        # Page

        ## First

        '''python
        a = 1
        '''

        ## Second

        '''python
        b = 2
        '''

        ## First
        '''python
        c = 3
        '''
        """
    docs(body)
    before = pytester.runpytest("--collect-only", "-q").stdout.lines
    edited = body.replace(
        "a = 1", "a = 1\n        '''\n\n        More text.\n\n        '''python\n        c = 3"
    )
    docs(edited.replace("## Second", "Intro paragraph.\n\n        ## Second"))
    after = pytester.runpytest("--collect-only", "-q").stdout.lines
    assert {"docs/page.md::first[1]", "docs/page.md::second[1]", "docs/page.md::first_1[1]"} <= set(
        before
    )
    assert {"docs/page.md::first[2]", "docs/page.md::second[1]", "docs/page.md::first_1[1]"} <= set(
        after
    )


def test_section_ids_are_those_of_mkdocs_toc(docs, pytester):
    docs("""
        # Capture a forward `pass`!

        '''python
        x = 1
        '''
        """)
    expect_lines(
        pytester.runpytest("--collect-only", "-q"), ["docs/page.md::capture-a-forward-pass[1]"]
    )


def test_pages_are_parsed_by_the_parser_pytest_markdown_docs_hook_gives(docs, pytester):
    docs(CHECKED)
    pytester.makeconftest("""
        import pytest
        from markdown_it import MarkdownIt

        @pytest.hookimpl(tryfirst=True)
        def pytest_markdown_docs_markdown_it():
            return MarkdownIt("commonmark").disable("fence")  # a parser that sees no fenced code
        """)
    result = pytester.runpytest("--collect-only", "-q")
    expect_lines(result, ["docs/page.md::uncollected-header[line-6]", "1 test collected*"])


def test_python_docstrings_are_not_run_as_markdown(docs, pytester):
    docs(CHECKED)
    pytester.makepyfile(
        tools='''
        def helper():
            """Docs.

            ```python
            raise RuntimeError("pytest-markdown-docs would run this")
            ```
            """
        '''
    )
    pytester.runpytest("tools.py", "docs").assert_outcomes(passed=1)


def test_every_header_in_the_real_docs_is_collected(pytester):
    """Every `# migration-test:` line that a plain scan finds in a page of this repository's docs/
    must be a collected test (a page in a folder pytest skips, such as docs/build/, would not be)."""
    expected: dict[str, int] = {}
    for path in sorted((REPO / "docs").rglob("*.md")):
        if headers := docs_harness.scan_python_headers(path.read_text(encoding="utf-8-sig")):
            expected[path.relative_to(REPO).as_posix()] = len(headers)
    result = pytester.runpytest_inprocess(
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "migration_test",
        "--rootdir",
        str(REPO),
        "-c",
        str(REPO / "pyproject.toml"),
        str(REPO / "docs"),
    )
    collected: dict[str, int] = {}
    for line in result.stdout.lines:
        if "::" in line and line.startswith("docs/"):
            collected[line.split("::")[0]] = collected.get(line.split("::")[0], 0) + 1
    assert "docs/getting-started.md" in expected
    assert not [line for line in result.stdout.lines if "uncollected-header" in line]
    assert collected == expected


def test_flattening_keeps_line_count():
    text = page("""
        === "A"

            !!! note

                '''python
                x = 1
                '''
        text
        """)
    flat = docs_harness.flatten_containers(text)
    assert flat.count("\n") == text.count("\n")
    assert flat.splitlines()[4:7] == ["```python", "x = 1", "```"]


# -- blocks that run in an engine environment --------------------------------------------------


@pytest.fixture
def fake_env(tmp_path, monkeypatch):
    """An engine environment `fake` for tool=fake-engine: its `bin/python` is this machine's base
    interpreter (the block runner needs only the standard library). Returns its path."""
    python = tmp_path / "engines" / "fake" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.symlink_to(pathlib.Path(sys.base_prefix) / "bin" / pathlib.Path(sys.executable).name)
    monkeypatch.setenv("TORCHLENS_ENGINE_ENVS", str(tmp_path / "engines"))
    monkeypatch.setitem(docs_harness.TOOL_IMPORTS, "fake-engine", "fake_engine")
    monkeypatch.setitem(docs_harness.ENGINE_ENVIRONMENTS, "fake-engine", "fake")
    return python


def test_engine_block_runs_in_its_environment_and_its_output_is_captured(docs, pytester, fake_env):
    docs(f"""
        # Page

        '''python
        # migration-test: tool=fake-engine expected=({str(fake_env)!r}, True)
        import os, sys
        print("printed in the engine")
        os.write(2, b"written by the engine to fd 2\\n")
        RESULT = (sys.executable, os.getpid() != {os.getpid()})
        '''

        '''python
        # migration-test: tool=fake-engine expected=1
        print("a failing engine block printed this")
        RESULT = 2
        '''
        """)
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    expect_lines(result, ["*Captured stdout call*", "a failing engine block printed this"])
    pytester.runpytest("-rP").stdout.fnmatch_lines(
        ["printed in the engine", "written by the engine to fd 2"]
    )


ENGINE_PAGE = """
    # Page

    '''python
    # migration-test: tool=fake-engine expected=(3, 'ab')
    import os
    first_pid = os.getpid()
    with open("block-1-runs", "a") as runs:  # one character per run of this block
        runs.write("x")
    RESULT = (1 + 2, "a" + "b")
    '''

    '''{.python continuation}
    # migration-test: tool=fake-engine expected=(4, True)
    RESULT = (3 + 1, os.getpid() == first_pid)
    '''
    """


def test_engine_block_mismatch_names_page_line_and_update_expected_rewrites_it(
    docs, pytester, fake_env
):
    path = docs(ENGINE_PAGE.replace("expected=(3, 'ab')", "expected=(5, 'ab')"))
    fence = line_of(path, "```python")
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    expect_lines(
        result,
        [
            f"docs/page.md:{fence}: RESULT != expected (tool=fake-engine, header on line {fence + 1})",
            "  expected: (5, 'ab')",
            "  RESULT:   (3, 'ab')",
        ],
    )
    pytester.runpytest("--update-expected").assert_outcomes(passed=2)
    assert path.read_text() == page(ENGINE_PAGE)
    pytester.runpytest().assert_outcomes(passed=2)


def test_continuation_runs_in_the_same_process_or_reruns_what_it_continues(
    docs, pytester, fake_env
):
    docs(ENGINE_PAGE)
    runs = pytester.path / "block-1-runs"
    pytester.runpytest().assert_outcomes(passed=2)
    assert (
        runs.read_text() == "x"
    )  # the continuation went on in block 1's process, not re-running it
    pytester.runpytest("docs/page.md::page[2]").assert_outcomes(
        passed=1
    )  # alone: block 1's code runs first
    assert runs.read_text() == "xx"


def test_engine_block_error_points_into_the_page(docs, pytester, fake_env):
    path = docs("""
        # Page

        '''python
        # migration-test: tool=fake-engine expected=1
        def broken():
            raise ValueError("boom in the engine env")

        broken()
        '''
        """)
    fence = line_of(path, "```python")
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    expect_lines(
        result,
        [
            f"docs/page.md:{fence}: ValueError: boom in the engine env (raised at line {fence + 3})",
            "Traceback (most recent call last):",
            f'  File "*docs/page.md", line {fence + 5}, in <module>',
            f'  File "*docs/page.md", line {fence + 3}, in broken',
        ],
    )


def test_engine_block_result_must_be_a_literal(docs, pytester, fake_env):
    docs("""
        '''python
        # migration-test: tool=fake-engine expected=1
        RESULT = object()
        '''

        '''python
        # migration-test: tool=fake-engine expected=1
        class Odd:  # its repr reads back, as an int, which is not what RESULT is
            def __repr__(self):
                return "1"
        RESULT = Odd()
        '''
        """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=2)
    expect_lines(
        result,
        [
            "docs/page.md:1: RESULT is a object whose repr does not read back through ast.literal_eval*",
            "docs/page.md:6: RESULT is a Odd whose repr does not read back through ast.literal_eval*",
        ],
    )


def test_engine_block_time_limit_shows_where_it_was(docs, pytester, fake_env):
    path = docs("""
        '''python
        # migration-test: tool=fake-engine expected=1 timeout=0.5
        import time
        time.sleep(60)
        '''

        '''python
        # migration-test: tool=fake-engine expected=1
        RESULT = 1
        '''
        """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1, passed=1)  # the next block gets a fresh interpreter
    expect_lines(
        result,
        [
            "docs/page.md:1: the example did not finish within 0.5 s in fake; its stack dump*",
            f'*File "*docs/page.md", line {line_of(path, "time.sleep")} in <module>*',
        ],
    )


def test_engine_that_dies_is_reported(docs, pytester, fake_env):
    docs("""
        '''python
        # migration-test: tool=fake-engine expected=1
        import os
        os._exit(3)
        '''
        """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    expect_lines(
        result, ["docs/page.md:1: the fake interpreter ended (exit status 3) without an answer*"]
    )


def test_missing_engine_environment_skips_or_fails_under_ci(docs, pytester, fake_env, monkeypatch):
    fake_env.unlink()
    docs(ENGINE_PAGE)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=2)
    expect_lines(
        result,
        [
            "SKIPPED [1] docs/page.md:3: tool=fake-engine runs in the engine environment *fake, which is "
            "not built (`make engines` builds it from envs/fake.txt)"
        ],
    )
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest()
    result.assert_outcomes(failed=2)
    expect_lines(result, ["*(CI=true: every tool and engine environment must be there)"])


def test_every_engine_environment_has_a_pinned_file():
    for tool, environment in docs_harness.ENGINE_ENVIRONMENTS.items():
        pins = (REPO / "envs" / f"{environment}.txt").read_text()
        assert tool in docs_harness.TOOL_IMPORTS
        assert re.search(r"^torch==\S+$", pins, re.M), f"envs/{environment}.txt pins no torch"
        requirements = [
            line for line in pins.splitlines() if line.strip() and not line.startswith("#")
        ]
        assert all(re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==\S+", line) for line in requirements), (
            environment
        )


def test_engine_interpreters_end_after_the_last_block_of_their_page(docs, pytester, fake_env):
    docs("""
        '''python
        # migration-test: tool=fake-engine expected=True
        import os
        with open("engine-pid", "w") as f:
            f.write(str(os.getpid()))
        RESULT = True
        '''
        """)
    docs(
        """
        '''python
        # migration-test: tool=torchlens expected=True
        import os, pathlib, time
        pid = int(pathlib.Path("engine-pid").read_text())
        for _ in range(100):  # the interpreter of page.md's block has ended before this page runs
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the engine interpreter is still running")
        RESULT = True
        '''
        """,
        name="rest.md",
    )
    pytester.runpytest("docs/page.md", "docs/rest.md").assert_outcomes(passed=2)


def test_a_block_that_makes_transformers_warn_about_its_config_fails(docs, pytester):
    """GPT-2's default bos/eos ids (50256) lie outside a 64-token vocabulary: transformers warns, and the block,
    which would teach that config, fails with the warning. The same model with ids inside the vocabulary passes."""
    path = docs("""
        # Page

        '''python
        import transformers

        transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=64)
        '''

        '''python
        import transformers

        transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
        '''

        '''python
        import transformers

        transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=64)  # warned once already: again
        '''
        """)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2)
    expect_lines(
        result,
        [
            f"docs/page.md:{line_of(path, 'python')}: transformers warned about the example's model "
            "config*",
            "  [transformers] Model config: bos_token_id must be*",
        ],
    )

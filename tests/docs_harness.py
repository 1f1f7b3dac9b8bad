"""Run every Python block of the documentation as a pytest test (``-p docs_harness``).

On pytest-markdown-docs (``--markdown-docs``; its fence extraction, which joins a ``{.python
continuation}`` block to the ones before it; its item, runner and failure listing), pytest-timeout
(ini ``doc_example_timeout``, or a header's ``timeout=``) and pytest's capture, this adds: blocks in
Material tabs and admonitions; ``# migration-test: tool=NAME expected=LITERAL`` first lines, whose
block must bind ``RESULT`` equal to the literal (read by :func:`ast.literal_eval`), rewritten by
``--update-expected``; ``docs/page.md:LINE`` failures; ``tool_*`` markers, a missing tool skipped (failed
under ``CI``); blocks of :data:`ENGINE_ENVIRONMENTS` run in ``.venv-engines/NAME/bin/python`` by
``tests/engine_block_runner.py``; a failure for a header not collected; ids ``docs/page.md::SECTION[N]``.
"""

from __future__ import annotations

import ast
import asyncio
import collections
import difflib
import functools
import importlib.util
import json
import linecache
import logging
import os
import pathlib
import pprint
import re
import subprocess
import sys
import traceback
import types

import pytest
from fixtures.engines import ENGINES
from fixtures.engines import python as _engine_env_python
from markdown.extensions.toc import slugify
from markdown_it import MarkdownIt
from pytest_markdown_docs.definitions import FenceTestDefinition
from pytest_markdown_docs.plugin import (
    FenceSyntax,
    MarkdownDocstringCodeModule,
    MarkdownInlinePythonItem,
    MarkdownTextFile,
    extract_fence_tests,
    parse_superfences_block_info,
)

#: ``tool=`` name -> the module that must be importable (marker ``tool_<module>``): TorchLens and
#: every engine row of ``tests/fixtures/engines.py`` (with its other spellings).
TOOL_IMPORTS = {
    "torchlens": "torchlens",
    **{tool: e.module for e in ENGINES.values() for tool in (e.name, *e.aliases)},
}
#: Tools whose pins conflict with the main environment's, by engine environment: the engine rows
#: with an ``environment`` (one per ``envs/NAME.txt``), each tool named as its environment.
ENGINE_ENVIRONMENTS = {name: name for name, e in ENGINES.items() if e.environment}
ENGINE_BLOCK_RUNNER = pathlib.Path(__file__).with_name("engine_block_runner.py")
ALWAYS_PRESENT_TOOLS = frozenset({"torchlens"})  #: never skipped: missing, the block fails


def ci_is_on() -> bool:
    """Return True when the environment variable ``CI`` says this is a CI run."""
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


def engine_python(root: pathlib.Path, environment: str) -> pathlib.Path:
    """The interpreter of engine environment ``environment`` (it may not exist yet)."""
    return _engine_env_python(environment, root)


#: Anything that looks like a header, so that a typo is reported instead of making a plain block.
_HEADER = re.compile(r"^\s*#\s*migration[-_ ]?test\b(?P<colon>\s*:)?(?P<body>.*)$", re.I)
_EXPECTED = re.compile(r"(?:^|\s)expected=")
_TRAILING_TIMEOUT = re.compile(r"\s(timeout=[0-9.]+)\s*$")
Header = collections.namedtuple(
    "Header", "line tool expected_source expected timeout"
)  # line: 1-based, in the page


def parse_header(text: str, line: int) -> Header:
    """Parse ``# migration-test: tool=NAME [timeout=SECONDS] expected=LITERAL``; ValueError says what is wrong.

    >>> parse_header("# migration-test: tool=nnsight expected=(1, 'a') timeout=9", 7)
    Header(line=7, tool='nnsight', expected_source="(1, 'a')", expected=(1, 'a'), timeout=9.0)
    """
    match = _HEADER.match(text)
    if match is None or not match["colon"]:
        raise ValueError("write the header as `# migration-test: tool=NAME expected=LITERAL`")
    if (found := _EXPECTED.search(match["body"])) is None:
        raise ValueError("the header has no `expected=LITERAL` (it must come last)")
    fields, source = match["body"][: found.start()], match["body"][found.end() :].strip()
    if trailing := _TRAILING_TIMEOUT.search(source):  # `expected=LITERAL timeout=N` is accepted too
        fields, source = fields + " " + trailing[1], source[: trailing.start()].strip()
    options = dict(word.partition("=")[::2] for word in fields.split())
    if (
        len(options) < len(fields.split())
        or set(options) - {"tool", "timeout"}
        or not all(options.values())
    ):
        raise ValueError(
            f"the fields before expected= must be tool=NAME and timeout=SECONDS, each at most once, "
            f"not `{fields.strip()}`"
        )
    if (tool := options.get("tool")) not in TOOL_IMPORTS:
        close = difflib.get_close_matches(tool or "", TOOL_IMPORTS, n=2)
        raise ValueError(
            "the header has no `tool=NAME`"
            if tool is None
            else f"unknown tool `{tool}`"
            f"{f' (did you mean {close}?)' if close else ''}; known: {', '.join(sorted(TOOL_IMPORTS))}; "
            "a new one is a row of tests/fixtures/engines.py"
        )
    timeout = options.get("timeout")
    if timeout is not None and (not re.fullmatch(r"\d*\.?\d+", timeout) or float(timeout) <= 0):
        raise ValueError(f"timeout=`{timeout}` is not a positive number of seconds")
    try:
        return Header(line, tool, source, ast.literal_eval(source), timeout and float(timeout))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as error:
        node = re.search(r"<ast\.(\w+) object", str(error))
        raise ValueError(
            f"expected= is not a Python literal: {source!r} ("
            f"{f'it contains an ast.{node[1]}' if node else f'{type(error).__name__}: {error}'}); use "
            "numbers, strings, bytes, True/False/None, tuples, lists, dicts or sets"
        ) from None


def literal_repr(value: object) -> str | None:
    """``repr(value)`` if it reads back through :func:`ast.literal_eval` as an equal value of the same type."""
    try:
        again, source = ast.literal_eval(repr(value)), repr(value)
        return (
            source
            if "\n" not in source and type(again) is type(value) and bool(again == value)
            else None
        )
    except Exception:
        return None


def rewrite_expected(path: pathlib.Path, header: Header, new: str) -> bool:
    """Put ``new`` in place of the header's ``expected=`` literal in the page; False if that line changed."""
    lines = path.read_bytes().decode("utf-8").splitlines(keepends=True)
    old = (
        lines[header.line - 1]
        if header.line <= len(lines) and _HEADER.match(lines[header.line - 1])
        else ""
    )
    line = re.sub(
        r"(?:^|\s)expected=\s*" + re.escape(header.expected_source),
        lambda m: m[0][: -len(header.expected_source)].rstrip() + new,
        old,
        count=1,
    )
    if line != old:
        path.write_bytes(
            "".join(lines[: header.line - 1] + [line] + lines[header.line :]).encode("utf-8")
        )
    return line != old


_CONTAINER = re.compile(r"^(?P<indent> *)(?:!!!\+?|\?\?\?\+?|===[!+]*)(?:\s|$)")
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def _fence_opens(line: str) -> re.Match | None:
    match = _FENCE.match(line)
    return None if match is None or (match["fence"][0] == "`" and "`" in match["info"]) else match


def _fence_closes(line: str, fence: str) -> bool:
    return len(line.strip()) >= len(fence) and set(line.strip()) == {fence[0]}


def flatten_containers(text: str) -> str:
    """Turn Material tabs (``=== "Tab"``) and admonitions (``!!!``, ``???``, ``???+``) into plain Markdown
    with every line where it was: a container line becomes blank, its body moves 4 spaces left per open
    container. Lines inside fenced code are never read as containers.

    >>> flatten_containers('=== "A"\\n\\n    ```python\\n    x = 1\\n    ```').split("\\n")
    ['', '', '```python', 'x = 1', '```']
    """
    out, stack, fence = [], [], None  # stack: indent of each open container; fence: (marker, depth)
    for line in text.split("\n"):
        indent = len(line) - len(line.lstrip(" "))
        while line.strip() and stack and indent < stack[-1] + 4:
            stack.pop()
        if fence and len(stack) < fence[1]:
            fence = None  # the container ended, and with it its unclosed fence
        flat = line[min(indent, 4 * len(stack)) :] if line.strip() else ""
        if fence:
            fence = None if _fence_closes(flat, fence[0]) else fence
        elif opener := _CONTAINER.match(line):
            stack.append(len(opener["indent"]))
            flat = ""
        elif (match := _fence_opens(flat)) and len(match["indent"]) < 4:
            fence = (match["fence"], len(stack))
        out.append(flat)
    return "\n".join(out)


def scan_python_headers(text: str) -> list[int]:
    """The lines of headers in Python fences, found by a line scan (not the parser, which may miss a fence)."""
    found, fence, language = [], None, ""
    for number, line in enumerate(text.split("\n"), start=1):
        if fence is None and (match := _fence_opens(line)):
            fence, language = (
                match["fence"],
                (parse_superfences_block_info(match["info"]) or [""])[0].lower(),
            )
        elif fence is not None and _fence_closes(line, fence):
            fence = None
        elif fence is not None and language in ("py", "python", "python3") and _HEADER.match(line):
            found.append(number)
    return found


def block_body(definition: FenceTestDefinition) -> str:
    """A block's own code: pytest-markdown-docs pads it to its page lines, after the blocks it continues."""
    return "\n".join(definition.source.split("\n")[definition.start_line :])


def page_blocks(
    text: str, path: pathlib.Path, syntax=FenceSyntax.superfences, parser: MarkdownIt | None = None
):
    """``(SECTION[N], block)`` per block: SECTION is MkDocs' toc id of the heading above, N the block's number there."""
    text, parser = (
        flatten_containers(text),
        parser or MarkdownIt("commonmark"),
    )  # same lines, containers gone
    headings, slugs, tokens = [], collections.Counter(), parser.parse(text)
    for token, inline in zip(tokens, tokens[1:]):
        if token.type == "heading_open" and token.map:
            slug = slugify(inline.content, "-") or "section"
            headings.append((token.map[0] + 1, f"{slug}_{slugs[slug]}" if slugs[slug] else slug))
            slugs[slug] += 1
    blocks, counts = [], collections.Counter()
    for definition in extract_fence_tests(parser, text, 0, path, fence_syntax=syntax):
        section = next(
            (slug for line, slug in reversed(headings) if line < definition.start_line), "top"
        )
        counts[section] += 1
        blocks.append((f"{section}[{counts[section]}]", definition))
    return blocks


fail = functools.partial(
    pytest.fail, pytrace=False
)  # the test fails with the message alone, no traceback


class DocPage(MarkdownTextFile):
    """A Markdown page whose Python blocks are tests."""

    def collect(self):
        self.display = pathlib.Path(
            os.path.relpath(self.path, self.config.rootpath)
        ).as_posix()  # docs/page.md
        text = self.path.read_text(encoding="utf-8-sig")
        blocks = page_blocks(
            text,
            self.path,
            FenceSyntax(self.config.option.markdowndocs_syntax),
            self.config.hook.pytest_markdown_docs_markdown_it(),
        )  # its parser (CommonMark)
        items = [
            DocItem.from_parent(
                self, name=name, test_definition=block, previous=blocks[i - 1][1] if i else None
            )
            for i, (name, block) in enumerate(blocks)
        ]
        yield from items
        for line in sorted(set(scan_python_headers(text)) - {item.header_line for item in items}):
            problem = PageProblem.from_parent(self, name=f"uncollected-header[line-{line}]")
            problem.line, problem.message = (
                line,
                (
                    f"{self.display}:{line}: a `# migration-test:` header was not "
                    "collected: it must open a Python block (not follow code, not in a `notest` fence or unknown container)"
                ),
            )
            problem.add_marker("migration_test")
            yield problem


class PageProblem(pytest.Item):
    """Fails with ``message``: a problem of the page itself."""

    def runtest(self) -> None:
        fail(self.message)


class DocItem(MarkdownInlinePythonItem):
    """One Python block of a page; ``previous`` is the block before it on the page."""

    def __init__(
        self, name: str, parent: DocPage, test_definition: FenceTestDefinition, previous=None
    ):
        super().__init__(name, parent, test_definition)
        self.user_properties.clear()  # pytest-markdown-docs puts the whole padded source here
        self.previous, self.line, self.body = (
            previous,
            test_definition.start_line,
            block_body(test_definition),
        )
        self.continues = (
            test_definition.source[: self.line] != "\n" * self.line
        )  # a `continuation` block
        self.where, self.header, self.header_error, self.header_line = (
            f"{parent.display}:{self.line}",
            None,
            None,
            None,
        )
        first = next(
            ((i, line) for i, line in enumerate(self.body.split("\n")) if line.strip()), None
        )
        if first and _HEADER.match(first[1]):
            self.header_line = self.line + 1 + first[0]
            try:
                self.header = parse_header(first[1], self.header_line)
            except ValueError as error:
                self.header_error = (
                    f"{self.where}: malformed `# migration-test:` header (line {self.header_line}): "
                    f"{error}\n    {first[1].strip()}"
                )
        self.engine = ENGINE_ENVIRONMENTS.get(self.header.tool) if self.header else None
        self.timeout = (self.header and self.header.timeout) or float(
            self.config.getini("doc_example_timeout")
        )
        # An engine's interpreter dumps its stacks at the limit, a little before this process stops waiting.
        self.add_marker(
            pytest.mark.timeout(
                self.timeout + min(30, max(1, self.timeout / 10)) * bool(self.engine)
            )
        )
        if self.header_line:  # a malformed header too: `-m migration_test` shows it failing
            self.add_marker("migration_test")
        if self.header:
            self.add_marker("tool_" + TOOL_IMPORTS[self.header.tool])

    def reportinfo(self):
        return self.path, self.line - 1, f"{self.where} {self.name}"

    def _missing(self) -> str | None:
        """Why the block's tool or engine environment is not there, or None."""
        tool, python = self.header.tool, engine_python(self.config.rootpath, self.engine or "")
        if self.engine and not python.exists():
            return (
                f"tool={tool} runs in the engine environment {python.parents[1]}, which is not built "
                f"(`make engines` builds it from envs/{self.engine}.txt)"
            )
        if (
            not self.engine
            and tool not in ALWAYS_PRESENT_TOOLS
            and importlib.util.find_spec(TOOL_IMPORTS[tool]) is None
        ):
            return f"tool={tool} needs `import {TOOL_IMPORTS[tool]}`, which is not installed"
        return None

    def runtest(self) -> None:
        if self.header_error:
            fail(self.header_error)
        if self.header and (missing := self._missing()):
            if ci_is_on():
                fail(
                    f"{self.where}: {missing} (CI=true: every tool and engine environment must be there)"
                )
            raise pytest.skip.Exception(
                missing, _use_item_location=True
            )  # reported at the page line
        if self.engine:
            return self._check(self._run_in_engine())
        _forget_warnings_given_once()
        namespace = types.ModuleType("docs_example").__dict__
        for extra in self.config.hook.pytest_markdown_docs_globals():
            namespace.update(extra)
        namespace.update(
            self.funcargs
        )  # `fixture:NAME` fence options, filled by pytest-markdown-docs' setup
        # Tracebacks, inspect.getsource and tools that read their caller's source (nnsight) get the
        # block's code at its page lines, not the page's Markdown.
        source, filename = self.test_definition.source, str(self.path)
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        _forget_nnsight_source(filename)
        with _ConfigWarnings() as warned:
            self.runner.runtest(
                self.test_definition, namespace, asyncio_runner=asyncio
            )  # asyncio.run: top-level await
        self.config_warnings = warned.messages
        if self.header:
            self._check(namespace)

    def _check(self, namespace: dict) -> None:
        if "RESULT" not in namespace:
            fail(f"{self.where}: the block has a `# migration-test:` header but never binds RESULT")
        header, actual = self.header, namespace["RESULT"]
        try:
            if bool(actual == header.expected):
                return
        except Exception:
            fail(
                f"{self.where}: RESULT is a {type(actual).__name__}, whose `==` gives no True or False; "
                "bind RESULT to plain values (tuples, lists, dicts, numbers, strings)"
            )
        want, got = (
            pprint.pformat(value, width=88).splitlines() for value in (header.expected, actual)
        )
        short = len(want) == len(got) == 1 and len(want[0] + got[0]) <= 140
        text = (
            f"{self.where}: RESULT != expected (tool={header.tool}, header on line {header.line})\n"
            + (
                f"  expected: {want[0]}\n  RESULT:   {got[0]}"
                if short
                else "\n".join(
                    [
                        "  diff (- expected, + RESULT):",
                        *(
                            "    " + line
                            for line in difflib.unified_diff(
                                want, got, "expected", "RESULT", lineterm="", n=2
                            )
                        ),
                    ]
                )
            )
        )
        if not self.config.getoption("update_expected"):
            fail(
                f"{text}\n  if the change is intended: pytest {self.parent.display} --update-expected"
            )
        if (new := literal_repr(actual)) is None:
            fail(
                f"{text}\n  not updated: repr(RESULT) does not read back through ast.literal_eval as an equal value"
            )
        done = rewrite_expected(self.path, header, new)
        self.config.stash[_EDITS].append(
            (
                done,
                f"{self.parent.display}:{header.line}: "
                + (
                    f"expected={header.expected_source}  ->  expected={new}"
                    if done
                    else "skipped, the line changed"
                ),
            )
        )

    def _run_in_engine(self) -> dict:
        """Run the block in its engine's interpreter (its stderr is ours, so in pytest's capture); return its RESULT."""
        filename, engine = str(self.path), self.config.stash.get(_ENGINE, None)
        if self.continues and engine and engine.last_passed is self.previous:
            source = "\n" * self.line + self.body  # the blocks it continues ran there
        else:  # run afresh, a continuation block brings the blocks it continues
            close_engine(self.config)
            engine = self.config.stash[_ENGINE] = (
                subprocess.Popen(  # the runner imports src/ first, from cwd
                    [engine_python(self.config.rootpath, self.engine), ENGINE_BLOCK_RUNNER],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    cwd=self.config.rootpath,
                    env=dict(os.environ, PYTHONUNBUFFERED="1"),
                    text=True,
                    encoding="utf-8",
                )
            )
            engine.last_passed, source = None, self.test_definition.source
        try:
            engine.stdin.write(
                json.dumps({"source": source, "filename": filename, "timeout": self.timeout}) + "\n"
            )
            engine.stdin.flush()
            reply, timed_out = json.loads(engine.stdout.readline() or "null"), False
        except (
            OSError,
            pytest.fail.Exception,
        ) as error:  # it ended, or pytest-timeout's alarm (after its stack dump)
            reply, timed_out = None, isinstance(error, pytest.fail.Exception)
        if reply is None:
            close_engine(self.config)
            fail(
                f"{self.where}: "
                + (
                    f"the example did not finish within {self.timeout:g} s in {self.engine}"
                    if timed_out
                    else f"the {self.engine} interpreter ended (exit status "
                    f"{engine.returncode}) without an answer"
                )
                + "; its stack dump and output are "
                "under 'Captured stderr call'"
            )
        sys.stdout.write(reply["stdout"])  # into pytest's capture, as for other blocks
        sys.stderr.write(reply["stderr"])
        if not reply["ok"]:  # the interpreter's report, with page lines
            fail(f"{self.where}: {reply['summary']}")
        engine.last_passed = self.test_definition
        return {"RESULT": ast.literal_eval(reply["result"])} if reply["has_result"] else {}

    def repr_failure(self, excinfo, style=None) -> str:
        """``docs/page.md:LINE: Error (raised at line N)``, then pytest-markdown-docs' listing and traceback."""
        if isinstance(excinfo.value, pytest.fail.Exception) and not excinfo.value.pytrace:
            return str(excinfo.value)
        lines = [
            frame.lineno
            for frame in traceback.extract_tb(excinfo.tb)
            if frame.filename == str(self.path)
        ]
        headline = traceback.format_exception_only(excinfo.type, excinfo.value)[-1].strip()
        return (
            f"{self.where}: {headline}{f' (raised at line {lines[-1]})' if lines else ''}\n"
            + super().repr_failure(excinfo, style)
        )


_ENGINE = pytest.StashKey[
    subprocess.Popen
]()  # at most one runs: a vLLM engine holds memory for its cache
_EDITS = pytest.StashKey[list]()


def close_engine(config: pytest.Config) -> None:
    """End the running engine interpreter, if any."""
    if (engine := config.stash.get(_ENGINE, None)) is not None:
        del config.stash[_ENGINE]
        engine.kill()
        engine.communicate()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-expected",
        action="store_true",
        help="rewrite stale `expected=` literals of `# migration-test:` docs blocks in place",
    )
    parser.addini(
        "doc_example_timeout", "seconds one docs block may run (default 300)", default="300"
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "migration_test: a docs block with a `# migration-test:` header"
    )
    for module in sorted(set(TOOL_IMPORTS.values())):
        config.addinivalue_line(
            "markers", f"tool_{module}: docs blocks whose tool= needs `import {module}`"
        )
    config.stash[_EDITS] = []
    config.add_cleanup(lambda: close_engine(config))


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path: pathlib.Path, parent: pytest.Collector):
    """Collect ``.md`` pages as :class:`DocPage`, instead of pytest-markdown-docs' own collectors."""
    collected = yield
    kept = [
        node
        for node in collected
        if not isinstance(node, (MarkdownDocstringCodeModule, MarkdownTextFile))
    ]
    if parent.config.option.markdowndocs and file_path.suffix == ".md":
        kept.append(DocPage.from_parent(parent, path=file_path))
    return kept


def _forget_nnsight_source(filename: str) -> None:
    """Drop what nnsight remembers of `filename`'s source. nnsight reads a file once per process
    and caches the `with` blocks it parsed at each line (also a line where it found none); every
    block of a page shares the page's file name but has its own source, so a page with several
    blocks run in one process would have nnsight read another block's lines."""
    globals_ = sys.modules.get("nnsight.tracing.globals")
    if globals_ is None:
        return
    getattr(globals_, "SOURCES", {}).pop(filename, None)
    blocks = getattr(globals_, "BLOCKS", {})
    for key in [k for k in blocks if k and k[0] == filename]:
        del blocks[key]


def _forget_warnings_given_once() -> None:
    """Let transformers give its once-per-process warnings again: each block runs as a script of its own."""

    forget = getattr(getattr(logging.Logger, "warning_once", None), "cache_clear", None)
    if forget is not None and "transformers" in sys.modules:
        forget()


#: What transformers logs when a config it validates holds a value the model cannot use (a token id
#: outside the vocabulary): an example that triggers it teaches a broken config, so its block fails.
CONFIG_WARNING = re.compile(r"^\[transformers\] Model config: .*$", re.M)


class _ConfigWarnings(logging.Handler):
    """The `CONFIG_WARNING` messages transformers logs while a block runs, read from its logger.

    transformers' own handler writes to the `sys.stderr` of the moment transformers was imported,
    which is not the stream pytest captures for a later block (in a nested pytest run, say), so
    the block's captured stderr is not enough to see them.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = f"[transformers] {record.getMessage()}"
        if CONFIG_WARNING.match(line):
            self.messages.append(line)

    def __enter__(self) -> _ConfigWarnings:
        logging.getLogger("transformers").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("transformers").removeHandler(self)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Fail a block that passed but made transformers warn about its model config (:data:`CONFIG_WARNING`)."""
    report = yield
    if isinstance(item, DocItem) and call.when == "call" and report.passed:
        stderr = "".join(text for name, text in report.sections if name == "Captured stderr call")
        warned = CONFIG_WARNING.findall(stderr) + getattr(item, "config_warnings", [])
        if warned:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.where}: transformers warned about the example's model config (set the ids "
                f"the config names inside its vocabulary):\n  " + "\n  ".join(dict.fromkeys(warned))
            )
    return report


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """End the engine interpreter after its page's last block (a vLLM engine holds its KV cache)."""
    if isinstance(item, DocItem) and (nextitem is None or nextitem.parent is not item.parent):
        close_engine(item.config)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if config.getoption("update_expected"):
        edits = config.stash[_EDITS]
        terminalreporter.section("docs harness: --update-expected")
        terminalreporter.write_line(
            "\n  ".join(
                [
                    f"rewrote {sum(done for done, _ in edits)} expected= literal(s):",
                    *(line for _, line in edits),
                ]
            )
            if edits
            else "no expected= literal needed rewriting"
        )

"""Run every Python block of the documentation as a pytest test.

This module is a pytest plugin (loaded with ``-p docs_harness`` from the pytest
configuration in ``pyproject.toml``). It sits on top of pytest-markdown-docs, which
provides the ``--markdown-docs`` switch and the fence extraction, and replaces its
Markdown collector with one that suits the TorchLens site:

* Fences inside Material content tabs (``=== "Tab"``) and admonitions (``!!! note``,
  ``??? note``, ``???+ note``) are collected: the page is flattened before parsing,
  keeping every line where it was, so line numbers stay exact.
* A block whose first line is ``# migration-test: tool=NAME expected=LITERAL`` runs in
  a fresh namespace and must bind ``RESULT`` to a value equal to ``LITERAL``. The
  literal is read with :func:`ast.literal_eval`, never ``eval``.
* Every other ``python`` block runs too; it passes when it raises nothing.
* Failures start with ``docs/page.md:LINE`` (the line of the opening fence), and
  tracebacks point at the page's own lines.
* ``tool=`` becomes a marker (``pytest -m tool_nnsight``). A block whose tool cannot be
  imported is skipped, or fails when the environment variable ``CI`` is true.
* A block whose tool has an engine environment of its own (:data:`ENGINE_ENVIRONMENTS`:
  ``vllm``, ``nnterp``, ``transformer-lens-2``) runs in that environment's interpreter,
  ``.venv-engines/NAME/bin/python`` (built by ``make engines`` from ``envs/NAME.txt``),
  through ``tests/engine_block_runner.py``; ``RESULT`` comes back as a literal and is
  checked here as for any block. A ``{.python continuation}`` block continues in the
  same process as the block before it, so an engine started there is still running.
  A missing environment skips the block, or fails it under ``CI``.
* ``pytest --update-expected`` rewrites stale ``expected=`` literals in place.
* Each block has a time limit, and its output is captured and truncated.
* A page fails if a ``# migration-test:`` header in a Python fence was not collected, or
  if a Python fence's info string would make Material render the block as plain text.
* At the end of the session ``build/doc-examples.json`` records, per page, how many
  examples passed; ``scripts/mkdocs_hooks.py`` turns that into a note on each page.

pytest-markdown-docs does not run docstrings of ``.py`` files here: ``>>>`` examples in
``src/`` run under pytest's own ``--doctest-modules``.

Test ids are ``docs/page.md::SECTION[N]``: the slug of the nearest heading above the
block and the block's ordinal within that section, so editing one section does not
rename the tests of another.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import datetime
import difflib
import faulthandler
import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import io
import json
import linecache
import os
import pathlib
import pprint
import re
import signal
import sys
import threading
import time
import traceback
import types
import unicodedata
from typing import Any, Iterator

import pytest
from markdown_it import MarkdownIt
from pytest_markdown_docs.definitions import FenceTestDefinition
from pytest_markdown_docs.plugin import (
    FenceSyntax,
    MarkdownDocstringCodeModule,
    MarkdownInlinePythonItem,
    MarkdownTextFile,
    extract_fence_tests,
)

# --------------------------------------------------------------------------------------
# Tools
# --------------------------------------------------------------------------------------

#: The one place that maps a ``tool=`` name to the module that must be importable.
#: Add a peer engine here; its marker (``tool_<import name>``) is registered from this
#: table.
TOOL_IMPORTS: dict[str, str] = {
    "torchlens": "torchlens",
    "nnsight": "nnsight",
    "nnterp": "nnterp",
    "interp-engine": "interp_engine",
    "transformer-lens": "transformer_lens",
    "transformerlens": "transformer_lens",
    "transformer-lens-2": "transformer_lens",
    "vllm": "vllm",
}

#: Tools whose blocks run in an engine environment of their own, by environment name:
#: their pins conflict with the main environment's (vLLM's torch and transformers,
#: nnterp's nnsight, TransformerLens 2.x's transformers and distribution name).
#: Environment NAME is described by ``envs/NAME.txt`` and built into
#: ``ENGINE_ENV_ROOT/NAME`` by ``make engines`` (``make test`` runs it first).
ENGINE_ENVIRONMENTS: dict[str, str] = {
    "vllm": "vllm",
    "nnterp": "nnterp",
    "transformer-lens-2": "transformer-lens-2",
}

#: Where the engine environments live, relative to the repository root; the environment
#: variable ``TORCHLENS_ENGINE_ENVS`` overrides it.
ENGINE_ENV_ROOT = ".venv-engines"

#: The script that runs blocks inside an engine environment (standard library only).
ENGINE_BLOCK_RUNNER = pathlib.Path(__file__).with_name("engine_block_runner.py")

#: Tools that are never skipped: if they cannot be imported, the block fails.
ALWAYS_PRESENT_TOOLS = frozenset({"torchlens"})

PYTHON_LANGUAGES = frozenset({"py", "python", "python3"})

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_OUTPUT_LIMIT = 3000
DEFAULT_STATUS_FILE = "build/doc-examples.json"

_USER_PROPERTY_PAGE = "docs_harness.page"
_USER_PROPERTY_EDIT = "docs_harness.edit"


def tool_marker(import_name: str) -> str:
    """Return the marker name for a tool, e.g. ``tool_transformer_lens``."""
    return "tool_" + import_name


def ci_is_on() -> bool:
    """Return True when the environment variable ``CI`` says this is a CI run."""
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


def engine_python(root: pathlib.Path, environment: str) -> pathlib.Path:
    """The interpreter of engine environment ``environment`` (it may not exist yet)."""
    base = pathlib.Path(os.environ.get("TORCHLENS_ENGINE_ENVS") or root / ENGINE_ENV_ROOT)
    return base / environment / "bin" / "python"


# --------------------------------------------------------------------------------------
# The header
# --------------------------------------------------------------------------------------

#: Recognises anything that looks like a header, so a typo (no colon, an underscore)
#: is reported instead of turning the block into a plain one.
_HEADER_LOOSE = re.compile(r"^\s*#\s*migration[-_ ]?test\b(?P<colon>\s*:)?(?P<body>.*)$", re.I)
_EXPECTED_KEY = re.compile(r"(?:^|\s)expected=")
_HEADER_KEYS = ("tool", "timeout", "expected")
_TRAILING_OPTION = re.compile(r"\s(?P<option>timeout=[0-9.]+)\s*$")


@dataclasses.dataclass(frozen=True)
class Header:
    """A parsed ``# migration-test:`` line."""

    line: int  #: 1-based line of the header in the page
    tool: str
    import_name: str
    expected_source: str
    expected: Any
    timeout: float | None


class HeaderError(ValueError):
    """The ``# migration-test:`` line could not be parsed."""


def is_header_line(text: str) -> bool:
    """Return True if ``text`` looks like a ``# migration-test:`` line (even a broken one).

    >>> is_header_line("# migration-test: tool=torchlens expected=1")
    True
    >>> is_header_line("# an ordinary comment")
    False
    """
    return _HEADER_LOOSE.match(text) is not None


def parse_header(text: str, line: int) -> Header:
    """Parse one header line; raise :class:`HeaderError` if it is malformed.

    >>> parse_header("# migration-test: tool=nnsight expected=(1, 'a')", 7).expected
    (1, 'a')
    """
    match = _HEADER_LOOSE.match(text)
    if match is None:
        raise HeaderError("not a `# migration-test:` line")
    if not match["colon"]:
        raise HeaderError("write the header as `# migration-test: tool=NAME expected=LITERAL`")
    body = match["body"].strip()
    found = _EXPECTED_KEY.search(body)
    if found is None:
        raise HeaderError("the header has no `expected=LITERAL` (it must come last)")
    options_text, expected_source = body[: found.start()], body[found.end() :].strip()
    trailing = _TRAILING_OPTION.search(expected_source)
    if trailing is not None:  # `expected=LITERAL timeout=N` is accepted too
        options_text += " " + trailing["option"]
        expected_source = expected_source[: trailing.start()].strip()
    options: dict[str, str] = {}
    for word in options_text.split():
        key, sep, value = word.partition("=")
        if not sep or not value:
            raise HeaderError(f"`{word}` is not KEY=VALUE")
        if key not in _HEADER_KEYS or key == "expected":
            raise HeaderError(f"unknown header key `{key}` (known: tool, timeout, expected)")
        if key in options:
            raise HeaderError(f"`{key}=` is given twice")
        options[key] = value
    tool = options.get("tool")
    if tool is None:
        raise HeaderError("the header has no `tool=NAME`")
    if tool not in TOOL_IMPORTS:
        known = ", ".join(sorted(TOOL_IMPORTS))
        raise HeaderError(
            f"unknown tool `{tool}` (known: {known}); add it to TOOL_IMPORTS in tests/docs_harness.py"
        )
    timeout = None
    if "timeout" in options:
        try:
            timeout = float(options["timeout"])
        except ValueError:
            raise HeaderError(f"timeout=`{options['timeout']}` is not a number of seconds") from None
        if not timeout > 0:
            raise HeaderError("timeout= must be a positive number of seconds")
    if not expected_source:
        raise HeaderError("`expected=` is empty")
    try:
        expected = ast.literal_eval(expected_source)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as error:
        node = re.search(r"<ast\.(\w+) object", str(error))
        reason = f"it contains an ast.{node[1]}" if node else f"{type(error).__name__}: {error}"
        raise HeaderError(
            f"expected= is not a Python literal: {expected_source!r} ({reason}); "
            "use numbers, strings, bytes, True/False/None, tuples, lists, dicts or sets"
        ) from None
    return Header(line, tool, TOOL_IMPORTS[tool], expected_source, expected, timeout)


# --------------------------------------------------------------------------------------
# Parsing pages
# --------------------------------------------------------------------------------------

_CONTAINER_OPENER = re.compile(r"^(?P<indent> *)(?:!!!\+?|\?\?\?\+?|===[!+]*)(?:\s|$)")
_FENCE_OPENER = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def _fence_closes(line: str, fence: str) -> bool:
    stripped = line.strip()
    return len(stripped) >= len(fence) and set(stripped) == {fence[0]}


def flatten_containers(text: str) -> str:
    """Turn Material tabs and admonitions into plain Markdown, keeping every line number.

    Each container line (``=== "Tab"``, ``!!! note``, ``??? note``, ``???+ note``)
    becomes an empty line and its body, indented four spaces, is moved four spaces to
    the left, as often as containers nest. Lines inside fenced code are never read as
    container lines.

    >>> print(flatten_containers('=== "A"\\n\\n    ```python\\n    x = 1\\n    ```'))
    <BLANKLINE>
    <BLANKLINE>
    ```python
    x = 1
    ```
    """
    out: list[str] = []
    stack: list[int] = []  # the indent of each open container's opener line
    fence: str | None = None  # the open fence in flattened text, if any
    fence_depth = 0  # how many containers were open when that fence opened
    for line in text.split("\n"):
        if not line.strip():
            out.append("")
            continue
        indent = len(line) - len(line.lstrip(" "))
        while stack and indent < stack[-1] + 4:
            stack.pop()
        if fence is not None and len(stack) < fence_depth:
            fence = None  # the container ended, and with it the unclosed fence
        flat = line[min(indent, 4 * len(stack)) :]
        if fence is not None:
            if _fence_closes(flat, fence):
                fence = None
            out.append(flat)
            continue
        opener = _CONTAINER_OPENER.match(line)
        if opener is not None:
            stack.append(len(opener["indent"]))
            out.append("")
            continue
        fence_match = _FENCE_OPENER.match(flat)
        if fence_match is not None and len(fence_match["indent"]) < 4:
            if not (fence_match["fence"][0] == "`" and "`" in fence_match["info"]):
                fence, fence_depth = fence_match["fence"], len(stack)
        out.append(flat)
    return "\n".join(out)


class ContainerAwareMarkdownIt(MarkdownIt):
    """A CommonMark parser that first flattens tabs and admonitions."""

    def parse(self, src: str, env: Any = None):  # noqa: D102 - same contract as MarkdownIt
        return super().parse(flatten_containers(src), env)


def slugify(text: str) -> str:
    """Turn a heading into an id, the way MkDocs' table of contents does.

    >>> slugify("Capture a forward pass!")
    'capture-a-forward-pass'
    """
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text) or "section"


def fence_language(info: str) -> str:
    """Return the language of a fence's info string (plain or superfences brace form)."""
    info = info.strip()
    if info.startswith("{"):
        words = info.strip("{}").split()
        dotted = [word[1:] for word in words if word.startswith(".")]
        return dotted[0].lower() if dotted else ""
    return info.split()[0].lower() if info else ""


def scan_python_headers(text: str) -> list[int]:
    """Find header lines inside Python fences by a plain line scan.

    This deliberately does not use the Markdown parser, so it can notice a block that
    the parser missed. Fences may be indented (tabs, admonitions, lists); headers in
    non-Python fences (a page that shows the syntax) and in prose are ignored.
    """
    found: list[int] = []
    fence: str | None = None
    language = ""
    for number, line in enumerate(text.split("\n"), start=1):
        if fence is None:
            match = _FENCE_OPENER.match(line)
            if match and not (match["fence"][0] == "`" and "`" in match["info"]):
                fence, language = match["fence"], fence_language(match["info"])
            continue
        if _fence_closes(line, fence):
            fence = None
        elif language in PYTHON_LANGUAGES and is_header_line(line):
            found.append(number)
    return found


_INFO_TOKEN = re.compile(r'[^\s=]+="[^"]*"|\S+')


def scan_unrenderable_python_fences(text: str) -> list[tuple[int, str]]:
    """Find Python fences whose info string Material would not render as code.

    PyMdown's superfences accepts ``python`` followed by ``key="value"`` options, or the
    brace form ``{.python notest}``. A bare extra word (```` ```python notest ````) turns
    the whole block into inline text on the site, silently.
    """
    found: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.split("\n"), start=1):
        if fence is not None:
            if _fence_closes(line, fence):
                fence = None
            continue
        match = _FENCE_OPENER.match(line)
        if match is None or (match["fence"][0] == "`" and "`" in match["info"]):
            continue
        fence, info = match["fence"], match["info"].strip()
        if info.startswith("{") or fence_language(info) not in PYTHON_LANGUAGES:
            continue
        if any("=" not in token for token in _INFO_TOKEN.findall(info)[1:]):
            found.append((number, info))
    return found


@dataclasses.dataclass
class Block:
    """One Python fence of a page, ready to become a test item."""

    definition: FenceTestDefinition
    fence_line: int  #: 1-based line of the opening fence
    name: str  #: the stable test name, ``SECTION[N]``
    last_line: int  #: 1-based line of the last code line
    header_line: int | None = None  #: line of the first code line, when it is a header
    continues: int | None = None  #: fence line of the block a ``continuation`` block continues
    header: Header | None = None
    header_error: str | None = None


def block_body(definition: FenceTestDefinition) -> str:
    """Return the block's own code, without the padding (or earlier blocks) before it."""
    source, offset = definition.source, definition.start_line
    if source.startswith("\n" * offset):
        return source[offset:]
    return "\n".join(source.split("\n")[offset:])  # a `continuation` block


def _first_code_line(definition: FenceTestDefinition) -> tuple[int, str] | None:
    for index, line in enumerate(block_body(definition).split("\n")):
        if line.strip():
            return definition.start_line + index + 1, line
    return None


def extract_blocks(text: str, path: pathlib.Path, display: str, syntax: FenceSyntax) -> list[Block]:
    """Parse a page into :class:`Block` objects with stable names and parsed headers."""
    parser = ContainerAwareMarkdownIt("commonmark")
    headings: list[tuple[int, str]] = []
    used_slugs: dict[str, int] = {}
    tokens = parser.parse(text)
    for index, token in enumerate(tokens):
        if token.type == "heading_open" and token.map and index + 1 < len(tokens):
            slug = slugify(tokens[index + 1].content)
            seen = used_slugs.get(slug, 0)
            used_slugs[slug] = seen + 1
            headings.append((token.map[0] + 1, slug if seen == 0 else f"{slug}_{seen}"))

    blocks: list[Block] = []
    ordinals: dict[str, int] = {}
    for definition in extract_fence_tests(parser, text, 0, path, fence_syntax=syntax):
        fence_line = definition.start_line
        section = "top"
        for heading_line, slug in headings:
            if heading_line < fence_line:
                section = slug
        ordinals[section] = ordinals.get(section, 0) + 1
        last_line = fence_line + block_body(definition).rstrip("\n").count("\n") + 1
        block = Block(definition, fence_line, f"{section}[{ordinals[section]}]", last_line)
        offset = definition.start_line
        if blocks and definition.source[:offset] != "\n" * offset:
            block.continues = blocks[-1].fence_line
        first = _first_code_line(definition)
        if first is not None and is_header_line(first[1]):
            block.header_line = first[0]
            try:
                block.header = parse_header(first[1], first[0])
            except HeaderError as error:
                block.header_error = (
                    f"{display}:{fence_line}: malformed `# migration-test:` header "
                    f"(line {first[0]}): {error}\n    {first[1].strip()}"
                )
        blocks.append(block)
    return blocks


def display_path(path: pathlib.Path, root: pathlib.Path) -> str:
    """Return ``path`` relative to the repository root, with forward slashes."""
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def read_page(path: pathlib.Path) -> str:
    """Read a page the way MkDocs does (UTF-8, optional BOM, universal newlines)."""
    return path.read_text(encoding="utf-8-sig")


def page_sha256(text: str) -> str:
    """Return the hash that the MkDocs hook compares with."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------
# Running a block
# --------------------------------------------------------------------------------------


class DocExampleFailure(Exception):
    """A failure whose message is complete as it stands (shown without a traceback)."""


class DocExampleTimeout(Exception):
    """Raised inside a block that ran past its time limit."""


def truncate(text: str, limit: int) -> str:
    """Keep the start and the end of ``text`` within about ``limit`` characters.

    >>> truncate("abcdefghij", 4)
    'ab\\n[... 6 characters cut ...]\\nij'
    """
    if limit <= 0 or len(text) <= limit:
        return text
    head, tail = limit // 2, limit - limit // 2
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters cut ...]\n{text[-tail:]}"


class _Watchdog:
    """One background thread that ends the process if a block is stuck past its deadline.

    This is the backstop for code stuck in C that never returns to Python, where the
    ``SIGALRM`` exception cannot land. Arming and disarming only take a lock, so it
    costs next to nothing per block (``faulthandler.dump_traceback_later`` would start
    and join a thread every time).
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._deadline: float | None = None
        self._message = ""
        self._thread: threading.Thread | None = None
        self._sleeping_until: float | None = None  # when the thread wakes up by itself

    def arm(self, seconds: float, message: str) -> None:
        with self._condition:
            self._deadline, self._message = time.monotonic() + seconds, message
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="docs-harness-watchdog", daemon=True)
                self._thread.start()
            # Wake the thread only if it would otherwise sleep past the new deadline.
            if self._sleeping_until is None or self._deadline < self._sleeping_until:
                self._condition.notify()

    def disarm(self) -> None:
        with self._condition:
            self._deadline = None

    def _watch(self) -> None:
        with self._condition:
            while True:
                if self._deadline is None:
                    self._sleeping_until = None
                    self._condition.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._sleeping_until = self._deadline
                    self._condition.wait(left)
                    continue
                if _TERMINAL_STDERR is not None:
                    os.write(_TERMINAL_STDERR, f"\n{self._message}\n".encode())
                    faulthandler.dump_traceback(file=_TERMINAL_STDERR, all_threads=True)
                os._exit(1)


_WATCHDOG = _Watchdog()

# pytest's capture redirects file descriptor 2 while tests run, and the watchdog ends
# the process without letting pytest print what it captured. This module is imported
# (by `-p docs_harness`) before capture starts, so keep a copy of the terminal's stderr.
try:
    _TERMINAL_STDERR: int | None = os.dup(2)
except OSError:
    _TERMINAL_STDERR = None


@contextlib.contextmanager
def time_limit(seconds: float, where: str, grace: float | None = None) -> Iterator[None]:
    """Interrupt the block after ``seconds`` with :class:`DocExampleTimeout`.

    The alarm is a ``SIGALRM`` timer, so it works in the main thread on POSIX. If the
    exception cannot land (the block is stuck in C), a watchdog prints the page and
    line, dumps every thread's stack (frames in the page show as ``File
    "docs/page.md"``) and ends the process ``grace`` seconds later (by default a
    quarter of the limit, between 5 and 60 seconds).
    """
    use_alarm = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    previous = None

    def on_alarm(signum, frame):
        raise DocExampleTimeout(f"{where}: the example did not finish within {seconds:g} s")

    if use_alarm:
        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    if grace is None:
        grace = min(60.0, max(5.0, seconds / 4))
    _WATCHDOG.arm(
        seconds + grace,
        f"{where}: the example is still running {seconds + grace:g} s after it started; "
        "ending the test run (stacks follow)",
    )
    try:
        yield
    finally:
        _WATCHDOG.disarm()
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _literal_round_trips(value: Any) -> str | None:
    """Return ``repr(value)`` if it reads back as an equal value of the same type."""
    source = repr(value)
    if "\n" in source:
        return None
    try:
        again = ast.literal_eval(source)
    except Exception:
        return None
    try:
        if type(again) is not type(value) or not _values_equal(again, value):
            return None
    except TypeError:
        return None
    return source


def _values_equal(actual: Any, expected: Any) -> bool:
    result = actual == expected
    if isinstance(result, bool):
        return result
    try:
        return bool(result)
    except Exception:
        raise TypeError(
            f"RESULT is a {type(actual).__name__}, whose `==` does not give True or False; "
            "bind RESULT to plain values (tuples, lists, dicts, numbers, strings)"
        ) from None


def _describe_mismatch(expected: Any, actual: Any) -> str:
    expected_text, actual_text = repr(expected), repr(actual)
    if len(expected_text) + len(actual_text) <= 140 and "\n" not in expected_text + actual_text:
        return f"  expected: {expected_text}\n  RESULT:   {actual_text}"
    expected_lines = pprint.pformat(expected, width=88).splitlines()
    actual_lines = pprint.pformat(actual, width=88).splitlines()
    diff = difflib.unified_diff(expected_lines, actual_lines, "expected", "RESULT", lineterm="", n=2)
    return "\n".join(["  diff (- expected, + RESULT):", *("    " + line for line in diff)])


class DocExampleItem(MarkdownInlinePythonItem):
    """One Python block of a page."""

    def __init__(self, name: str, parent: "DocPage", test_definition: FenceTestDefinition, block: Block):
        super().__init__(name, parent, test_definition)
        self.block = block
        # pytest-markdown-docs stores the (padded) source here; reports don't need it.
        self.user_properties[:] = [(_USER_PROPERTY_PAGE, parent.display)]
        if block.header is not None:
            self.add_marker("migration_test")
            self.add_marker(tool_marker(block.header.import_name))

    @property
    def where(self) -> str:
        """``docs/page.md:LINE`` of the opening fence."""
        return f"{self.parent.display}:{self.block.fence_line}"

    def reportinfo(self):
        return self.path, self.block.fence_line - 1, f"{self.where} {self.name}"

    def runtest(self) -> None:
        block, settings = self.block, self.config.stash[_SETTINGS]
        if block.header_error is not None:
            raise DocExampleFailure(block.header_error)
        header = block.header
        if header is not None and header.tool in ENGINE_ENVIRONMENTS:
            self._run_in_engine_environment(header, settings)
            return
        if header is not None:
            self._require_tool(header)
        namespace = self._namespace()
        code = self._compile()
        # What `linecache` (and so tracebacks, `inspect.getsource` and tools that read
        # their caller's source, like nnsight's tracer) sees under the page's name while
        # this block runs: the block's code at its page lines, every other line blank.
        # The page itself is Markdown, which would not parse as Python.
        source = block.definition.source
        linecache.cache[self.parent.code_filename] = (
            len(source), None, source.splitlines(keepends=True), self.parent.code_filename
        )
        timeout = header.timeout if header is not None and header.timeout else settings.timeout
        capture = self.config.getoption("capture") != "no"
        stdout, stderr = io.StringIO(), io.StringIO()
        try:
            with contextlib.ExitStack() as stack:
                if capture:
                    stack.enter_context(contextlib.redirect_stdout(stdout))
                    stack.enter_context(contextlib.redirect_stderr(stderr))
                stack.enter_context(time_limit(timeout, self.where, settings.kill_grace))
                if code.co_flags & inspect.CO_COROUTINE:
                    asyncio.run(eval(code, namespace))
                else:
                    exec(code, namespace)
        finally:
            for stream, buffer in (("stdout", stdout), ("stderr", stderr)):
                if buffer.getvalue():
                    self.add_report_section("call", stream, truncate(buffer.getvalue(), settings.output_limit))
        if header is not None:
            self._check_result(header, namespace)

    def _compile(self) -> types.CodeType:
        """Compile the block so that its line numbers are the page's line numbers.

        pytest-markdown-docs pads the source with one newline per line of the page
        above the block; compiling the block alone and shifting its line numbers gives
        the same code objects without parsing the padding again for every block.
        """
        source, offset = self.block.definition.source, self.block.definition.start_line
        filename, flags = self.parent.code_filename, ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        if source[:offset] != "\n" * offset:  # a `continuation` block: compile it whole
            return compile(source, filename, "exec", flags=flags, dont_inherit=True)
        try:
            # Parsed under a name that is not a file: for a file that exists, CPython would
            # take the error's text from the page at the unshifted line.
            tree = compile(source[offset:], "<docs block>", "exec", flags=flags | ast.PyCF_ONLY_AST, dont_inherit=True)
        except SyntaxError as error:
            error.filename = filename
            if error.lineno is not None:
                error.lineno += offset
            if getattr(error, "end_lineno", None) is not None:
                error.end_lineno += offset
            raise
        ast.increment_lineno(tree, offset)
        return compile(tree, filename, "exec", flags=flags, dont_inherit=True)

    def _run_in_engine_environment(self, header: Header, settings: "Settings") -> None:
        """Run the block in its engine environment's interpreter and check what comes back."""
        environment = ENGINE_ENVIRONMENTS[header.tool]
        python = engine_python(self.config.rootpath, environment)
        if not python.exists():
            message = (
                f"tool={header.tool} runs in the engine environment {display_path(python.parent.parent, self.config.rootpath)}, "
                f"which is not built (`make engines` builds it from envs/{environment}.txt)"
            )
            if ci_is_on():
                raise DocExampleFailure(f"{self.where}: {message} (CI=true: every engine environment must be built)")
            raise pytest.skip.Exception(message, _use_item_location=True)
        block, pool = self.block, self.config.stash[_WORKERS]
        worker = pool.get(environment)
        offset = block.definition.start_line
        if (
            block.continues is not None
            and worker is not None
            and worker.page == self.parent.display
            and worker.last_passed == block.continues
            and worker.alive()
        ):
            source = "\n" * offset + block_body(block.definition)  # the earlier blocks already ran there
        else:
            worker = pool.start(environment, python, self.parent.display, self.config.rootpath)
            source = block.definition.source  # a continuation block brings the blocks it continues
        timeout = header.timeout or settings.timeout
        reply, output = worker.run(source, self.parent.code_filename, timeout, settings.kill_grace)
        limit = settings.output_limit
        for stream in ("stdout", "stderr"):
            if reply and reply.get(stream):
                self.add_report_section("call", stream, truncate(reply[stream], limit))
        if output:
            self.add_report_section("call", f"{environment} process output", truncate(output, limit))
        if reply is None:
            pool.close(environment)
            line = worker.running_line(self.parent.code_filename)
            if worker.timed_out:
                running = f" (it was running line {line})" if line else ""
                raise DocExampleFailure(
                    f"{self.where}: the example did not finish within {timeout:g} s in {environment}{running}\n"
                    + self._listing(line)
                )
            raise DocExampleFailure(
                f"{self.where}: the {environment} interpreter ended without an answer (exit status "
                f"{worker.process.returncode}){f' while running line {line}' if line else ''}\n"
                + truncate(output, limit)
            )
        if not reply["ok"]:
            raise DocExampleFailure(self._remote_failure(reply))
        worker.last_passed = block.fence_line
        if not reply["has_result"]:
            raise DocExampleFailure(
                f"{self.where}: the block has a `# migration-test:` header but never binds RESULT"
            )
        self._check_result(header, {"RESULT": ast.literal_eval(reply["result"])})

    def _remote_failure(self, reply: dict[str, Any]) -> str:
        """The failure report of a block that raised in an engine environment."""
        summary = reply["summary"]
        if reply["kind"] == "result":
            return f"{self.where}: {summary}"
        if reply.get("syntax_error_line"):
            return f"{self.where}: SyntaxError in the block (line {reply['syntax_error_line']})\n{summary}"
        filename = self.parent.code_filename
        frames = [traceback.FrameSummary(f, n, name, line=text) for f, n, name, text in reply["frames"]]
        first = next((i for i, frame in enumerate(frames) if frame.filename == filename), 0)
        failing_line = next((frame.lineno for frame in reversed(frames) if frame.filename == filename), None)
        at = f" at line {failing_line}" if failing_line else ""
        headline = summary.splitlines()[0] if summary else "error"
        return "\n".join(
            [
                f"{self.where}: {headline} (raised{at})",
                self._listing(failing_line),
                "Traceback (most recent call last):",
                "".join(traceback.format_list(frames[first:])).rstrip(),
                summary,
            ]
        )

    def _require_tool(self, header: Header) -> None:
        if header.tool in ALWAYS_PRESENT_TOOLS:
            return
        try:
            found = importlib.util.find_spec(header.import_name) is not None
        except (ImportError, ValueError):
            found = False
        if found:
            return
        message = f"tool={header.tool} needs `import {header.import_name}`, which is not installed"
        if ci_is_on():
            raise DocExampleFailure(f"{self.where}: {message} (CI=true: every tool must be installed)")
        # Report the skip at the page's line, not at this line of the harness.
        raise pytest.skip.Exception(message, _use_item_location=True)

    def _namespace(self) -> dict[str, Any]:
        namespace = types.ModuleType("docs_example").__dict__
        for extra in self.config.hook.pytest_markdown_docs_globals():
            namespace.update(extra)
        for fixture_name in self._fixtureinfo.names_closure:
            self.fixture_request.getfixturevalue(fixture_name)
        namespace.update(self.funcargs)
        return namespace

    def _check_result(self, header: Header, namespace: dict[str, Any]) -> None:
        if "RESULT" not in namespace:
            raise DocExampleFailure(
                f"{self.where}: the block has a `# migration-test:` header but never binds RESULT"
            )
        actual = namespace["RESULT"]
        try:
            if _values_equal(actual, header.expected):
                return
        except TypeError as error:
            raise DocExampleFailure(f"{self.where}: {error}") from None
        headline = f"{self.where}: RESULT != expected (tool={header.tool}, header on line {header.line})"
        details = _describe_mismatch(header.expected, actual)
        if self.config.getoption("update_expected"):
            new_source = _literal_round_trips(actual)
            if new_source is not None:
                edit = {
                    "path": str(self.path),
                    "display": self.parent.display,
                    "line": header.line,
                    "old": header.expected_source,
                    "new": new_source,
                }
                self.user_properties.append((_USER_PROPERTY_EDIT, edit))
                return
            raise DocExampleFailure(
                f"{headline}\n{details}\n  not updated: repr(RESULT) does not read back "
                "through ast.literal_eval as an equal value"
            )
        raise DocExampleFailure(
            f"{headline}\n{details}\n  if the change is intended: pytest {self.parent.display} --update-expected"
        )

    def repr_failure(self, excinfo, style=None) -> str:
        error = excinfo.value
        if isinstance(error, DocExampleFailure):
            return str(error)
        if isinstance(error, SyntaxError) and error.filename == self.parent.code_filename:
            detail = traceback.format_exception_only(type(error), error)
            return f"{self.where}: SyntaxError in the block (line {error.lineno})\n" + "".join(detail).rstrip()
        frames = [frame for frame in traceback.extract_tb(excinfo.tb) if frame.filename != __file__]
        first = next(
            (i for i, frame in enumerate(frames) if frame.filename == self.parent.code_filename), 0
        )
        failing_line = next(
            (frame.lineno for frame in reversed(frames) if frame.filename == self.parent.code_filename),
            None,
        )
        at = f" at line {failing_line}" if failing_line else ""
        if isinstance(error, DocExampleTimeout):
            summary = f"DocExampleTimeout: {error}"
            headline = f"{error} (it was running line {failing_line})" if failing_line else str(error)
        else:
            summary = "".join(traceback.format_exception_only(type(error), error)).strip()
            headline = f"{self.where}: {summary.splitlines()[0] if summary else type(error).__name__} (raised{at})"
        return "\n".join(
            [
                headline,
                self._listing(failing_line),
                "Traceback (most recent call last):",
                "".join(traceback.format_list(frames[first:])).rstrip(),
                summary,
            ]
        )

    def _listing(self, failing_line: int | None, context: int = 12) -> str:
        """Show the block's lines with page line numbers, marking the failing one."""
        lines = self.block.definition.source.split("\n")
        first = self.block.definition.start_line  # 0-based index of the first code line
        last = len(lines) - 1
        while last > first and not lines[last].strip():
            last -= 1
        if failing_line is not None and last - first > 2 * context:
            first = max(first, failing_line - 1 - context)
            last = min(last, failing_line - 1 + context)
        width = len(str(last + 1))
        shown = []
        for index in range(first, last + 1):
            mark = ">" if failing_line == index + 1 else " "
            shown.append(f"{mark} {index + 1:>{width}}  {lines[index]}")
        return "\n".join(shown)


class EngineWorker:
    """One interpreter of an engine environment, running blocks of one page in order."""

    def __init__(self, environment: str, python: pathlib.Path, page: str, root: pathlib.Path):
        import subprocess
        import tempfile

        self.environment, self.page = environment, page
        self.last_passed: int | None = None  #: fence line of the last block that passed here
        self.timed_out = False
        self.log = tempfile.TemporaryFile(mode="w+b")  # the process's own stdout and stderr
        self._read_at = 0
        read_fd, write_fd = os.pipe()
        env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONHOME")}
        paths = [str(root / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["PYTHONUNBUFFERED"] = "1"
        self.process = subprocess.Popen(
            [str(python), str(ENGINE_BLOCK_RUNNER), str(write_fd)],
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=self.log,
            pass_fds=(write_fd,),
            cwd=root,
            env=env,
            text=True,
        )
        os.close(write_fd)
        self._replies = os.fdopen(read_fd, "r", encoding="utf-8")

    def alive(self) -> bool:
        return self.process.poll() is None

    def run(self, source: str, filename: str, timeout: float, grace: float | None) -> tuple[dict[str, Any] | None, str]:
        """Send one block; return its reply (None if none came) and the process's new output."""
        import select

        if grace is None:
            grace = min(60.0, max(5.0, timeout / 4))
        request = json.dumps({"source": source, "filename": filename, "timeout": timeout})
        reply = None
        try:
            self.process.stdin.write(request + "\n")
            self.process.stdin.flush()
            ready, _, _ = select.select([self._replies], [], [], timeout + grace)
            if ready:
                line = self._replies.readline()
                reply = json.loads(line) if line else None
            else:
                self.timed_out = True
        except (BrokenPipeError, OSError, ValueError):
            reply = None
        if reply is None and self.alive():
            self.process.kill()  # stuck past its time limit, or it broke the protocol
            self.process.wait()
        return reply, self.new_output()

    def new_output(self) -> str:
        self.log.seek(self._read_at)
        data = self.log.read()
        self._read_at += len(data)
        self.log.seek(0, os.SEEK_END)
        return data.decode("utf-8", "replace")

    def running_line(self, filename: str) -> int | None:
        """The page line in the last stack dump (or traceback) the process wrote, if any."""
        self.log.seek(0)
        text = self.log.read().decode("utf-8", "replace")
        found = re.findall(r'File "' + re.escape(filename) + r'", line (\d+)', text)
        return int(found[-1]) if found else None

    def close(self) -> None:
        if self.alive():
            try:
                self.process.stdin.close()
            except OSError:
                pass
            try:
                self.process.wait(timeout=10)
            except Exception:
                self.process.kill()
                self.process.wait()
        self._replies.close()


class EngineWorkers:
    """The running engine interpreters: at most one per environment, one at a time in all
    (an engine such as vLLM reserves memory for its cache while it runs)."""

    def __init__(self) -> None:
        self.workers: dict[str, EngineWorker] = {}

    def get(self, environment: str) -> EngineWorker | None:
        return self.workers.get(environment)

    def start(self, environment: str, python: pathlib.Path, page: str, root: pathlib.Path) -> EngineWorker:
        self.close_all()
        worker = self.workers[environment] = EngineWorker(environment, python, page, root)
        return worker

    def close(self, environment: str) -> None:
        worker = self.workers.pop(environment, None)
        if worker is not None:
            worker.close()

    def close_all(self) -> None:
        for environment in list(self.workers):
            self.close(environment)


_WORKERS = pytest.StashKey[EngineWorkers]()


class PageProblemItem(pytest.Item):
    """Fails because of a problem found in the page itself, such as a header that was
    not collected as a test."""

    def __init__(self, name: str, parent: "DocPage", line: int, message: str, header: bool):
        super().__init__(name, parent)
        self.line, self.message = line, message
        self.user_properties.append((_USER_PROPERTY_PAGE, parent.display))
        if header:
            self.add_marker("migration_test")

    def runtest(self) -> None:
        raise DocExampleFailure(f"{self.parent.display}:{self.line}: {self.message}")

    def repr_failure(self, excinfo, style=None) -> str:
        return str(excinfo.value)

    def reportinfo(self):
        return self.path, self.line - 1, self.name


class DocPage(pytest.File):
    """A Markdown page whose Python blocks are tests."""

    @functools.cached_property
    def display(self) -> str:
        """The page's path relative to the repository root, e.g. ``docs/index.md``."""
        return display_path(self.path, self.config.rootpath)

    @property
    def code_filename(self) -> str:
        """The file name blocks are compiled with (see :meth:`DocExampleItem.runtest`)."""
        return self.display

    def collect(self):
        text = read_page(self.path)
        syntax = FenceSyntax(self.config.option.markdowndocs_syntax)
        blocks = extract_blocks(text, self.path, self.display, syntax)
        self.config.stash[_SETTINGS].page_blocks[self.display] = len(blocks)
        for block in blocks:
            yield DocExampleItem.from_parent(
                self, name=block.name, test_definition=block.definition, block=block
            )
        collected = {block.header_line for block in blocks if block.header_line is not None}
        for line in scan_python_headers(text):
            if line in collected:
                continue
            if any(block.fence_line < line <= block.last_line for block in blocks):
                reason = "a header must be the first line of its block"
            else:
                reason = (
                    "no collected Python block holds it (a fence indented in an unsupported "
                    "container, a `notest` fence, or a fence the parser did not see?)"
                )
            yield PageProblemItem.from_parent(
                self,
                name=f"uncollected-header[line-{line}]",
                line=line,
                message=f"a `# migration-test:` header was not collected: {reason}",
                header=True,
            )
        for line, info in scan_unrenderable_python_fences(text):
            words = info.split(None, 1)
            yield PageProblemItem.from_parent(
                self,
                name=f"fence-info[line-{line}]",
                line=line,
                message=(
                    f"the site would show this block as plain text: PyMdown does not accept "
                    f"the fence info `{info}`; write it as `{{.{words[0]} {words[1]}}}`"
                ),
                header=False,
            )


# --------------------------------------------------------------------------------------
# Session state, status file and --update-expected
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Settings:
    """Per-session configuration and results."""

    timeout: float
    output_limit: int
    status_file: pathlib.Path
    kill_grace: float | None
    outcomes: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)  # nodeid -> (page, outcome)
    page_blocks: dict[str, int] = dataclasses.field(default_factory=dict)  # page -> blocks collected
    edits: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    applied: list[str] = dataclasses.field(default_factory=list)


_SETTINGS = pytest.StashKey[Settings]()
_OUTCOME_RANK = {"passed": 0, "skipped": 1, "failed": 2}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("docs_harness", "TorchLens documentation examples")
    group.addoption(
        "--update-expected",
        action="store_true",
        default=False,
        dest="update_expected",
        help="rewrite stale `expected=` literals of `# migration-test:` blocks in place",
    )
    parser.addini("doc_example_timeout", "seconds one docs block may run (default 300)", default=str(DEFAULT_TIMEOUT_S))
    parser.addini(
        "doc_example_output_limit",
        "characters of a docs block's output kept in the report (default 3000)",
        default=str(DEFAULT_OUTPUT_LIMIT),
    )
    parser.addini("doc_example_status_file", "where the per-page status JSON is written", default=DEFAULT_STATUS_FILE)
    parser.addini(
        "doc_example_kill_grace",
        "seconds after a block's timeout before a block stuck in C ends the run (default: a quarter of the timeout, 5-60 s)",
        default="",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "migration_test: a docs block with a `# migration-test:` header")
    for import_name in sorted(set(TOOL_IMPORTS.values())):
        names = ", ".join(sorted(tool for tool, imp in TOOL_IMPORTS.items() if imp == import_name))
        config.addinivalue_line("markers", f"{tool_marker(import_name)}: docs blocks with tool={names}")
    settings = Settings(
        timeout=float(config.getini("doc_example_timeout")),
        output_limit=int(config.getini("doc_example_output_limit")),
        status_file=config.rootpath / config.getini("doc_example_status_file"),
        kill_grace=float(config.getini("doc_example_kill_grace")) if config.getini("doc_example_kill_grace") else None,
    )
    config.stash[_SETTINGS] = settings
    workers = config.stash[_WORKERS] = EngineWorkers()
    config.add_cleanup(workers.close_all)
    config.pluginmanager.register(SessionResults(config, settings), "docs_harness_results")


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """End the page's engine interpreters after its last block (a vLLM engine holds its KV cache)."""
    if isinstance(item, DocExampleItem) and (nextitem is None or nextitem.parent is not item.parent):
        item.config.stash[_WORKERS].close_all()


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path: pathlib.Path, parent: pytest.Collector):
    """Use :class:`DocPage` for ``.md`` files and drop docstring collection of ``.py`` files."""
    collected = yield
    kept = [
        node
        for node in collected
        if not isinstance(node, MarkdownDocstringCodeModule)
        and not (isinstance(node, MarkdownTextFile) and file_path.suffix == ".md")
    ]
    if parent.config.option.markdowndocs and file_path.suffix == ".md":
        kept.append(DocPage.from_parent(parent, path=file_path))
    return kept


class SessionResults:
    """Collects outcomes and edits from reports; on the xdist controller too."""

    def __init__(self, config: pytest.Config, settings: Settings):
        self.config, self.settings = config, settings

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        page = next((value for key, value in report.user_properties if key == _USER_PROPERTY_PAGE), None)
        if page is None:
            return
        if report.failed:
            outcome = "failed"
        elif report.skipped:
            outcome = "skipped"
        elif report.when == "call":
            outcome = "passed"
        else:
            return
        outcomes = self.settings.outcomes
        previous = outcomes.get(report.nodeid)
        if previous is None or _OUTCOME_RANK[outcome] > _OUTCOME_RANK[previous[1]]:
            outcomes[report.nodeid] = (page, outcome)
        if report.when == "call":
            self.settings.edits.extend(value for key, value in report.user_properties if key == _USER_PROPERTY_EDIT)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        """Apply ``--update-expected`` edits, then write the status file (controller only)."""
        if hasattr(self.config, "workerinput"):
            return
        self.settings.applied = apply_edits(self.settings.edits)
        if self.settings.outcomes:
            write_status(self.settings, self.config.rootpath)

    def pytest_terminal_summary(self, terminalreporter, exitstatus: int, config: pytest.Config) -> None:
        if hasattr(config, "workerinput") or not config.getoption("update_expected"):
            return
        terminalreporter.section("docs harness: --update-expected")
        if self.settings.applied:
            terminalreporter.write_line(f"rewrote {len(self.settings.applied)} expected= literal(s):")
            for line in self.settings.applied:
                terminalreporter.write_line("  " + line)
        else:
            terminalreporter.write_line("no expected= literal needed rewriting")


def apply_edits(edits: list[dict[str, Any]]) -> list[str]:
    """Rewrite ``expected=`` literals; return one line per edit for the summary."""
    done: list[str] = []
    by_path: dict[str, list[dict[str, Any]]] = {}
    for edit in edits:
        by_path.setdefault(edit["path"], []).append(edit)
    for path_text, page_edits in by_path.items():
        path = pathlib.Path(path_text)
        raw = path.read_bytes().decode("utf-8")
        lines = raw.splitlines(keepends=True)
        changed = False
        for edit in page_edits:
            index = edit["line"] - 1
            line = lines[index] if index < len(lines) else ""
            body = line.rstrip("\r\n")
            ending = line[len(body) :]
            found = _EXPECTED_KEY.search(body) if is_header_line(body) else None
            if found is None or body[found.end() :].strip() != edit["old"]:
                done.append(f"{edit['display']}:{edit['line']}: skipped, the line changed during the run")
                continue
            lines[index] = body[: found.end()] + edit["new"] + ending
            changed = True
            done.append(f"{edit['display']}:{edit['line']}: expected={edit['old']}  ->  expected={edit['new']}")
        if changed:
            path.write_bytes("".join(lines).encode("utf-8"))
    return done


def _torchlens_version() -> str:
    module = sys.modules.get("torchlens")
    if module is not None and getattr(module, "__version__", None):
        return str(module.__version__)
    try:
        return importlib.metadata.version("torchlens")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def write_status(settings: Settings, root: pathlib.Path) -> None:
    """Merge this session's per-page results into the status JSON."""
    path = settings.status_file
    try:
        status = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(status.get("pages"), dict):
            raise ValueError
    except (OSError, ValueError, AttributeError):
        status = {"pages": {}}
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    version = _torchlens_version()
    pages: dict[str, dict[str, int]] = {}
    for page, outcome in settings.outcomes.values():
        counts = pages.setdefault(page, {"passed": 0, "failed": 0, "skipped": 0})
        counts[outcome] += 1
    for page, counts in pages.items():
        page_path = root / page
        try:
            text = read_page(page_path)
        except OSError:
            continue
        examples = settings.page_blocks.get(page)
        if examples is None or settings.edits:  # xdist controller, or the page was rewritten
            examples = len(extract_blocks(text, page_path, page, FenceSyntax.superfences))
        status["pages"][page] = {
            "examples": examples,
            **counts,
            "sha256": page_sha256(text),
            "torchlens_version": version,
            "timestamp": now,
        }
    status["generated_at"] = now
    status["torchlens_version"] = version
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(status, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(temporary, path)


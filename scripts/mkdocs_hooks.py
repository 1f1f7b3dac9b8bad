"""MkDocs hooks for the TorchLens site (registered under ``hooks:`` in mkdocs.yml).

``on_page_markdown`` puts a note under the title of every page whose Python examples
were run by a ``pytest`` run, from the outcomes recorded per block in
``tests/doc_outputs.json`` (written by the pytest plugin ``tests/doc_outputs.py`` and committed, so a
fresh clone's build shows them too):

* "N/N examples verified" when every example on the page passed,
* a failure note when some failed, were skipped or did not run (an example whose code
  changed since its run counts as not run),
* "stale: page changed since the last test run" when the page's SHA-256 no longer
  matches the one recorded.

The file may be missing or unreadable; then pages are left as they are.

It also changes how Python examples are shown (the page source, which is the test, is
left as it is):

* A block's ``# migration-test: tool=NAME expected=LITERAL`` first line is shown as a
  compact "tested" badge above the block, with the asserted value, instead of as the
  block's first code line (except on the pages in ``HEADERS_SHOWN``, which explain it).
* What a block printed in the last test run is shown under it, from
  ``tests/doc_outputs.json`` (written by the pytest plugin ``tests/doc_outputs.py``). An
  output is only shown under a block whose code still hashes to the recorded hash, so an
  edited block shows nothing until the next test run.

``on_post_page`` marks where a long name may wrap on a narrow screen: a ``<wbr>`` after each
``.``, ``_``, ``/`` and ``:`` inside a long word of the page's article, outside code blocks
(``blocks.0.`` / ``hook_resid_post``, never ``hook_re`` / ``sid_post``). Inline code does not wrap
at all where the column is wide enough (``docs/stylesheets/extra.css``). It runs after the search
plugin has read the page, so the search index holds the names unbroken.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re

log = logging.getLogger("mkdocs.hooks.torchlens")

OUTPUTS_FILE = os.path.join("tests", "doc_outputs.json")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
#: Pages that teach the header syntax keep it visible in their blocks.
HEADERS_SHOWN = frozenset({"docs/contributing/executable-docs.md"})


def _load_status(config, name: str = OUTPUTS_FILE) -> dict:
    """Return the ``pages`` table of the outputs file, or an empty one."""
    root = os.path.dirname(os.path.abspath(config.config_file_path))
    path = os.path.join(root, name)
    try:
        with open(path, encoding="utf-8") as handle:
            pages = json.load(handle).get("pages", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return pages if isinstance(pages, dict) else {}


def _page_key(page, config) -> str:
    root = os.path.dirname(os.path.abspath(config.config_file_path))
    return os.path.relpath(page.file.abs_src_path, root).replace(os.sep, "/")


def _note(entry: dict, current_sha: str) -> str | None:
    """Build the admonition for one page, or None when it has no examples."""
    try:
        examples = int(entry["examples"])
        passed, failed, skipped = (
            int(entry.get(key, 0)) for key in ("passed", "failed", "skipped")
        )
    except (KeyError, TypeError, ValueError):
        return None
    if examples <= 0:
        return None
    when = entry.get("timestamp", "an unknown time")
    version = entry.get("torchlens_version", "unknown")
    ran = f"the test run recorded on {when} (torchlens {version})"
    if entry.get("sha256") != current_sha:
        return (
            '!!! warning "stale: page changed since the last test run"\n\n'
            f"    {passed}/{examples} examples passed in {ran}, but the page has been edited "
            "since. Run `make test` to check it again.\n"
        )
    if passed == examples and failed == 0:
        return f'!!! success "{passed}/{examples} examples verified"\n\n    Every example on this page passed in {ran}.\n'
    parts = [f"{failed} failed"] if failed else []
    if skipped:
        parts.append(f"{skipped} skipped")
    not_run = examples - passed - failed - skipped
    if not_run > 0:
        parts.append(f"{not_run} not run")
    return (
        f'!!! failure "{passed}/{examples} examples verified"\n\n'
        f"    In {ran}: {', '.join(parts) or 'not all examples passed'}.\n"
    )


def _status(entry: dict, markdown: str) -> dict:
    """The counts :func:`_note` reads, from a page's recorded blocks and its current examples."""
    blocks = (
        [b for b in entry.get("blocks", []) if isinstance(b, dict)]
        if isinstance(entry.get("blocks"), list)
        else []
    )
    outcomes = {b.get("code_sha256"): b.get("outcome") for b in blocks}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    hashes = _block_hashes(markdown)
    for outcome in (outcomes.get(code) for code in hashes):
        if outcome in counts:
            counts[outcome] += 1
    counts["failed"] += sum(
        1 for b in blocks if b.get("code_sha256") is None and b.get("outcome") == "failed"
    )
    return {**entry, **counts, "examples": len(hashes)}


def _insert_after_title(markdown: str, note: str) -> str:
    """Put ``note`` after the page's first level-1 heading (outside code), else first."""
    lines = markdown.split("\n")
    fence = None
    for index, line in enumerate(lines):
        match = _FENCE.match(line)
        if match and fence is None:
            fence = match.group(1)
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is None and line.startswith("# "):
            return "\n".join(lines[: index + 1] + ["", note] + lines[index + 1 :])
    return note + "\n" + markdown


# -- examples: the header badge and the printed output ------------------------------------

_ANY_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_HEADER = re.compile(r"^\s*#\s*migration-test:(?P<body>.*)$")
_TIMEOUT = re.compile(r"\s+timeout=[0-9.]+\s*$")
_PYTHON = frozenset({"py", "python", "python3"})


def code_sha256(code: str) -> str:
    """The block's lines, right-stripped, blank lines around it dropped, hashed.

    The same function is in ``tests/doc_outputs.py``, which records the outputs; a test
    checks that the two agree on every block of the site.
    """
    lines = [line.rstrip() for line in code.split("\n")]
    return hashlib.sha256("\n".join(lines).strip("\n").encode("utf-8")).hexdigest()


def _language(info: str) -> tuple[str, bool]:
    """(language, notest) of a fence's info string, plain or brace form."""
    info = info.strip()
    if info.startswith("{"):
        words = info.strip("{}").split()
        dotted = [w[1:].lower() for w in words if w.startswith(".")]
        return (dotted[0] if dotted else ""), "notest" in words
    return (info.split()[0].lower() if info else ""), False


def python_blocks(markdown: str) -> list[tuple[int, int, str]]:
    """``(opening line, closing line, indent)`` (0-based) of each runnable Python fence.

    Fences nested inside another fence (a page showing Markdown source) are not blocks.
    """
    found, lines = [], markdown.split("\n")
    index = 0
    while index < len(lines):
        match = _ANY_FENCE.match(lines[index])
        if match is None or (match["fence"][0] == "`" and "`" in match["info"]):
            index += 1
            continue
        fence, indent = match["fence"], match["indent"]
        close = index + 1
        while close < len(lines):
            stripped = lines[close].strip()
            if len(stripped) >= len(fence) and set(stripped) == {fence[0]}:
                break
            close += 1
        language, notest = _language(match["info"])
        if language in _PYTHON and not notest and close < len(lines):
            found.append((index, close, indent))
        index = close + 1
    return found


def _dedent(line: str, indent: str) -> str:
    return line[len(indent) :] if line.startswith(indent) else line.lstrip(" ")


def _badge(header: str, indent: str) -> list[str]:
    body = _HEADER.match(header)["body"]
    tool = re.search(r"(?:^|\s)tool=(\S+)", body)
    expected = body.split("expected=", 1)[1] if "expected=" in body else ""
    expected = _TIMEOUT.sub("", expected).strip()
    ticks = "`" * (max((len(run) for run in re.findall(r"`+", expected)), default=0) + 1)
    pad = " " if expected.startswith("`") or expected.endswith("`") else ""
    with_tool = (
        ""
        if not tool or tool[1] == "torchlens"
        else f' <span class="tl-tested__tool">with {tool[1]}</span>'
    )
    title = "The test suite runs this block and checks that RESULT equals this value"
    return [
        f'{indent}<span class="tl-tested__label" title="{title}">tested</span>{with_tool} '
        f"{ticks}{pad}RESULT == {expected}{pad}{ticks}",
        f"{indent}{{: .tl-tested }}",
        "",
    ]


def _output_block(stdout: str, indent: str, outcome: str) -> list[str]:
    text = stdout.rstrip("\n")
    fence = "`" * max(3, max((len(r) for r in re.findall(r"`{3,}", text)), default=0) + 1)
    classes = ".text .tl-output" + ("" if outcome == "passed" else " .tl-output--failed")
    return [
        "",
        f"{indent}{fence}{{{classes}}}",
        *(indent + line if line else "" for line in text.split("\n")),
        f"{indent}{fence}",
    ]


def _block_hashes(markdown: str) -> list[str]:
    """The :func:`code_sha256` of each runnable Python block of a page, in order."""
    lines = markdown.split("\n")
    return [
        code_sha256("\n".join(_dedent(line, indent) for line in lines[opening + 1 : closing]))
        for opening, closing, indent in python_blocks(markdown)
    ]


def render_examples(markdown: str, outputs: list[dict], show_headers: bool = False) -> str:
    """Replace each header by a badge and add each block's recorded output under it."""
    by_hash: dict[str, dict] = {}
    for entry in outputs:
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("stdout"), str)
            and entry.get("code_sha256")
        ):
            by_hash.setdefault(entry["code_sha256"], entry)
    lines = markdown.split("\n")
    out: list[str] = []
    done = 0
    for opening, closing, indent in python_blocks(markdown):
        out.extend(lines[done:opening])
        code = [_dedent(line, indent) for line in lines[opening + 1 : closing]]
        body = lines[opening + 1 : closing]
        first = next((i for i, line in enumerate(code) if line.strip()), None)
        if first is not None and not show_headers and _HEADER.match(code[first]):
            if out and out[-1].strip():
                out.append("")
            out.extend(_badge(code[first], indent))
            body = body[:first] + body[first + 1 :]
        out.append(lines[opening])
        out.extend(body)
        out.append(lines[closing])
        entry = by_hash.get(code_sha256("\n".join(code)))
        if entry is not None and entry["stdout"].strip():
            out.extend(_output_block(entry["stdout"], indent, str(entry.get("outcome", "passed"))))
        done = closing + 1
    out.extend(lines[done:])
    return "\n".join(out)


# -- names with a layer placeholder in prose --------------------------------------------------

#: A dotted name with a placeholder such as `{L}` or `{i}` ("blocks.{L}.hook_in"). Browsers may
#: break a line between "." and "{", so in prose such a name is set as code, which never breaks.
_PLACEHOLDER_NAME = re.compile(
    r"(?<![\w`{}.\[\]*/])([A-Za-z_][\w*]*(?:\[\{[A-Za-z]\}\]|\.\{[A-Za-z]\}|\.[\w*]+)*"
    r"(?:\.\{[A-Za-z]\}|\[\{[A-Za-z]\}\])[\w.*\[\]{}]*?)(?=[,;:)]?(?:\s|$)|\.(?:\s|$))"
)
_CODE_OR_TAG = re.compile(r"(`+)[^`]*?\1|<[^>]*>|\]\([^)]*\)")


def code_placeholder_names(markdown: str) -> str:
    """Set dotted names with a `{L}`-style placeholder as inline code, outside code and HTML."""
    lines = markdown.split("\n")
    fence = None
    for index, line in enumerate(lines):
        match = _ANY_FENCE.match(line)
        if fence is None and match and not (match["fence"][0] == "`" and "`" in match["info"]):
            fence = match["fence"]
            continue
        if fence is not None:
            stripped = line.strip()
            if len(stripped) >= len(fence) and set(stripped) == {fence[0]}:
                fence = None
            continue
        if "{" not in line or line.lstrip().startswith("<"):
            continue
        out, done = [], 0
        for code in _CODE_OR_TAG.finditer(line):
            out.append(_PLACEHOLDER_NAME.sub(r"`\1`", line[done : code.start()]))
            out.append(code.group(0))
            done = code.end()
        out.append(_PLACEHOLDER_NAME.sub(r"`\1`", line[done:]))
        lines[index] = "".join(out)
    return "\n".join(lines)


_outputs: dict = {}


def on_config(config):
    """Read the outputs file once per build (``mkdocs serve`` rebuilds call this again)."""
    global _outputs
    _outputs = _load_status(config)
    return config


def on_page_markdown(markdown, page, config, files):
    """Add the verification note, the header badges and the recorded outputs."""
    key = _page_key(page, config)
    entry = _outputs.get(key)
    if not isinstance(entry, dict):
        return code_placeholder_names(render_examples(markdown, [], key in HEADERS_SHOWN))
    blocks = entry.get("blocks", [])
    status = _status(entry, markdown)
    markdown = render_examples(
        markdown, blocks if isinstance(blocks, list) else [], key in HEADERS_SHOWN
    )
    markdown = code_placeholder_names(markdown)
    source = page.file.content_string
    note = _note(status, hashlib.sha256(source.encode("utf-8")).hexdigest())
    if note is None:
        return markdown
    return _insert_after_title(markdown, note)


_ARTICLE = re.compile(r"(<article\b[^>]*>)(.*?)(</article>)", re.S)
_VERBATIM_OR_TAG_OR_ENTITY = re.compile(
    r"<(pre|script|style)\b.*?</\1>|<[^>]*>|&[#\w]+;", re.S | re.I
)
#: A run of text long enough to need a place to wrap on a phone's column.
_LONG_WORD = re.compile(r"\S{12,}")
#: After these characters a long name may wrap, where more of the name follows.
_WRAP_AFTER = re.compile(r"([._/:])(?=[^\s])")


def wrappable_names(page_html: str) -> str:
    """``page_html`` with a ``<wbr>`` after each ``.``, ``_``, ``/`` and ``:`` inside a long word
    of its article's text (12 characters or more without a space, in prose, headings, tables or
    inline code); code blocks, tags, character references and everything outside the article are
    left as they are."""

    def text(segment: str) -> str:
        return _LONG_WORD.sub(lambda word: _WRAP_AFTER.sub(r"\1<wbr>", word.group(0)), segment)

    def article(match: re.Match) -> str:
        body, out, done = match.group(2), [], 0
        for markup in _VERBATIM_OR_TAG_OR_ENTITY.finditer(body):
            out.append(text(body[done : markup.start()]))
            out.append(markup.group(0))
            done = markup.end()
        out.append(text(body[done:]))
        return match.group(1) + "".join(out) + match.group(3)

    return _ARTICLE.sub(article, page_html, count=1)


def on_post_page(output, page, config):
    """Let long names wrap at their dots and underscores on a narrow screen."""
    return wrappable_names(output)


def on_post_build(config):
    """Write ``search/search_index.js`` (``var __index = <the index>``) beside the JSON index: a page
    opened from disk (file://) cannot fetch the JSON, so Material's search reads this script there
    (``docs/javascripts/file-protocol.js`` runs its worker)."""
    path = os.path.join(config.site_dir, "search", "search_index.json")
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as handle:
        index = handle.read()
    with open(
        os.path.join(config.site_dir, "search", "search_index.js"), "w", encoding="utf-8"
    ) as handle:
        handle.write(f"var __index = {index}\n")

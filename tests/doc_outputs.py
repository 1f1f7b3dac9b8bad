"""Record each documentation example's outcome and what it printed, for the site.

A pytest plugin next to ``docs_harness.py`` (loaded by ``-p doc_outputs`` in pyproject.toml). For
every docs block that ran, it keeps the outcome and the stdout pytest captured (cut to
:data:`OUTPUT_LIMIT`: an engine's log can run to thousands of lines), with a hash of the block's
code, and at the end of the session merges them, per page, into :data:`OUTPUTS_FILE`,
``tests/doc_outputs.json``, which is committed, so that every build of the site (a fresh clone's
``make docs`` too) shows the outputs and the "N/N examples verified" notes:

    {"pages": {"docs/page.md": {"sha256": ..., "timestamp": ..., "torchlens_version": ..., "blocks": [
        {"line": 42, "code_sha256": ..., "outcome": "passed", "stdout": "..."}]}}}

A page problem (a ``# migration-test:`` header that was not collected) is an entry with
``"code_sha256": null``. A block that ran replaces its old entry, except that a skip (its tool or
engine environment is missing here) keeps an entry recorded for the same code elsewhere; entries of
code no longer on the page are dropped. A page's timestamp changes only when its entry does, so a
run that changes nothing leaves the file as it was.

``scripts/mkdocs_hooks.py`` reads the file: each output goes under the block whose code has the same
hash (an edited block gets none until the next run), and the outcomes of the blocks still on the page
make its "N/N examples verified" note. ``tests/test_doc_outputs.py::test_the_recorded_outputs_are_current``
fails while a page's recording is stale (the page changed, a block has no passing record); it runs at the
end of a session and counts the blocks that session ran.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import pathlib
import sys

import pytest

OUTPUTS_FILE = pathlib.Path("tests") / "doc_outputs.json"
OUTPUT_LIMIT = 3000  #: characters of a block's output kept for the site (its start and its end)
_KEY = pytest.StashKey[dict]()


def code_sha256(code: str) -> str:
    """The hash the site compares: the block's lines, right-stripped, blank lines around it dropped.

    ``scripts/mkdocs_hooks.py`` has the same function; ``tests/test_doc_outputs.py`` checks
    that the two agree on every block of the site.
    """
    lines = [line.rstrip() for line in code.split("\n")]
    return hashlib.sha256("\n".join(lines).strip("\n").encode("utf-8")).hexdigest()


def cut(text: str, limit: int = OUTPUT_LIMIT) -> str:
    """Keep the start and the end of ``text`` within about ``limit`` characters.

    >>> cut("abcdefghij", 4)
    'ab\\n[... 6 characters cut ...]\\nij'
    """
    if len(text) <= limit:
        return text
    return f"{text[: limit // 2]}\n[... {len(text) - limit} characters cut ...]\n{text[len(text) - (limit - limit // 2) :]}"


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_KEY] = {}
    config.addinivalue_line(
        "markers",
        "after_docs: runs after every docs block of the session (it reads their recorded outcomes)",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Record a docs item's call phase, or its setup phase when that did not pass (a skip, say)."""
    report = yield
    from docs_harness import DocItem, PageProblem

    pages = item.config.stash.get(_KEY, None)
    if pages is None or not isinstance(item, (DocItem, PageProblem)):
        return report
    if call.when == "call" or (call.when == "setup" and not report.passed):
        stdout = "".join(
            text for name, text in report.sections if name == f"Captured stdout {call.when}"
        )
        pages.setdefault(item.parent.display, []).append(
            {
                "line": item.line,
                "code_sha256": code_sha256(item.body) if isinstance(item, DocItem) else None,
                "outcome": report.outcome,
                "stdout": cut(stdout),
            }
        )
    return report


def _torchlens_version() -> str:
    module = sys.modules.get("torchlens")
    if getattr(module, "__version__", None):
        return str(module.__version__)
    try:
        return importlib.metadata.version("torchlens")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def merged(config: pytest.Config) -> dict:
    """What the outputs file holds once this session's records are merged into it (nothing is written)."""
    from docs_harness import block_body, page_blocks

    pages = config.stash.get(_KEY, {})
    try:
        data = json.loads((config.rootpath / OUTPUTS_FILE).read_text(encoding="utf-8"))
        if not isinstance(data.get("pages"), dict):
            raise ValueError
    except (OSError, ValueError, AttributeError):
        data = {"pages": {}}
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for page, ran in pages.items():
        page_path = config.rootpath / page
        try:
            text = page_path.read_text(encoding="utf-8-sig")
        except OSError:
            continue
        current = {code_sha256(block_body(block)) for _, block in page_blocks(text, page_path)}
        before = data["pages"].get(page, {})
        old = {
            b.get("code_sha256"): b
            for b in before.get("blocks", [])
            if b.get("code_sha256") in current
        }
        new = {}
        for block in (b for b in ran if b["code_sha256"] is not None):
            kept = old.get(block["code_sha256"])
            # a skip says nothing about the code: keep what a run with its tool recorded
            new[block["code_sha256"]] = (
                {**kept, "line": block["line"]}
                if block["outcome"] == "skipped" and kept is not None
                else block
            )
        problems = [
            b for b in ran if b["code_sha256"] is None
        ]  # page problems: this run's own only
        blocks = [b for code, b in old.items() if code not in new] + list(new.values()) + problems
        entry = {
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "torchlens_version": _torchlens_version(),
            "blocks": sorted(blocks, key=lambda b: (b["line"], b["code_sha256"] or "")),
        }
        same = {k: v for k, v in before.items() if k != "timestamp"} == entry
        data["pages"][page] = {**entry, "timestamp": before.get("timestamp", now) if same else now}
    return data


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Merge this run into the file (see :func:`merged`)."""
    config = session.config
    if hasattr(config, "workerinput") or not config.stash.get(_KEY, {}):
        return
    data = merged(config)
    path = config.rootpath / OUTPUTS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list
) -> None:
    """Run the tests marked ``after_docs`` last, after the docs blocks they read the outcomes of."""
    items.sort(key=lambda item: item.get_closest_marker("after_docs") is not None)

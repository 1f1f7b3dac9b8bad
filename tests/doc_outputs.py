"""Record what each documentation example printed, so the site can show it under the block.

A pytest plugin next to ``docs_harness.py``. For every docs block that ran and printed
something on stdout, it keeps the text the harness captured (cut to the harness's output
limit) together with a hash of the block's code, and at the end of the session merges
them, per page, into ``build/doc-outputs.json``:

    {"pages": {"docs/page.md": {"sha256": ..., "timestamp": ..., "blocks": [
        {"line": 42, "code_sha256": ..., "outcome": "passed", "stdout": "..."}]}}}

``scripts/mkdocs_hooks.py`` reads that file and puts each output under the block whose
code has the same hash; a block edited since the run gets no output until the next run.

It is loaded by ``pytest_plugins`` in ``tests/test_doc_outputs.py``, so it is active
whenever ``tests/`` is collected (``make test``, CI). A run of one page alone
(``pytest docs/page.md``) leaves the file as it was.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pathlib

import pytest

OUTPUTS_FILE = pathlib.Path("build") / "doc-outputs.json"
_KEY = pytest.StashKey[dict]()


def code_sha256(code: str) -> str:
    """The hash the site compares: the block's lines, right-stripped, blank lines around it dropped.

    ``scripts/mkdocs_hooks.py`` has the same function; ``tests/test_doc_outputs.py`` checks
    that the two agree on every block of the site.
    """
    lines = [line.rstrip() for line in code.split("\n")]
    return hashlib.sha256("\n".join(lines).strip("\n").encode("utf-8")).hexdigest()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_KEY] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    block = getattr(item, "block", None)
    pages = item.config.stash.get(_KEY, None)
    if call.when != "call" or block is None or pages is None or not hasattr(item.parent, "display"):
        return report
    from docs_harness import block_body

    stdout = "".join(text for name, text in report.sections if name == "Captured stdout call")
    pages.setdefault(item.parent.display, []).append(
        {
            "line": block.fence_line,
            "code_sha256": code_sha256(block_body(block.definition)),
            "outcome": report.outcome,
            "stdout": stdout,
        }
    )
    return report


def _current_hashes(text: str, path: pathlib.Path, display: str) -> set[str]:
    from docs_harness import block_body, extract_blocks
    from pytest_markdown_docs.plugin import FenceSyntax

    blocks = extract_blocks(text, path, display, FenceSyntax.superfences)
    return {code_sha256(block_body(b.definition)) for b in blocks}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Merge this run's outputs into the file: a block that ran replaces its old entry, and
    entries of code no longer on the page are dropped."""
    config = session.config
    if hasattr(config, "workerinput"):
        return
    pages = config.stash.get(_KEY, {})
    if not pages:
        return
    path = config.rootpath / OUTPUTS_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
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
        current = _current_hashes(text, page_path, page)
        ran_hashes = {b["code_sha256"] for b in ran}
        old = data["pages"].get(page, {}).get("blocks", [])
        kept = [b for b in old if b.get("code_sha256") in current and b.get("code_sha256") not in ran_hashes]
        blocks = kept + [b for b in ran if b["stdout"].strip()]
        data["pages"][page] = {
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "timestamp": now,
            "blocks": sorted(blocks, key=lambda b: b["line"]),
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(temporary, path)

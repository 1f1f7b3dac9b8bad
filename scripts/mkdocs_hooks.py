"""MkDocs hooks for the TorchLens site (registered under ``hooks:`` in mkdocs.yml).

``on_page_markdown`` puts a note under the title of every page whose Python examples
were run by the last ``pytest`` run, read from ``build/doc-examples.json`` (written by
``tests/docs_harness.py``):

* "N/N examples verified" when every example passed,
* a failure note when some failed, were skipped or did not run,
* "stale: page changed since the last test run" when the page's SHA-256 no longer
  matches the one recorded.

The file may be missing (a fresh clone, ``mkdocs serve`` before any test run) or
unreadable; then pages are left as they are.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re

log = logging.getLogger("mkdocs.hooks.torchlens")

STATUS_FILE = os.path.join("build", "doc-examples.json")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def _load_status(config) -> dict:
    """Return the ``pages`` table of the status file, or an empty one."""
    root = os.path.dirname(os.path.abspath(config.config_file_path))
    path = os.path.join(root, STATUS_FILE)
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
        passed, failed, skipped = (int(entry.get(key, 0)) for key in ("passed", "failed", "skipped"))
    except (KeyError, TypeError, ValueError):
        return None
    if examples <= 0:
        return None
    when = entry.get("timestamp", "an unknown time")
    version = entry.get("torchlens_version", "unknown")
    ran = f"the last test run ({when}, torchlens {version})"
    if entry.get("sha256") != current_sha:
        return (
            '!!! warning "stale: page changed since the last test run"\n\n'
            f"    {passed}/{examples} examples passed in {ran}, but the page has been edited "
            "since. Run `make test` to check it again.\n"
        )
    if passed == examples and failed == 0:
        return f'!!! success "{passed}/{examples} examples verified"\n\n    Every example on this page ran in {ran}.\n'
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


_status: dict = {}


def on_config(config):
    """Read the status file once per build (``mkdocs serve`` rebuilds call this again)."""
    global _status
    _status = _load_status(config)
    return config


def on_page_markdown(markdown, page, config, files):
    """Add the verification note to pages that have examples."""
    entry = _status.get(_page_key(page, config))
    if not isinstance(entry, dict):
        return markdown
    source = page.file.content_string
    note = _note(entry, hashlib.sha256(source.encode("utf-8")).hexdigest())
    if note is None:
        return markdown
    return _insert_after_title(markdown, note)

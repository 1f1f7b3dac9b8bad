"""Write generated files, or (with --check) report the committed ones that are stale."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def write_or_check(outputs: dict[Path, str], check: bool, root: Path, rerun: str) -> int:
    """Write each `path: text`, or with `check` only list the paths whose committed text differs.

    Returns the exit status: 1 when `check` found a stale file, else 0.
    """
    stale = []
    for path, new in outputs.items():
        if check:
            if not path.exists() or path.read_text(encoding="utf-8") != new:
                stale.append(str(path.relative_to(root)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(new, encoding="utf-8")
    if stale:
        print(f"stale generated files (run {rerun}):", *stale, sep="\n  ")
        return 1
    return 0


def splice(page: Path, text: str, begin: str, end: str, section: str) -> str:
    """`text` (the page at `page`) with the part from the line `begin` to the line `end` replaced
    by `section` (which starts with `begin` and ends with `end`); the rest is written by hand.

    Raises:
        SystemExit: the page lacks one of the markers.
    """
    if begin not in text or end not in text:
        raise SystemExit(f"{page}: missing the generated-section markers")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return head + section + tail


def main(
    doc: str, outputs: Callable[[], dict[Path, str]], root: Path, rerun: str, argv: list[str] | None
) -> int:
    """A generator's command line: `--check` reports the stale files among `outputs()`, else they
    are written. `doc` is the script's docstring (its first line is the help's description)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="report stale files instead of writing them"
    )
    args = parser.parse_args(argv)
    return write_or_check(outputs(), args.check, root, rerun)

"""Run documentation blocks inside an engine environment, for tests/docs_harness.py.

The docs harness starts this file with the interpreter of an engine's own virtual
environment (``.venv-engines/<name>/bin/python``, built from ``envs/<name>.txt``) when a
block's header names that engine. It uses the standard library only, since the engine
environments hold no pytest.

It runs in the repository root and puts ``src/`` first on its path, so the engine runs the
working tree's TorchLens.

Protocol: one JSON request per line on stdin, one JSON reply per line on stdout; whatever
else the process writes to file descriptor 1 (an engine's C code, say) goes to its stderr,
which is the harness's (so pytest's capture holds it). A request is ``{"source": ...,
"filename": ..., "timeout": ...}``, where ``source`` is the block's code padded with blank
lines so that its line numbers are the page's. Requests run one after another in one namespace, so a
``continuation`` block sees the names of the block before it. The reply is

* ``{"ok": true, "result": REPR | null, "has_result": ..., "stdout": ..., "stderr": ...}``,
  with ``REPR`` the ``repr`` of ``RESULT`` when the block bound it to a value that reads
  back through :func:`ast.literal_eval` as an equal value, or
* ``{"ok": false, "summary": ..., "stdout": ..., "stderr": ...}``, with ``summary`` the whole
  report: the error (and the page line that raised it), then the traceback from the block's
  first frame on, whose frames show the page's lines.

If a block runs past its timeout, :mod:`faulthandler` writes every thread's stack to
stderr (frames of the block show as ``File ".../docs/page.md", line N``); the harness stops
waiting a little later and ends this process.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import faulthandler
import inspect
import io
import json
import linecache
import os
import sys
import traceback
import types


def _literal(value):
    """Return ``repr(value)`` if it reads back as an equal value of the same type, else None."""
    source = repr(value)
    try:
        again = ast.literal_eval(source)
        same = type(again) is type(value) and bool(again == value)
    except Exception:
        return None
    return source if same else None


def _run(request: dict, namespace: dict) -> dict:
    source, filename = request["source"], request["filename"]
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    namespace.pop("RESULT", None)
    stdout, stderr = io.StringIO(), io.StringIO()
    faulthandler.dump_traceback_later(float(request["timeout"]), exit=False, file=sys.__stderr__)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = compile(
                source, filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True
            )
            if code.co_flags & inspect.CO_COROUTINE:
                asyncio.run(eval(code, namespace))
            else:
                exec(code, namespace)
    except BaseException as error:
        faulthandler.cancel_dump_traceback_later()
        frames = traceback.extract_tb(error.__traceback__)[1:]  # drop this function's frame
        in_page = [i for i, frame in enumerate(frames) if frame.filename == filename]
        exception = "".join(traceback.format_exception_only(type(error), error)).strip()
        at = f" (raised at line {frames[in_page[-1]].lineno})" if in_page else ""
        summary = (
            f"{exception.splitlines()[-1]}{at}\nTraceback (most recent call last):\n"
            + "".join(traceback.format_list(frames[in_page[0] if in_page else 0 :]))
            + exception
        )
        return {
            "ok": False,
            "summary": summary,
            "stdout": stdout.getvalue(),
            "stderr": stderr.getvalue(),
        }
    faulthandler.cancel_dump_traceback_later()
    reply = {
        "ok": True,
        "result": None,
        "has_result": "RESULT" in namespace,
        "stdout": stdout.getvalue(),
        "stderr": stderr.getvalue(),
    }
    if "RESULT" in namespace:
        literal = _literal(namespace["RESULT"])
        if literal is None:
            text = repr(namespace["RESULT"])
            return {
                **reply,
                "ok": False,
                "summary": f"RESULT is a {type(namespace['RESULT']).__name__} whose repr does not read back "
                f"through ast.literal_eval as an equal value: {text[:300]}",
            }
        reply["result"] = literal
    return reply


def main() -> int:
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")  # the replies
    os.dup2(2, 1)  # everything else the process writes to fd 1 joins its stderr
    sys.path.insert(
        0, os.path.join(os.getcwd(), "src")
    )  # the harness starts it in the repository root
    namespace = types.ModuleType("docs_example").__dict__
    for line in sys.stdin:
        if not line.strip():
            continue
        reply = _run(json.loads(line), namespace)
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

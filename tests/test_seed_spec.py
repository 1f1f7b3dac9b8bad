"""The user's spec, `cross-engine-checks.md`, run verbatim: each of its `# migration-test:` blocks,
as written there (its configs keep transformers' default token ids, which the docs harness would
flag), run as a script of its own, gives the `RESULT` its header expects.

`tests/fixtures/cross-engine-checks.md.txt` is a byte-for-byte copy of the spec; where the spec itself
is at hand (`../shared/seed/` beside the checkout), the copy is checked against it.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
SPEC = HERE / "fixtures" / "cross-engine-checks.md.txt"  # not .md: no docs page of its own
ORIGINAL = HERE.parent.parent / "shared" / "seed" / "cross-engine-checks.md"
BLOCK = re.compile(r"```python\n(# migration-test: tool=(\S+) expected=(.*?)\n.*?)```", re.S)
BLOCKS = BLOCK.findall(SPEC.read_text())


def test_the_copy_is_the_spec():
    assert len(BLOCKS) == 3
    if not ORIGINAL.exists():
        pytest.skip(f"{ORIGINAL} is not beside this checkout")
    assert SPEC.read_bytes() == ORIGINAL.read_bytes()


@pytest.mark.parametrize("i", range(len(BLOCKS)), ids=[f"block{i + 1}" for i in range(len(BLOCKS))])
def test_each_block_gives_its_expected_result_verbatim(i, tmp_path):
    code, tool, expected = BLOCKS[i]
    # a file of its own: nnsight reads a `with` block's source back from it
    script = tmp_path / f"block{i + 1}.py"
    script.write_text(code + "\nprint('RESULT=' + repr(RESULT))\n")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT="))
    assert ast.literal_eval(line[len("RESULT=") :]) == ast.literal_eval(expected.strip()), tool

"""One install path, printed the same everywhere, that works as printed.

TorchLens is not on PyPI, and the PyPI project named `torchlens` is an unrelated library, so no page
(the site, the README, docstrings, scripts) may tell a reader to install TorchLens by its bare name
(`pip install torchlens`, `pip install -U "torchlens>=0.1"`). The pages install it from the source
tree, one of two ways: `pip install -e .`, or `make wheel` then `pip install dist/torchlens-*.whl`.
The last test runs `make wheel` and installs the wheel it wrote, exactly as Getting started prints it.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from docs_harness import ci_is_on

REPO = pathlib.Path(__file__).resolve().parents[1]
#: The install commands a page may print for TorchLens itself. The first adds the `examples` extra
#: (pyproject.toml): `transformers`, which the pages' examples import.
THE_PATH = ('pip install -e ".[examples]"', "pip install -e .", "pip install dist/torchlens-*.whl")
_PIP_INSTALL = re.compile(r"\bpip3?\s+install\b([^\n`]*)")
_BARE = re.compile(r"""^["']?torchlens(\[[^\]]*\])?(\s*[=<>!~].*)?["']?$""", re.I)


def bare_installs(text: str) -> list[str]:
    """The `pip install` commands in `text` that name `torchlens` as a requirement an index resolves."""
    found = []
    for match in _PIP_INSTALL.finditer(text):
        rest = match[1].split("#")[0]
        try:
            words = shlex.split(rest)
        except ValueError:
            words = rest.split()
        if any(_BARE.match(word) for word in words if not word.startswith("-")):
            found.append(match[0].strip())
    return found


def _texts():
    for path in sorted(
        [
            *REPO.glob("docs/**/*.md"),
            REPO / "README.md",
            *REPO.glob("src/**/*.py"),
            *REPO.glob("scripts/**/*.py"),
            REPO / "Makefile",
            *REPO.glob("envs/*"),
        ]
    ):
        if path.is_file():
            yield path.relative_to(REPO).as_posix(), path.read_text(encoding="utf-8")


def test_the_check_finds_a_bare_install_and_passes_the_path():
    assert bare_installs("run `pip install torchlens` first") == ["pip install torchlens"]
    assert bare_installs('pip install -U "torchlens>=0.1"\npip3 install torchlens[docs]') == [
        'pip install -U "torchlens>=0.1"',
        "pip3 install torchlens[docs]",
    ]
    assert (
        bare_installs(
            "pip install -e .\npip install dist/torchlens-*.whl\npip uninstall torchlens\n"
            "pip install torchlens-tools  # another name"
        )
        == []
    )


def test_no_page_tells_a_reader_to_pip_install_torchlens_by_its_bare_name():
    found = {path: hits for path, text in _texts() if (hits := bare_installs(text))}
    assert not found, (
        f"these install the unrelated PyPI project; print {' or '.join(THE_PATH)}: {found}"
    )


def test_every_page_installs_torchlens_the_one_way():
    """In the site's and the README's shell blocks, a command that installs TorchLens is one of THE_PATH,
    and no page leaves a placeholder for a repository address a reader does not have."""
    odd = {}
    for path, text in _texts():
        if not path.endswith(".md"):
            continue
        for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, re.S):
            for line in block.splitlines():
                command = line.split("#")[0].strip()
                if (
                    re.search(r"\bpip3? install\b", command)
                    and (
                        "torchlens" in command
                        or re.search(
                            r"""(^|\s)(-e|--editable)?\s*["']?\.(/\S*)?(\[[^\]]*\])?["']?$""",
                            command,
                        )
                    )
                    and command not in THE_PATH
                ):
                    odd.setdefault(path, []).append(command)
        if "<repository URL>" in text or "git+<" in text:
            odd.setdefault(path, []).append("a <repository URL> placeholder")
    assert not odd, odd
    getting_started = (REPO / "docs" / "getting-started.md").read_text(encoding="utf-8")
    assert THE_PATH[0] in getting_started and THE_PATH[2] in getting_started
    assert "make wheel" in getting_started


def test_the_documented_install_gives_what_the_examples_import():
    """Getting started installs the `examples` extra, and that extra holds every module outside the
    standard library and TorchLens that the site's Python blocks import (torch comes first, on its own
    line; numpy comes with transformers)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and newer
    extras = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    examples = {re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0].lower() for req in extras["examples"]}
    getting_started = (REPO / "docs" / "getting-started.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", getting_started, re.S)
    blocks += re.findall(
        r"```python\n(.*?)```", (REPO / "docs" / "index.md").read_text("utf-8"), re.S
    )
    imported = {
        name.split(".")[0]
        for block in blocks
        for name in re.findall(r"^\s*(?:import|from)\s+([\w.]+)", block, re.M)
    }
    third_party = imported - set(sys.stdlib_module_names) - {"torchlens", "torch", "numpy"}
    assert third_party and third_party <= examples, (third_party, examples)
    assert 'pip install -e ".[examples]"' in getting_started


def test_make_wheel_then_pip_install_dist_wheel_works_as_printed(tmp_path):
    """`make wheel` writes one wheel into dist/, and `pip install dist/torchlens-*.whl` installs a TorchLens
    that imports and traces (installed here without dependencies into a folder of its own, torch coming
    from this environment)."""
    done = subprocess.run(
        ["make", "--no-print-directory", "wheel", f"PYTHON={sys.executable}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if (
        done.returncode != 0
        and not ci_is_on()
        and re.search(r"(?i)connection|network|resolve|index", done.stdout + done.stderr)
    ):
        pytest.skip(f"make wheel needs PyPI (hatchling): {done.stderr.strip().splitlines()[-1:]}")
    assert done.returncode == 0, done.stdout + done.stderr
    wheels = sorted((REPO / "dist").glob("torchlens-*.whl"))
    assert len(wheels) == 1, (
        wheels
    )  # what the glob of `pip install dist/torchlens-*.whl` must match
    target = tmp_path / "site-packages"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            str(wheels[0]),
        ],
        check=True,
        timeout=300,
    )
    code = (
        "import torchlens as tl, torchlens.mechinterp as mi; from torchlens import testing;"
        f"assert tl.__file__.startswith({str(target)!r}), tl.__file__;"
        "t = tl.trace(testing.build('gpt2'), testing.token_ids(length=3));"
        "print(mi.translate('blocks.1.hook_resid_post', from_generation='2.x', to_generation='nnterp').names)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "('layers_output[1]',)"

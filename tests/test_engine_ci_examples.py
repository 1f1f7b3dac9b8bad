"""The engine-CI example files (docs/examples/engine-ci/) run here as an engine's CI would run them.

The examples are real pytest files: the suite also collects them where they are (the vLLM one is
skipped in the main environment, which has no vLLM). These tests run each one in the environment
it is for, as it is and with one hook made wrong, and check that the wrong hook fails with the
diagnosis in pytest's output; that the committed references are what `make_references.py` writes;
and that the CI workflow runs those files with the one install path of the site.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest
import torch
from docs_harness import ci_is_on, engine_python

import torchlens as tl

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "docs" / "examples" / "engine-ci"
HOOKS = "test_engine_hooks_match_torchlens.py"
VLLM = "test_vllm_hooks_match_torchlens.py"


def _copy(
    destination: pathlib.Path, file: str, wrong: tuple[str, str] | None = None
) -> pathlib.Path:
    """The example folder copied to `destination`, with one line of `file` replaced (a wrong hook)."""
    shutil.copytree(EXAMPLES, destination, dirs_exist_ok=True)
    if wrong is not None:
        path = destination / file
        text = path.read_text(encoding="utf-8")
        assert wrong[0] in text, wrong[0]
        path.write_text(text.replace(wrong[0], wrong[1]), encoding="utf-8")
    return destination


def test_the_hooks_example_passes_and_a_wrong_hook_fails_with_the_diagnosis(pytester):
    env = {"PYTHONPATH": str(REPO / "src"), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    for key, value in env.items():
        pytester._monkeypatch.setenv(key, value)
    _copy(pytester.path, HOOKS)
    pytester.runpytest_subprocess("-p", "no:cacheprovider", HOOKS).assert_outcomes(passed=2)
    # the classic bug: the layer's output read where the MLP's is, without the residual
    _copy(
        pytester.path,
        HOOKS,
        (
            '"layers_output[{L}]": ("model.layers.{L}", "output"),',
            '"layers_output[{L}]": ("model.layers.{L}.mlp", "output"),',
        ),
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", HOOKS)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*the engine's hooks disagree with the TorchLens reference:*",
            "*layers_output[[]0[]]*NO*=> equals mlps_output[[]0[]]: the residual is missing*",
            "*(12 compared: 10 agree, 2 do not)*",
        ]
    )


def _lent_pytest(directory: pathlib.Path) -> pathlib.Path:
    """The engine environments have no pytest of their own: this one's (pure Python) is lent to them."""
    import _pytest
    import iniconfig
    import pluggy
    import py

    directory.mkdir(exist_ok=True)
    for module in (pytest, _pytest, pluggy, iniconfig, py):
        source = pathlib.Path(module.__file__)
        source = source.parent if source.name == "__init__.py" else source
        (directory / source.name).symlink_to(source, target_is_directory=source.is_dir())
    return directory


def _run_vllm(folder: pathlib.Path, lent: pathlib.Path) -> subprocess.CompletedProcess:
    python = engine_python(REPO, "vllm")
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{lent}",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    return subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", VLLM],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_the_vllm_example_passes_in_vllm_and_a_wrong_hook_fails_with_the_diagnosis(tmp_path):
    if not engine_python(REPO, "vllm").exists():
        if ci_is_on():
            pytest.fail("CI=true: the vllm engine environment must be built (make engines)")
        pytest.skip("the vllm engine environment is not built (make engines)")
    lent = _lent_pytest(tmp_path / "lent")
    good = _run_vllm(_copy(tmp_path / "good", VLLM), lent)
    assert good.returncode == 0 and "1 passed" in good.stdout, (
        good.stdout[-3000:] + good.stderr[-3000:]
    )
    # the residual stream read as the layer's first output element alone
    bad = _run_vllm(
        _copy(
            tmp_path / "bad",
            VLLM,
            (
                'keep(f"blocks.{i}.hook_resid_post", mlp_out + resid_mid)',
                'keep(f"blocks.{i}.hook_resid_post", mlp_out)',
            ),
        ),
        lent,
    )
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-3000:]
    assert "vLLM's hooks disagree with the TorchLens reference:" in bad.stdout
    assert "blocks.0.hook_resid_post" in bad.stdout and ": the residual is missing" in bad.stdout, (
        bad.stdout[-3000:]
    )


def test_the_committed_references_are_what_make_references_writes(tmp_path):
    """Same model, same ops and shapes, same values to float32 rounding (a fresh run on another CPU may differ
    in the last bits; the examples compare with atol=1e-5)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_references", EXAMPLES / "make_references.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make(tmp_path)
    for name in module.MODELS:
        committed, fresh = tl.load(EXAMPLES / "references" / name), tl.load(tmp_path / name)
        assert [(op.name, op.module, op.shape) for op in committed.ops] == [
            (op.name, op.module, op.shape) for op in fresh.ops
        ], name
        for address in fresh.modules:
            for facet, site in fresh.modules[address].facets.sites.items():
                old = committed.modules[address].facets.sites[facet]
                if site.saved and site.tensor is not None and site.tensor.is_floating_point():
                    assert torch.allclose(old.tensor, site.tensor, atol=1e-6, rtol=1e-5), (
                        name,
                        address,
                        facet,
                    )


def test_the_ci_workflow_runs_the_examples_with_the_one_install_path():
    text = (EXAMPLES / "torchlens-check.yml").read_text(encoding="utf-8")
    runs = [
        line.split("- run:", 1)[1].split("#")[0].strip()
        for line in text.splitlines()
        if "- run:" in line
    ]
    assert "pip install torch==2.13.0" in runs
    assert any(run.startswith("pip install dist/torchlens-*.whl") for run in runs), runs
    assert runs[-1] == "python -m pytest -q tests/torchlens"

"""The Performance page and its charts must be what `scripts/gen_perf_page.py` renders from the
committed benchmark data (`docs/assets/performance-run.json`).

The first test runs `--check` on the working tree; the others change the data in memory and make
sure the rendering follows (so the check can fail), and that every number in the side-by-side
table is the run's.
"""

from __future__ import annotations

import copy
import json
import pathlib
import xml.dom.minidom

import pytest
import script_modules
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gen_perf_page.py"


@pytest.fixture(scope="module")
def gen():
    return script_modules.load("gen_perf_page")


@pytest.fixture(scope="module")
def data(gen):
    run = json.loads(gen.RUN.read_text())
    for key in (
        "table",
        "token_sweep",
        "layer_sweep",
    ):  # a run cut short lists models it never measured
        run[key] = [n for n in run[key] if n in run["models"]]
    profile = json.loads(gen.PROFILE.read_text()) if gen.PROFILE.exists() else None
    return run, profile


def test_committed_page_and_charts_are_current(gen):
    assert gen.main(["--check"]) == 0


def test_a_changed_measurement_makes_the_page_stale(gen, data):
    run, profile = data
    changed = copy.deepcopy(run)
    name = run["table"][-1]
    changed["models"][name]["modes"]["all"]["ratio"] += 0.5
    new = gen.outputs(changed, profile)
    stale = [p for p, text in new.items() if p.read_text(encoding="utf-8") != text]
    assert gen.PAGE in stale and gen.ASSETS / "performance.svg" in stale


def test_every_table_number_is_the_runs_and_every_chart_is_well_formed(gen, data):
    run, profile = data
    out = gen.outputs(run, profile)
    page = out[gen.PAGE]
    for name in run["table"]:
        for mode, r in gen._pypi_checked(run["models"][name])["modes"].items():
            if "ratio" in r:
                assert f"{r['ratio']:.2f}x" in page, (name, mode)
    for path, text in out.items():
        if path.suffix == ".svg":
            xml.dom.minidom.parseString(text)
            assert f"assets/{path.name}" in page, path.name
    # the run covers what the page promises: every mode side by side, and both sweeps
    table_modes = set().union(*(run["models"][n]["modes"] for n in run["table"]))
    assert {
        "plain",
        "all",
        "none",
        "resid_post",
        "tl_cache",
        "nnsight",
        "hooks",
        "pypi",
    } <= table_modes
    assert len(run["token_sweep"]) >= 4 and len(run["layer_sweep"]) >= 3


def test_a_hand_written_section_after_the_marker_is_kept(gen, data, tmp_path, monkeypatch):
    run, profile = data
    page = tmp_path / "performance.md"
    section = f"{gen.APPENDED}\n## Diagnosis\n\nwritten by hand\n"
    generated = (
        gen.PAGE.read_text(encoding="utf-8").split(gen.APPENDED)[0].rstrip("\n") + "\n"
    )  # without the hand part
    page.write_text(generated + "\n" + section, encoding="utf-8")
    monkeypatch.setattr(gen, "PAGE", page)
    out = gen.outputs(run, profile)[page]
    assert out.endswith(section) and out.count(gen.APPENDED) == 1
    assert gen.write_or_check({page: out}, True, tmp_path, "") == 0


_RENDER_IN_A_FRESH_PROCESS = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("gen_perf_page", sys.argv[1])
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)
run, profile = json.load(open(sys.argv[2]))
out = {p.name: text for p, text in gen.outputs(run, profile).items()}
json.dump({"order": list({"GPT-2", "Llama", "eager", "sdpa"}), "outputs": out}, sys.stdout)
"""


def render_in_fresh_processes(
    data, tmp_path: pathlib.Path, seeds=("0", "1"), script: pathlib.Path = SCRIPT
) -> list[dict]:
    """The page and charts rendered from `data` once per seed, each in a fresh interpreter started
    with that `PYTHONHASHSEED` (in parallel): {"order": how a small set iterated, "outputs": {file name: text}}."""
    path = tmp_path / "data.json"
    path.write_text(json.dumps(list(data)))
    return script_modules.json_per_hash_seed(
        _RENDER_IN_A_FRESH_PROCESS, [str(script), str(path)], seeds
    )


def test_render_is_deterministic_across_processes(gen, data, tmp_path):
    """Two fresh interpreters with different hash seeds (which iterate a set of strings in
    different orders, checked) render the page and every chart byte for byte the same, and the
    same as this process."""
    first, second = render_in_fresh_processes(data, tmp_path)
    assert first["order"] != second["order"], (
        "the two seeds must iterate a small set of strings differently"
    )
    differ = sorted(n for n in first["outputs"] if first["outputs"][n] != second["outputs"].get(n))
    assert not differ and first["outputs"].keys() == second["outputs"].keys(), (
        f"rendered differently: {differ}"
    )
    assert first["outputs"] == {p.name: text for p, text in gen.outputs(*data).items()}


def test_a_pypi_row_that_measured_another_torchlens_is_shown_as_failed(gen, data):
    """The PyPI mode's child must import PyPI torchlens 2.36.1; a row recording another version
    (this project's, through an inherited PYTHONPATH) is not shown as PyPI's figure."""
    run, profile = data
    changed = copy.deepcopy(run)
    name = run["table"][0]
    changed["models"][name]["modes"]["pypi"] = {
        "median_s": 0.123456,
        "ratio": 9.87,
        "samples": [0.123456],
        "own_plain_s": 0.0125,
        "version": "0.1.0",
    }
    page = gen.outputs(changed, profile)[gen.PAGE]
    assert "9.87x" not in page
    assert "measured torchlens '0.1.0', not the PyPI package 2.36.1" in page
    changed["models"][name]["modes"]["pypi"]["version"] = "2.36.1"
    assert "9.87x" in gen.outputs(changed, profile)[gen.PAGE]


def test_a_run_with_both_grad_modes_gets_their_tables_and_issue_28s_targets(gen, data):
    """A run that measured each mode with autograd on too (`bench.py --grad both`) renders, per
    thread count, both grad modes side by side, the booted TransformerLens setup, the no_grad
    advice and the targets table from those rows; changing one autograd figure changes the page."""
    run, profile = data
    plain_run = copy.deepcopy(run)  # the run with its autograd rows taken out: no such section
    plain_run.pop("by_threads", None)
    for m in plain_run["models"].values():
        m["modes"] = {k: v for k, v in m["modes"].items() if not k.endswith("+grad")}
    assert "## Autograd on" not in gen.outputs(plain_run, profile)[gen.PAGE]
    graded = copy.deepcopy(plain_run)
    name = next(
        n for n in graded["table"] if "tl_cache" in graded["models"][n]["modes"] and n != "tiny"
    )
    modes = graded["models"][name]["modes"]
    for mode in ("plain", "all", "none", "resid_post", "tl_cache", "hooks"):
        modes[mode + "+grad"] = dict(
            modes[mode],
            ratio=modes[mode]["ratio"] * 1.25,
            grad=True,
            grad_over_no_grad=1.0 + len(mode) / 100,
        )
    graded["by_threads"] = {"1": graded["models"]}
    page = gen.outputs(graded, profile)[gen.PAGE]
    assert "## Autograd on, thread counts and the TransformerLens setups" in page
    assert (
        "### When to wrap a trace in `torch.no_grad()`" in page and "### Issue 28's targets" in page
    )
    all_grad = modes["all+grad"]
    assert f"{all_grad['ratio']:.2f}x" in page and f"{all_grad['grad_over_no_grad']:.2f}x" in page
    tl_grad = modes["tl_cache+grad"]
    r, t = all_grad.get("cpu_ratio", all_grad["ratio"]), tl_grad.get("cpu_ratio", tl_grad["ratio"])
    line = next(
        ln
        for ln in page.splitlines()
        if ln.startswith("| `save='all'` at or below `run_with_cache`")
        and "autograd on" in ln
        and gen._title(name, graded["models"][name]["spec"]) in ln
    )
    assert line.endswith("| met |" if r <= t else "| **not met** |")
    modes["all+grad"]["grad_over_no_grad"] += 0.5
    assert gen.outputs(graded, profile)[gen.PAGE] != page


def test_a_second_thread_pass_cut_short_names_what_it_has_not_measured(gen, data):
    """A run of two thread counts whose second pass was stopped part way (`bench.py --resume` goes
    on with it later) says which models that pass has and has not measured, instead of claiming a
    whole pass at each count; a finished pass says nothing of the kind."""
    run, profile = data
    cut = copy.deepcopy(run)
    cut["threads"] = [1, 2]
    first = cut["table"][0]
    cut["by_threads"] = {"1": cut["models"], "2": {first: copy.deepcopy(cut["models"][first])}}
    line = next(
        ln for ln in gen.outputs(cut, profile)[gen.PAGE].splitlines() if "Run started" in ln
    )
    planned = [n for k in ("table", "token_sweep", "layer_sweep") for n in cut[k]]
    rest = [n for n in dict.fromkeys(planned) if n != first]
    assert f"the 2-thread pass has not measured {', '.join(rest)} yet" in line
    assert f"its sections below show only {first}" in line
    cut["by_threads"]["2"] = {}  # stopped before its first model
    line = next(
        ln for ln in gen.outputs(cut, profile)[gen.PAGE].splitlines() if "Run started" in ln
    )
    assert "its sections below are not there yet" in line
    cut["by_threads"]["2"] = copy.deepcopy(cut["models"])  # finished
    line = next(
        ln for ln in gen.outputs(cut, profile)[gen.PAGE].splitlines() if "Run started" in ln
    )
    assert "has not measured" not in line and "a whole pass over the models each" in line


def test_a_model_left_out_with_a_reason_is_not_measured_and_the_page_says_why(
    bench, gen, data, tmp_path, monkeypatch, request
):
    """`--not-measured MODEL REASON` leaves the model unmeasured at every thread count, keeps the
    reason through a resume, and the page names it with that reason (not as stopped for time),
    and not as missing from a later thread count's pass; an unknown model is refused."""
    threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    out = tmp_path / "run.json"
    quick = ["--rounds", "1", "--no-memory", "--grad", "off", "--modes", "all"]
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    why = "its process outgrew the memory"
    args = ["--json", str(out), "--models", "tiny", "L2-T128", "--threads", "1", "2", *quick]
    assert bench.main([*args, "--not-measured", "L2-T128", why]) == 0
    run = json.loads(out.read_text())
    assert run["not_measured"] == {"L2-T128": why}
    assert [sorted(m) for m in run["by_threads"].values()] == [["tiny"], ["tiny"]]
    assert bench.main([*args, "--resume"]) == 0  # the reason is kept: still not measured
    resumed = json.loads(out.read_text())
    assert resumed["not_measured"] == {"L2-T128": why}
    assert [sorted(m) for m in resumed["by_threads"].values()] == [["tiny"], ["tiny"]]
    with pytest.raises(SystemExit, match="--not-measured L99-T1: not a model of this run's plan"):
        bench.main([*args, "--resume", "--not-measured", "L99-T1", why])
    _, profile = data
    page = gen.outputs(resumed, profile)[gen.PAGE]
    assert "Planned but left out of this run, with the reason: L2-T128 (" in page and why in page
    assert "stopped before them, for time" not in page and "has not measured" not in page


def test_the_profile_says_what_the_garbage_collector_did_during_it(gen, data):
    """A profile that recorded the collector's passes (`bench.py --profile`) says how many ran per
    generation and for how long, since cProfile charges each to an unrelated function; one that
    saw none says so; an older profile without the record says nothing of it."""
    run, profile = data
    base = dict(
        {k: v for k, v in (profile or {}).items() if k != "collections"},
        model="L12-T128",
        profiled_s=0.67,
        plain_s=0.49,
        grad=True,
        torchlens_commit="abc1234",
        rows=[{"cumulative_s": 0.66, "own_s": 0.0, "calls": 1, "function": "_tracing.py:30 trace"}],
    )

    def header(p: dict) -> str:
        page = gen.outputs(run, p)[gen.PAGE]
        return next(ln for ln in page.splitlines() if ln.startswith("One `trace(save='all')`"))

    seen = dict(base, collections={"0": [22, 0.002], "1": [1, 0.001], "2": [1, 0.151]})
    line = header(seen)
    assert "autograd on" in line and "commit `abc1234`" in line
    assert "generation 0: 22 (2.0 ms); generation 1: 1 (1.0 ms); generation 2: 1 (151.0 ms)" in line
    assert "passes during the call" in header(dict(base, collections={"0": [0, 0.0]}))
    assert ": none)" in header(dict(base, collections={"0": [0, 0.0]}))
    assert "collector" not in header(base)


# -- the gradients bench (`bench.py --gradients`) and its section -------------------------------


@pytest.fixture(scope="module")
def bench():
    return script_modules.load("bench")


@pytest.fixture(scope="module")
def tiny_gradients(bench):
    """One real `bench.py --gradients tiny` run: every mode, one round, no memory children."""
    return bench.gradient_bench("tiny", 1, memory=False)


def test_every_gradient_mode_is_checked_against_a_tensor_hook(bench, tiny_gradients):
    """Before timing, the bench compares each mode's gradient at the middle block's output with a
    `register_hook` gradient: every mode but the two hook-based baselines and the unfrozen floor
    (whose gradients are at the embeddings' outputs) carries that check."""
    modes = tiny_gradients["modes"]
    assert list(modes) == bench.GRADIENT_MODES
    for mode in ("grad_all", "grad_resid_post", "tl_bwd", "nnsight_grad"):
        check = modes[mode]["check"]
        assert check["ref_max_abs"] > 0
        assert check["max_abs_diff"] <= bench.GRAD_CHECK_RTOL * check["ref_max_abs"], mode
    assert not any("check" in modes[m] for m in ("fb", "fb_hooks", "fb_unfrozen"))
    assert modes["fb_unfrozen"]["median_s"] > 0


def test_a_mode_with_a_wrong_gradient_stops_the_gradient_bench(bench, monkeypatch):
    """A mode whose gradient is another block's (here: TorchLens's at block 0 served as block 1's)
    stops the run with the difference, instead of being timed as if it did the same work."""
    right = bench._block_grad

    def off_by_one(mode, result, k):
        return right(mode, result, k - 1 if mode == "grad_resid_post" else k)

    monkeypatch.setattr(bench, "_block_grad", off_by_one)
    with pytest.raises(SystemExit, match=r"grad_resid_post: the gradient at transformer\.h\.1"):
        bench.gradient_bench("tiny", 1, memory=False, modes=["grad_resid_post"])


def _gradient_data(tiny: dict, smoke: bool = False) -> dict:
    """A `bench.py --gradients` JSON around the tiny run, filed under the first target model's
    name with memory figures added (the renderer's logic is what these tests change)."""
    model = copy.deepcopy(tiny)
    for row in model["modes"].values():
        row.update(peak_growth_bytes=100 * 2**20, held_bytes=2**20)
    for mode in ("grad_all", "grad_resid_post"):
        model["modes"][mode]["kept_with_output_bytes"] = 50 * 2**20
    return {
        "machine": {"cpus": 2, "torch_threads": 1, "load_at_start": [1.0, 1.0, 1.0]},
        "started": "2026-01-01 00:00 UTC",
        "smoke": smoke,
        "models": {"L12-T128": model},
    }


def test_the_gradients_section_shows_the_runs_numbers_and_checks_its_targets(gen, tiny_gradients):
    data = _gradient_data(tiny_gradients)
    page = gen.gradients_section(data)
    modes = data["models"]["L12-T128"]["modes"]
    for row in modes.values():
        assert f"{row['ratio']:.2f}×" in page and f"{row['cpu_ratio']:.2f}×" in page
    assert f"{modes['tl_bwd']['check']['max_abs_diff']:.1e}" in page
    assert "Smoke run" not in page
    assert "| every target on GPT-2 small, 1024 tokens | not measured | **not met** |" in page

    def target(page: str, mode: str, what: str) -> str:
        label = gen._label(modes[mode]["label"])
        return next(ln for ln in page.splitlines() if ln.startswith(f"| {label} {what}"))

    for mode, limit in gen.GRADIENT_TARGETS.items():
        for wall, cpu, verdict in (
            (limit - 0.01, limit - 0.01, "| met |"),
            (limit + 0.01, limit - 0.01, "| **not met** |"),
            (limit - 0.01, limit + 0.01, "| **not met** |"),
        ):
            modes[mode].update(ratio=wall, cpu_ratio=cpu)
            assert target(gen.gradients_section(data), mode, "at most").endswith(verdict)
        for peak, verdict in ((150, "| met |"), (151, "| **not met** |")):
            modes[mode]["peak_growth_bytes"] = peak * 2**20  # plain 100 MiB + kept 50 MiB
            assert target(gen.gradients_section(data), mode, "peak").endswith(verdict)


def test_a_smoke_run_is_labelled_and_the_section_follows_the_committed_file(
    gen, data, tiny_gradients, tmp_path, monkeypatch
):
    run, profile = data
    assert "Smoke run, not the measurement" in gen.gradients_section(
        _gradient_data(tiny_gradients, smoke=True)
    )
    path = tmp_path / "performance-gradients.json"
    monkeypatch.setattr(gen, "GRADIENTS", path)
    assert "## Gradients" not in gen.outputs(run, profile)[gen.PAGE]
    path.write_text(json.dumps(_gradient_data(tiny_gradients)))
    assert (
        gen.gradients_section(_gradient_data(tiny_gradients)) in gen.outputs(run, profile)[gen.PAGE]
    )


def test_the_generation_section_shows_each_modes_memory_when_measured(gen):
    """A generation run with memory rows gets the peak and held table from its numbers (a changed
    figure changes the page); the committed file without them renders no such table."""
    run = {
        "model": "L12-T128",
        "new_tokens": 4,
        "rounds": 3,
        "machine": {"cpus": 2, "torch_threads": 1, "load_at_start": [0.5, 0.5, 0.5]},
        "modes": {
            "generate": {"label": "model.generate", "median_s": 1.0, "ratio": 1.0},
            "gen_all": {
                "label": "TorchLens trace_generate save='all'",
                "median_s": 2.0,
                "ratio": 2.0,
                "kept_bytes_per_step": [3 * 2**20, 2**20, 2**20 + 4096, 2**20 + 8192],
                "peak_growth_bytes": 150 * 2**20,
                "held_bytes": 120 * 2**20,
                "held_trimmed_bytes": 102 * 2**20,
            },
            "nnsight_generate": {"label": "nnsight", "median_s": 1.1, "ratio": 1.1, "error": "x"},
        },
    }
    page = gen.generation_section(run)
    assert "| Mode | Peak | Held |" in page
    assert "| TorchLens trace_generate save='all' | 150 MiB | 102 MiB |" in page
    assert "| nnsight | failed | failed |" in page
    run["modes"]["gen_all"]["held_trimmed_bytes"] = 511 * 2**20
    assert "| 150 MiB | 511 MiB |" in gen.generation_section(run)
    for row in run["modes"].values():
        for k in ("peak_growth_bytes", "held_bytes", "held_trimmed_bytes", "error"):
            row.pop(k, None)
    assert "| Mode | Peak | Held |" not in gen.generation_section(run)


# -- a run cut at a model and resumed (`bench.py --resume`) ------------------------------------


def test_a_resumed_run_keeps_what_it_measured_and_measures_the_rest(
    bench, tmp_path, monkeypatch, request
):
    """`--resume` goes on with the run in `--json`: a model it measured is kept as measured (not
    run again), the others are measured, and the start is listed; a run of another commit, or
    with other grad modes, is refused with what differs."""
    threads = torch.get_num_threads()  # bench.main sets the count it measures with
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    out = tmp_path / "run.json"
    quick = ["--rounds", "1", "--no-memory", "--threads", "1", "--grad", "off", "--modes", "all"]
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    assert bench.main(["--json", str(out), "--models", "tiny", *quick]) == 0
    first = json.loads(out.read_text())
    assert list(first["models"]) == ["tiny"] and "resumed" not in first
    args = ["--json", str(out), "--models", "tiny", "L2-T128", *quick, "--resume"]
    assert bench.main(args) == 0
    second = json.loads(out.read_text())
    assert sorted(second["models"]) == ["L2-T128", "tiny"]
    assert second["models"]["tiny"] == first["models"]["tiny"]  # kept, not measured again
    assert second["started"] == first["started"] and len(second["resumed"]) == 1
    assert second["models"]["L2-T128"]["modes"]["all"]["ratio"] > 0
    monkeypatch.setenv("BENCH_COMMIT", "def5678")
    with pytest.raises(SystemExit, match="torchlens_commit: 'abc1234' there, 'def5678' now"):
        bench.main(args)
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    with pytest.raises(SystemExit, match="grad_modes"):
        bench.main([*args[:-5], "--grad", "on", "--modes", "all", "--resume"])
    assert json.loads(out.read_text()) == second  # a refused resume writes nothing

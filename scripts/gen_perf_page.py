"""Render docs/performance.md and its SVG charts from one `scripts/bench.py` run.

The run's data is committed next to the charts (`docs/assets/performance-run.json`, and the
profile in `docs/assets/performance-profile.json`), so the page can be checked for staleness
like the other generated pages.

Usage:
    python scripts/bench.py --json build/bench.json
    python scripts/bench.py --profile L12-T1024 --json build/profile.json
    python scripts/gen_perf_page.py --run build/bench.json --profile build/profile.json
    python scripts/bench.py --gradients L12-T128 L12-T1024 --threads 1 --json build/gradients.json
    python scripts/gen_perf_page.py --gradients build/gradients.json
    python scripts/gen_perf_page.py --check   # exit 1 if the page or a chart differs from the data
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _outputs import write_or_check

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "performance.md"
ASSETS = ROOT / "docs" / "assets"
RUN = ASSETS / "performance-run.json"
PROFILE = ASSETS / "performance-profile.json"
#: A `bench.py --generation MODEL --json ...` run: trace_generate against model.generate and nnsight.
GENERATION = ASSETS / "performance-generation.json"
#: The issue's targets for trace_generate, as ratios to model.generate.
GENERATION_TARGETS = {"gen_resid_post": 1.2, "gen_all": 1.5}
#: A `bench.py --gradients MODEL... --json ...` run: trace(..., grads=) against a plain forward and
#: backward, TransformerLens's backward hooks and nnsight's `.grad`.
GRADIENTS = ASSETS / "performance-gradients.json"

#: Text after this line in docs/performance.md is written by hand and kept when the page is regenerated.
APPENDED = "<!-- hand-written below: kept by gen_perf_page.py -->"

MiB = 2**20
#: Mode order and colours in tables and charts.
MODES = [
    "plain",
    "all",
    "none",
    "resid_post",
    "all_dir",
    "tl_cache",
    "nnsight",
    "hooks",
    "pypi",
    "floor_pass",
    "floor_keep",
]
COLORS = {
    "plain": "#000000",
    "all": "#3f51b5",
    "none": "#03a9f4",
    "resid_post": "#009688",
    "all_dir": "#8bc34a",
    "tl_cache": "#e91e63",
    "nnsight": "#ff9800",
    "hooks": "#795548",
    "pypi": "#9e9e9e",
    "floor_pass": "#b0bec5",
    "floor_keep": "#607d8b",
}
#: The floor each target's mode is measured against (`scripts/bench.py`: no capture that sees every
#: op through a torch function mode costs less).
FLOOR_OF = {"all": "floor_keep", "none": "floor_pass"}


def _title(name: str, spec: dict) -> str:
    if name == "tiny":
        return f"tiny ({spec['n_layer']} layers, d_model {spec['n_embd']}, {spec['tokens']} tokens)"
    if spec["n_layer"] == 12:
        return f"GPT-2 small, {spec['tokens']} tokens"
    return f"{spec['n_layer']} layers, {spec['tokens']} tokens"


def _spec(name: str) -> dict:
    """The spec bench.py gives a model name (for models a run did not reach)."""
    layers, tokens = (int(x) for x in name[1:].split("-T"))
    return {"n_layer": layers, "tokens": tokens}


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _label(s: str) -> str:
    """A mode's label for a table cell: `key=value` parts as inline code, which never breaks
    inside; a placeholder value (`store=<directory>`) is said in words after the code
    (`store=` a directory), since on a phone a browser breaks the code after its `=`."""
    words = []
    for w in s.split(" "):
        comma = "," if w.endswith(",") else ""
        key, _, value = w.rstrip(",").partition("=")
        if value.startswith("<") and value.endswith(">"):
            words.append(f"`{key}=` a {_esc(value[1:-1])}{comma}")
        else:
            words.append(f"`{w.rstrip(',')}`{comma}" if "=" in w else _esc(w))
    return " ".join(words)


# -- charts ------------------------------------------------------------------------------------


def _nice_max(v: float) -> float:
    if v <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * mag:
            return m * mag
    return 10 * mag


def line_chart(
    title: str,
    xlabel: str,
    ylabel: str,
    xs: list[float],
    series: dict[str, list[float | None]],
    labels: dict[str, str],
    log2_x: bool = False,
) -> str:
    """A small SVG line chart: one polyline per series, a legend on the right."""
    w, h, left, top, right, bottom = 860, 330, 70, 34, 320, 46
    pw, ph = w - left - right, h - top - bottom
    ymax = _nice_max(max((y for ys in series.values() for y in ys if y is not None), default=1.0))
    fx = (lambda x: math.log2(x)) if log2_x else (lambda x: x)
    x0, x1 = fx(min(xs)), fx(max(xs))

    def px(x):
        return left + (pw * (fx(x) - x0) / (x1 - x0) if x1 > x0 else pw / 2)

    def py(y):
        return top + ph - ph * y / ymax

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{w}" height="{h}" fill="#ffffff"/>',
        f'<text x="{left}" y="20" font-weight="bold">{_esc(title)}</text>',
    ]
    for i in range(6):
        y = ymax * i / 5
        out.append(
            f'<line x1="{left}" y1="{py(y):.1f}" x2="{left + pw}" y2="{py(y):.1f}" stroke="#e0e0e0"/>'
        )
        out.append(f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    for x in xs:
        out.append(f'<text x="{px(x):.1f}" y="{top + ph + 16}" text-anchor="middle">{x:g}</text>')
    out.append(
        f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" stroke="#000"/>'
    )
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + ph}" stroke="#000"/>')
    out.append(f'<text x="{left + pw / 2}" y="{h - 8}" text-anchor="middle">{_esc(xlabel)}</text>')
    out.append(
        f'<text x="16" y="{top + ph / 2}" text-anchor="middle" transform="rotate(-90 16 {top + ph / 2})">'
        f"{_esc(ylabel)}</text>"
    )
    ly = top + 6
    for key, ys in series.items():
        pts = [(px(x), py(y)) for x, y in zip(xs, ys) if y is not None]
        color = COLORS.get(key, "#607d8b")
        if len(pts) > 1:
            out.append(
                f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                + " ".join(f"{a:.1f},{b:.1f}" for a, b in pts)
                + '"/>'
            )
        for a, b in pts:
            out.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{color}"/>')
        out.append(
            f'<line x1="{left + pw + 16}" y1="{ly}" x2="{left + pw + 36}" y2="{ly}" stroke="{color}" stroke-width="3"/>'
        )
        out.append(f'<text x="{left + pw + 42}" y="{ly + 4}">{_esc(labels.get(key, key))}</text>')
        ly += 18
    out.append("</svg>")
    return "\n".join(out) + "\n"


def bar_chart(run: dict) -> str:
    """Time relative to a plain forward, one group of bars per table model, each on its own scale."""
    groups = []
    for name in run["table"]:
        rows = [
            (mode, r["ratio"])
            for mode in MODES
            if mode != "plain"
            for r in [run["models"][name]["modes"].get(mode)]
            if r and "ratio" in r
        ]
        if rows:
            groups.append((name, rows))
    bar_h, gap, left, width = 16, 5, 300, 380
    top = 34
    height = top + sum(len(rows) * (bar_h + gap) + 26 for _, rows in groups) + 10
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 70}" height="{height}" '
        f'viewBox="0 0 {left + width + 70} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{left + width + 70}" height="{height}" fill="#ffffff"/>',
        '<text x="4" y="18" font-weight="bold">time relative to a plain forward in the same run '
        "(lower is better; dashed: 1x; each model on its own scale)</text>",
    ]
    y = top
    for name, rows in groups:
        out.append(
            f'<text x="4" y="{y + 12}" font-weight="bold">'
            f"{_esc(_title(name, run['models'][name]['spec']))}</text>"
        )
        y += 18
        vmax = max(max(r for _, r in rows), 1.0) * 1.12
        y0 = y
        for mode, ratio in rows:
            bw = width * ratio / vmax
            out.append(
                f'<text x="{left - 6}" y="{y + 12}" text-anchor="end">{_esc(run["labels"][mode])}</text>'
            )
            out.append(
                f'<rect x="{left}" y="{y}" width="{bw:.1f}" height="{bar_h}" fill="{COLORS[mode]}"/>'
            )
            out.append(f'<text x="{left + bw + 4:.1f}" y="{y + 12}">{ratio:.2f}x</text>')
            y += bar_h + gap
        x1 = left + width / vmax
        out.append(
            f'<line x1="{x1:.1f}" y1="{y0 - 2}" x2="{x1:.1f}" y2="{y}" stroke="#c62828" stroke-dasharray="4 3"/>'
        )
        y += 8
    out.append("</svg>")
    return "\n".join(out) + "\n"


def sweep_charts(run: dict) -> dict[str, str]:
    charts = {}
    for sweep, key, xlabel, log2 in (
        ("token_sweep", "tokens", "tokens (12 layers)", True),
        ("layer_sweep", "n_layer", "layers (128 tokens)", False),
    ):
        names = run.get(sweep) or []
        if len(names) < 2:
            continue
        xs = [run["models"][n]["spec"][key] for n in names]
        modes = [m for m in MODES if any(m in run["models"][n]["modes"] for n in names)]
        time = {
            m: [run["models"][n]["modes"].get(m, {}).get("median_s") for n in names] for m in modes
        }
        mem = {
            m: [
                (run["models"][n]["modes"].get(m, {}).get("peak_growth_bytes") or 0) / MiB
                if "peak_growth_bytes" in run["models"][n]["modes"].get(m, {})
                else None
                for n in names
            ]
            for m in modes
        }
        time = {m: v for m, v in time.items() if any(x is not None for x in v)}
        mem = {m: v for m, v in mem.items() if any(x is not None for x in v)}
        charts[f"performance-{key.replace('n_layer', 'layers')}-time.svg"] = line_chart(
            f"median time per forward vs {xlabel}", xlabel, "seconds", xs, time, run["labels"], log2
        )
        charts[f"performance-{key.replace('n_layer', 'layers')}-memory.svg"] = line_chart(
            f"peak memory growth over a plain forward's steady state vs {xlabel}",
            xlabel,
            "MiB",
            xs,
            mem,
            run["labels"],
            log2,
        )
    return charts


# -- page --------------------------------------------------------------------------------------


def _mib(b: float) -> str:
    v = b / MiB
    return f"{v:.1f}" if abs(v) < 10 else f"{v:.0f}"


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _targets(run: dict) -> list[str]:
    """Issue 15's targets, each met or not in this run."""

    def ratio(name, mode):
        r = run["models"].get(name, {}).get("modes", {}).get(mode, {})
        return r.get("ratio")

    checks = []  # (target, value, met, floor ratio or None)
    for name, limit in (
        ("tiny", 2.0),
        ("L12-T128", 1.10),
        ("L12-T1024", 1.25),
        ("L12-T2048", 1.25),
    ):
        r, floor = ratio(name, "all"), ratio(name, FLOOR_OF["all"])
        if r is not None:
            checks.append(
                (
                    f"`save='all'` at most {limit:.2f}x on {_title(name, run['models'][name]['spec'])}",
                    r,
                    r <= limit,
                    floor,
                )
            )
        t = ratio(name, "tl_cache")
        if r is not None and t is not None:
            checks.append(
                (
                    f"`save='all'` at or below TransformerLens `run_with_cache` on "
                    f"{_title(name, run['models'][name]['spec'])} ({t:.2f}x)",
                    r,
                    r <= t,
                    floor,
                )
            )
    for name in run["table"]:
        r = ratio(name, "none")
        if r is not None:
            checks.append(
                (
                    f"`save='none'` at most 1.05x on {_title(name, run['models'][name]['spec'])}",
                    r,
                    r <= 1.05,
                    ratio(name, FLOOR_OF["none"]),
                )
            )
    rows = [
        f"| {text} | {value:.2f}x | {'—' if floor is None else f'{floor:.2f}x'} | {'met' if ok else '**not met**'} |"
        for text, value, ok, floor in checks
    ]
    for name in run[
        "table"
    ]:  # a selection: no slower than save='none', peak within plain + kept + 10%
        modes = run["models"][name].get("modes", {})
        sel, none, plain = (
            modes.get("resid_post", {}),
            modes.get("none", {}),
            modes.get("plain", {}),
        )
        title = _title(name, run["models"][name]["spec"])
        if "ratio" in sel and "ratio" in none:
            rows.append(
                f"| `save=['resid_post']` no slower than `save='none'` on {title} ({none['ratio']:.2f}x) "
                f"| {sel['ratio']:.2f}x | — | {'met' if sel['ratio'] <= none['ratio'] else '**not met**'} |"
            )
        if "peak_growth_bytes" in sel and "peak_growth_bytes" in plain and "kept_bytes" in sel:
            limit = 1.10 * (plain["peak_growth_bytes"] + sel["kept_bytes"])
            rows.append(
                f"| `save=['resid_post']` peak at most 1.1 x (plain peak + kept) on {title} "
                f"({limit / 2**20:.1f} MiB) | {sel['peak_growth_bytes'] / 2**20:.1f} MiB | — "
                f"| {'met' if sel['peak_growth_bytes'] <= limit else '**not met**'} |"
            )
    return rows


#: Modes of the grad-mode tables, in order (those a run measured are shown).
GRAD_MODES = [
    "plain",
    "all",
    "none",
    "resid_post",
    "modlist",
    "pattern",
    "qkvz",
    "output",
    "tl_cache",
    "nnsight",
    "hooks",
    "floor_pass",
    "floor_keep",
    "floor_copy",
    "plain_booted",
    "all_booted",
]
GRAD = "+grad"


def _cell(r: dict | None, key: str = "ratio") -> str:
    if not r or key not in r:
        return "—"
    cpu = {
        "ratio": "cpu_ratio",
        "ratio_to_booted_plain": "cpu_ratio_to_booted_plain",
        "grad_over_no_grad": "cpu_grad_over_no_grad",
    }[key]
    return f"{r[key]:.2f}x" + (f" (cpu {r[cpu]:.2f}x)" if cpu in r else "")


def _issue28_targets(models: dict, table: list[str]) -> list[str]:
    """Issue 28's targets, each checked in the run's rows of one thread count (both grad modes),
    on CPU-time ratios where the run has them (the load disturbs wall time more: a hooks baseline
    moved from 1.05x to 1.29x wall in one run), with the wall-clock figure beside."""
    rows = []

    def val(r: dict, key: str = "ratio") -> tuple[float, float]:
        cpu = {
            "ratio": "cpu_ratio",
            "ratio_to_booted_plain": "cpu_ratio_to_booted_plain",
            "grad_over_no_grad": "cpu_grad_over_no_grad",
        }[key]
        return r.get(cpu, r[key]), r[key]

    def row(
        text: str, value: tuple[float, float], limit: tuple[float, float], floor: str = "—"
    ) -> None:
        rows.append(
            f"| {text} | {value[0]:.2f}x ({value[1]:.2f}x) | {limit[0]:.2f}x ({limit[1]:.2f}x) | {floor} "
            f"| {'met' if value[0] <= limit[0] else '**not met**'} |"
        )

    def over(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
        return a[0] / b[0], a[1] / b[1]

    for name in table:
        modes, title = models[name]["modes"], _title(name, models[name]["spec"])
        for g, gname in (("", "no_grad"), (GRAD, "autograd on")):

            def get(m: str, modes: dict = modes, g: str = g) -> dict:
                return modes.get(m + g, {})

            a, t, h = get("all"), get("tl_cache"), get("hooks")
            if "ratio" in a and "ratio" in t:
                row(
                    f"`save='all'` at or below `run_with_cache`, {title}, {gname}",
                    val(a),
                    val(t),
                    _cell(get("floor_keep")),
                )
            ab = get("all_booted")
            if "ratio_to_booted_plain" in ab and "ratio_to_booted_plain" in t:
                row(
                    f"booted setup: `save='all'` at or below `run_with_cache`, {title}, {gname} (to the booted "
                    "forward)",
                    val(ab, "ratio_to_booted_plain"),
                    val(t, "ratio_to_booted_plain"),
                )
            if "ratio" in h and name != "tiny":
                for mode, limit in (
                    ("resid_post", 1.05),
                    ("modlist", 1.05),
                    ("pattern", 1.10),
                    ("qkvz", 1.10),
                ):
                    r = get(mode)
                    if "ratio" in r:
                        row(
                            f"`save={SAVE_LISTS[mode]}` over the hooks baseline, {title}, {gname}",
                            over(val(r), val(h)),
                            (limit, limit),
                        )
            n = get("none")
            if "ratio" in n and name == "L12-T128":
                row(
                    f"`save='none'` over a plain forward, {title}, {gname}",
                    val(n),
                    (1.05, 1.05),
                    _cell(get("floor_pass")),
                )
        a, p = modes.get("all" + GRAD, {}), modes.get("plain" + GRAD, {})
        if "grad_over_no_grad" in a and "grad_over_no_grad" in p:
            row(
                f"autograd on costs only what autograd costs: `save='all'` with over without autograd, against a "
                f"plain forward's, {title}",
                val(a, "grad_over_no_grad"),
                val(p, "grad_over_no_grad"),
            )
    return rows


#: The `save=` lists of bench.py's list modes, as the targets table writes them.
SAVE_LISTS = {
    "resid_post": "['resid_post']",
    "modlist": "['resid_pre','resid_post','logits']",
    "pattern": "['pattern']",
    "qkvz": "['q','k','v','z']",
}


def grad_sections(run: dict) -> list[str]:
    """Both grad modes, every thread count, both TransformerLens setups and issue 28's targets,
    from a run that measured them (`bench.py` with `--grad both`); nothing for a run that did not."""
    by_threads = run.get("by_threads") or {str(run["machine"]["torch_threads"]): run["models"]}
    if not any(
        m.endswith(GRAD)
        for ms in by_threads.values()
        for n in ms.values()
        for m in n.get("modes", {})
    ):
        return []
    lines = [
        "## Autograd on, thread counts and the TransformerLens setups",
        "",
        "Every mode ran twice in the same rounds: under `torch.no_grad()` and with autograd on, as the",
        "guides call `tl.trace`. Each ratio is to the plain forward *of the same grad mode*; *on/off* is",
        "the median over the rounds of a mode's time with autograd over its time without; CPU-time",
        "ratios (which the load disturbs less) are in brackets. The booted rows are the second",
        "TransformerLens setup: `boot_transformers(..., hf_model=model)` replaces the model's modules",
        "by bridge components and switches it to eager attention, so `model(ids)` afterwards is the",
        "*plain forward of the booted model*; their last column is the ratio to that forward.",
        "",
    ]
    for threads, models in by_threads.items():
        names = [n for n in run["table"] if n in models] or list(models)
        for name in names:
            modes, title = models[name]["modes"], _title(name, models[name]["spec"])
            present = [m for m in GRAD_MODES if m in modes or m + GRAD in modes]
            if not any(m + GRAD in modes for m in present):
                continue
            lines += [
                f"### {title}, {threads} torch thread(s), {models[name]['rounds']} rounds",
                "",
                "| mode | no_grad | autograd on | on/off | to the booted forward (no_grad / autograd) |",
                "|---|---:|---:|---:|---:|",
            ]
            for m in present:
                booted = "—"
                if m in ("tl_cache", "plain_booted", "all_booted"):
                    booted = (
                        f"{_cell(modes.get(m), 'ratio_to_booted_plain')} / "
                        f"{_cell(modes.get(m + GRAD), 'ratio_to_booted_plain')}"
                    )
                lines.append(
                    f"| {_label(run['labels'].get(m, m))} | {_cell(modes.get(m))} | "
                    f"{_cell(modes.get(m + GRAD))} | {_cell(modes.get(m + GRAD), 'grad_over_no_grad')} | "
                    f"{booted} |"
                )
            lines.append("")
    first = by_threads[next(iter(by_threads))]
    names = [n for n in run["table"] if n in first]
    lines += [
        "### When to wrap a trace in `torch.no_grad()`",
        "",
        "A trace with autograd on builds the forward's autograd graph, as `model(ids)` does, and",
        "`trace.output` holds it, so you can call `.backward()` from the output. The served facets and op",
        "outputs are detached either way; `grads=` gives gradients at them. Wrap the call in",
        "`torch.no_grad()` when you only read values. What that saved in this run (first thread count,",
        "median times):",
        "",
    ]
    for name in names:
        modes = first[name]["modes"]
        a, ag = modes.get("all", {}), modes.get("all" + GRAD, {})
        pg = modes.get("plain" + GRAD, {})
        if "grad_over_no_grad" in ag and "median_s" in a:
            plain = (
                f"; a plain forward: {_cell(pg, 'grad_over_no_grad')}"
                if "grad_over_no_grad" in pg
                else ""
            )
            mem = ""
            if "held_bytes" in a and "held_bytes" in ag:
                mem = (
                    f", held memory {_mib(ag.get('held_trimmed_bytes', ag['held_bytes']))} MiB with autograd, "
                    f"{_mib(a.get('held_trimmed_bytes', a['held_bytes']))} MiB without"
                )
            lines.append(
                f"- {_title(name, first[name]['spec'])}: `save='all'` with autograd on took "
                f"{_cell(ag, 'grad_over_no_grad')} its `no_grad` time (medians {_fmt_time(ag['median_s'])} "
                f"and {_fmt_time(a['median_s'])}{mem}){plain}."
            )
    lines += [
        "",
        "A ratio below 1.00x is the load's noise: in these rounds the two cost the same, and",
        "`torch.no_grad()` saves what it saves a plain forward, no more.",
    ]
    mib = []
    for name in names:
        modes = first[name]["modes"]
        a, t, h = modes.get("all", {}), modes.get("tl_cache", {}), modes.get("hooks", {})
        if all("held_bytes" in r for r in (a, t, h)):
            held = lambda r: r.get("held_trimmed_bytes", r["held_bytes"])
            mib.append(
                f"- {_title(name, first[name]['spec'])}: `save='all'` holds {_mib(held(a) - held(t))} MiB "
                f"more than `run_with_cache` and {_mib(held(a) - held(h))} MiB more than cloning every "
                "module's output. That memory is every op output inside every module (the values the "
                "facets are found and checked from, and `trace.ops[i].tensor`), which neither peer keeps."
            )
    if mib:
        lines += ["", "### What each extra MiB buys", ""] + mib
    lines += [
        "",
        "### Issue 28's targets",
        "",
        "Checked in this run (first thread count), on CPU-time ratios (wall-clock in brackets). For the",
        "`save=` lists the value is the list's ratio over the hooks baseline's in the same grad mode.",
        "",
        "| target | this run | limit | floor | |",
        "|---|---:|---:|---:|---|",
    ]
    lines += _issue28_targets(first, names) + [""]
    return lines


def _collections(profile: dict) -> str:
    """What the garbage collector did during the profiled call (a profile that recorded it)."""
    passes = profile.get("collections")
    if not passes:
        return ""
    done = [(g, n, s) for g, (n, s) in sorted(passes.items()) if n]
    said = (
        "; ".join(f"generation {g}: {n} ({s * 1000:.1f} ms)" for g, n, s in done)
        if done
        else "none"
    )
    return (
        " (the heap was collected first; the collector's passes during the call, charged by"
        f" cProfile to whatever function was allocating when each began: {said})"
    )


def _cut_passes(run: dict) -> str:
    """The words for thread counts whose pass over the models the run has not finished."""
    cut = run.get("missing_by_threads") or {}
    parts = []
    for t, missing in cut.items():
        done = list(run.get("by_threads", {}).get(t, {}))
        parts.append(
            f"; the {t}-thread pass has not measured {', '.join(missing)} yet (the run was stopped"
            " for time; `bench.py --resume` goes on with it model by model), so its sections below"
            + (f" show only {', '.join(done)}" if done else " are not there yet")
        )
    return "".join(parts)


def render(run: dict, profile: dict | None, charts: list[str]) -> str:
    m = run["machine"]
    threads = run.get("threads") or [m["torch_threads"]]  # a run before --threads ran one count
    loads = [run["models"][n].get("load_before") for n in run["models"]] + [
        run["models"][n].get("load_after") for n in run["models"]
    ]
    loads = [x[0] for x in loads if x]
    lines = [
        "# Performance",
        "",
        "Capture cost is measured, not guessed. Everything on this page is generated by",
        "`scripts/gen_perf_page.py` from one run of `scripts/bench.py`, whose data is committed in",
        "`docs/assets/performance-run.json`.",
        "",
        "## How it was measured",
        "",
        f"- Run started {run.get('started', '?')} on {m['cpus']} CPU cores, no GPU (`{m['device']}`), "
        + (
            f"{m['torch_threads']} torch thread(s)"
            if len(threads) == 1
            else f"{' and '.join(map(str, threads))} torch threads (a whole pass over the models"
            f" each; the tables before the per-thread sections show {m['torch_threads']})"
            + _cut_passes(run)
        )
        + f"; Python {m['python']}, torch {m['torch']}, transformers "
        f"{m['transformers']}, TorchLens {m['torchlens']}"
        + (f" at commit `{m['torchlens_commit']}`" if m.get("torchlens_commit") else "")
        + "."
        + (
            f" The run was cut and resumed ({', '.join(run['resumed'])}; `bench.py --resume`): every"
            " model was measured whole in one process, and every start measured the same commit with"
            " the same library versions."
            if run.get("resumed")
            else ""
        ),
        "- Models: random-weight GPT-2s built from a config with a fixed seed, float32; `tiny` is 2 layers,",
        "  d_model 32, 4 tokens; the others have GPT-2 small's width (d_model 768, 12 heads, vocabulary",
        "  50257) with the layers and tokens named. GPT-2 runs its default `sdpa` attention; the",
        "  TransformerLens bridge switches its own copy of the model to eager attention.",
        "- Time: for each model every mode runs in one process, interleaved round by round after a",
        "  warm-up round; the median time of the rounds is shown, and the ratio is the median over the",
        "  rounds of the mode's time over the plain forward's in the same round. The PyPI `torchlens`",
        "  runs in its own process and virtual",
        "  environment, against a plain forward interleaved in that process.",
        "- Memory: each mode runs once more in a fresh process, after two plain forwards of the same",
        "  model and a `malloc_trim`: *peak* is the growth of the peak resident set (VmHWM) during the",
        "  run, *held* what is still resident while the result is alive (after another `malloc_trim`),",
        "  *kept* the bytes of tensor storage a TorchLens trace references."
        + (
            f" The memory processes ran with `MALLOC_MMAP_THRESHOLD_={m['mmap_threshold']}`"
            " (`--mmap-threshold`): large tensors are mapped and unmapped, so a peak does not depend"
            " on how the heap was reused before."
            if m.get("mmap_threshold")
            else ""
        ),
        f"- **Load caveat**: the machine was shared with other jobs during the run (1-minute load average "
        f"{min(loads):.1f} to {max(loads):.1f} on {m['cpus']} cores"
        + (
            "; one torch thread was used because two threads under that load made a forward up to 100x "
            "slower"
            if threads == [1]
            else ""
        )
        + "). Ratios from few rounds under load move by tens of percent between runs; read them as"
        " orders of magnitude and compare columns, not decimals."
        if loads
        else "",
        "",
        "![Time relative to a plain forward](assets/performance.svg)",
        "",
        "## Side by side",
        "",
        "Time relative to a plain forward (median time in brackets).",
        "",
    ]
    table = run["table"]
    head = "| mode | " + " | ".join(_title(n, run["models"][n]["spec"]) for n in table) + " |"
    lines += [head, "|---|" + "---:|" * len(table)]
    for mode in MODES:
        cells, any_cell = [], False
        for n in table:
            r = run["models"][n]["modes"].get(mode)
            if r is None:
                cells.append("not run")
            elif "error" in r:
                cells.append("failed")
            elif "ratio" in r:
                cells.append(f"{r['ratio']:.2f}x ({_fmt_time(r['median_s'])})")
                any_cell = True
            else:
                cells.append("memory only")
        if any_cell:
            lines.append(f"| {_label(run['labels'][mode])} | " + " | ".join(cells) + " |")
    why = run.get("not_measured") or {}
    if run.get("missing"):
        lines += [
            "",
            "Planned but not measured (the run was stopped before them, for time): "
            + ", ".join(f"{n} ({_title(n, _spec(n))})" for n in run["missing"])
            + ".",
        ]
    if why:
        lines += [
            "",
            "Planned but left out of this run, with the reason: "
            + "; ".join(f"{n} ({_title(n, _spec(n))}): {why[n]}" for n in why)
            + ".",
        ]
    rounds = ", ".join(
        f"{_title(n, run['models'][n]['spec'])}: {run['models'][n]['rounds']}" for n in table
    )
    lines += [
        "",
        f"Rounds: {rounds}.",
        "",
        "## Memory",
        "",
        "Peak / held / kept, in MiB (see above for what each means).",
        "",
        head,
        "|---|" + "---:|" * len(table),
    ]
    for mode in MODES:
        cells, any_cell = [], False
        for n in table:
            r = run["models"][n]["modes"].get(mode, {})
            if "peak_growth_bytes" not in r:
                cells.append("—")
                continue
            any_cell = True
            held = r.get("held_trimmed_bytes", r.get("held_bytes"))
            kept = f" / {_mib(r['kept_bytes'])}" if r.get("kept_bytes") is not None else ""
            cells.append(f"{_mib(r['peak_growth_bytes'])} / {_mib(held)}{kept}")
        if any_cell:
            lines.append(f"| {_label(run['labels'][mode])} | " + " | ".join(cells) + " |")
    errors = [
        (n, mode, r["error"])
        for n in table
        for mode, r in run["models"][n]["modes"].items()
        if "error" in r
    ]
    if errors:
        lines += ["", "Failed in this run:", ""]
        lines += [
            f"- {_esc(run['labels'][mode])} on {_title(n, run['models'][n]['spec'])}: `{_esc(e)}`"
            for n, mode, e in errors
        ]
    lines += [
        "",
        "## Targets",
        "",
        "The targets of issue 15, checked against this run. *Floor* is the same run's cost of a",
        "torch function mode alone on that model: passing every op through (for `save='none'`), or",
        "also keeping a reference to every op output (for `save='all'`); no capture that sees each op",
        "through such a mode, as TorchLens's does, can cost less. A target below its floor cannot be",
        "met that way on this machine.",
        "",
        "| target | this run | floor | |",
        "|---|---:|---:|---|",
    ] + _targets(run)
    grad = grad_sections(run)
    if grad:
        lines += [""] + grad[:-1]
    lines += ["", "## Scaling", ""]
    for c in charts:
        if c.startswith("performance-") and c != "performance.svg":
            lines += [f"![{c[12:-4].replace('-', ' ')}](assets/{c})", ""]
    if profile:
        rows = profile["rows"]
        lines += [
            "## Where the time goes",
            "",
            f"One `trace(save='all')` on {profile['model']} under cProfile ({profile['profiled_s']:.2f} s "
            f"profiled; plain forward {profile['plain_s']:.2f} s unprofiled"
            + (", autograd on" if profile.get("grad") else "")
            + (
                f", commit `{profile['torchlens_commit']}`"
                if profile.get("torchlens_commit")
                else ""
            )
            + "), TorchLens functions by cumulative time"
            + _collections(profile)
            + ":",
            "",
            "| cumulative | own | calls | function |",
            "|---:|---:|---:|---|",
        ]
        lines += [
            f"| {r['cumulative_s']:.2f} s | {r['own_s']:.2f} s | {r['calls']} | `{_esc(r['function'])}` |"
            for r in rows
        ]
        by_name = {r["function"].split(" ")[-1]: r["cumulative_s"] for r in rows}
        total = by_name.get("trace")
        if total and "derive" in by_name:
            parts = [
                f"`{n}` {by_name[n] / by_name['derive']:.0%}"
                for n in (
                    "attention_facets",
                    "rebuild_attention",
                    "_result_site",
                    "norm_facets",
                    "block_facets",
                )
                if n in by_name
            ]
            lines += [
                "",
                f"Deriving the facets after the forward (`derive`) takes {by_name['derive'] / total:.0%} of the "
                f"profiled trace; of that: {', '.join(parts)}.",
            ]
        lines.append("")
    lines += [
        "## Reading the numbers",
        "",
        "- *save='none'* records every op and module call but keeps no tensors: the cost of the capture",
        "  itself.",
        "- *save='all'* keeps every op output and finds every facet after the forward; the facets",
        "  computed from recorded tensors (norm statistics, per-head attention results, attention",
        "  patterns rebuilt from the fused kernel's inputs) and their checks run when first read, so",
        "  none of that is in these times (a `[heads, query, key]` pattern costs its rebuild on first read).",
        "- *save=['resid_post']* holds only each block's output, taken by the block's forward hook,",
        "  while the forward runs, and keeps only those.",
        "- *store=&lt;directory&gt;* is `save='all'` with the tensors written to safetensors files as",
        "  capture goes (each time a top-level layer ends) and served memory-mapped, so the peak stays",
        "  near the plain forward's plus about one layer's tensors, and what the trace holds afterwards",
        "  is not resident (its *kept* bytes are in the files).",
        "- *forward hook on every module* is what a user writes by hand: one hook per module cloning its",
        "  output; it sees module boundaries only.",
        "- *nnsight* saves every module's output through its tracing context.",
        "- *PyPI torchlens 2.36.1* is a different project that happens to share the name; it runs up to",
        "  1024 tokens only (`bench.py --no-pypi-above`), for time.",
        "- The tiny model's millisecond timings are the most sensitive to the load: a 20 ms pause of the",
        "  process moves its ratio by several x.",
        "",
        "A hand-written section may be appended to this page's source after the HTML comment that",
        "`APPENDED` in `scripts/gen_perf_page.py` names; the generator keeps it.",
        "",
        "Regenerate with `python scripts/bench.py --json build/bench.json`, `python scripts/bench.py",
        f"--profile {(profile or {}).get('model', 'L12-T1024')}"
        + (" --profile-grad" if (profile or {}).get("grad") else "")
        + " --json build/profile.json` and `python scripts/gen_perf_page.py --run",
        "build/bench.json --profile build/profile.json`.",
        "",
    ]
    return "\n".join(line for line in lines if line is not None)


#: The PyPI package the `pypi` mode measures (a different project that shares the name).
PYPI_VERSION = "2.36.1"


def _pypi_checked(model: dict) -> dict:
    """`model`'s results, with a `pypi` row that did not measure PyPI torchlens 2.36.1 (a run whose
    child imported another `torchlens`, e.g. this project's through PYTHONPATH) turned into an error."""
    row = model.get("modes", {}).get("pypi")
    if row is None or "error" in row or row.get("version") == PYPI_VERSION:
        return model
    modes = dict(model["modes"])
    modes["pypi"] = {
        "error": f"measured torchlens {row.get('version')!r}, not the PyPI package {PYPI_VERSION}"
    }
    return {**model, "modes": modes}


def _size(b: float) -> str:
    return f"{b / 1024:.1f} KiB" if b < MiB else f"{_mib(b)} MiB"


#: The floor row each generation target is read against: recording every op and module call (what
#: any step holding every op of its forward pays), and for `save='all'` also keeping every op output
#: and copying those the caller can still reach at each step (what keeping them all pays).
GENERATION_FLOORS = {
    "gen_resid_post": "floor_record_generate",
    "gen_all": "floor_keep_generate",
}


def _generation_floor(gen: dict) -> list[str]:
    """What the floor rows of a generation run leave each target: every step of `trace_generate`
    is a `Trace` holding every op of its forward, so recording every op and module call in Python
    (nothing assembled) is a cost no design of it avoids, and `save='all'` also keeps every op
    output, copying what the caller can still reach (`GENERATION_FLOORS`; a run without the
    second floor reads `save='all'` against the first). The rest of a target's margin, per
    forward, is what finding each step's structure and facets may cost. Nothing without a
    floor row."""
    base = gen["modes"].get("generate")
    record = gen["modes"].get("floor_record_generate")
    if base is None or record is None or "ratio" not in record:
        return []
    forwards = gen["new_tokens"]
    per_forward = base["median_s"] / forwards  # seconds of model.generate per forward call
    parts, floors_used = [], {}
    for mode, target in GENERATION_TARGETS.items():
        row = gen["modes"].get(mode)
        floor_name = GENERATION_FLOORS[mode]
        floor = gen["modes"].get(floor_name)
        if floor is None or "ratio" not in floor:
            floor_name, floor = "floor_record_generate", record
        if row is None or "ratio" not in row:
            continue
        floors_used[floor_name] = floor
        margin = (target - floor["ratio"]) * per_forward * 1000
        spent = (row["ratio"] - floor["ratio"]) * per_forward * 1000
        name = row["label"].replace("TorchLens trace_generate ", "")
        parts.append(
            f"`{name}`'s target of {target:g}× leaves {margin:.1f} ms a forward above its floor "
            f"({floor['ratio']:.2f}×), where TorchLens spends {spent:.1f} ms"
            if margin > 0
            else f"`{name}`'s target of {target:g}× is at or below its floor ({floor['ratio']:.2f}×)"
        )
    if not parts:
        return []
    what = {
        "floor_record_generate": "every op and module call recorded in Python, nothing else: what any "
        "capture whose steps hold every op pays first",
        "floor_keep_generate": "every op and module call recorded, every op output kept and those "
        "the caller can still reach copied after each forward: what keeping them all pays",
    }
    floors = "; ".join(f"{f['ratio']:.2f}× for {what[name]}" for name, f in floors_used.items())
    return [
        "",
        "Each step is a `Trace` with every op of its forward. The floor "
        + ("rows" if len(floors_used) > 1 else "row")
        + f" ({floors}) {'are' if len(floors_used) > 1 else 'is'} read against the targets. "
        + f"Per forward ({_fmt_time(per_forward)} of `model.generate` each): "
        + "; ".join(parts)
        + ".",
    ]


def generation_section(gen: dict) -> str:
    """The Generation section: each mode's median and ratio to `model.generate`, the targets, and
    the bytes each step's trace keeps (prefill, first and last decode step, their growth per step)."""
    m = gen["machine"]
    lines = [
        "## Generation",
        "",
        f"`tl.trace_generate` on {_title(gen['model'], _spec(gen['model']))}: greedy, {gen['new_tokens']} new tokens "
        f"(one prefill and {gen['new_tokens'] - 1} decode forwards), {gen['rounds']} interleaved rounds in one process "
        f"(`python scripts/bench.py --generation {gen['model']} --new-tokens {gen['new_tokens']}`), "
        f"{m['cpus']} CPU cores, {m['torch_threads']} torch thread(s), load average {m['load_at_start'][0]:.2f} at "
        "the start"
        + (f", started {gen['started']}" if gen.get("started") else "")
        + (f", TorchLens commit `{m['torchlens_commit']}`" if m.get("torchlens_commit") else "")
        + ". Ratios are paired per round, to `model.generate` under `no_grad`.",
        "",
        "| Mode | Median | × generate | Target | Kept: prefill | Kept: step 1 | Kept: last step | Growth per step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    memory = [m for m, row in gen["modes"].items() if "peak_growth_bytes" in row or "error" in row]
    for mode, row in gen["modes"].items():
        target = GENERATION_TARGETS.get(mode)
        met = (
            ""
            if target is None
            else f"≤ {target:g}× ({'met' if row['ratio'] <= target else 'not met'})"
        )
        kept = row.get("kept_bytes_per_step")
        cells = ["", "", "", ""]
        if kept:
            growth = (kept[-1] - kept[1]) / (len(kept) - 2) if len(kept) > 2 else 0.0
            cells = [_size(kept[0]), _size(kept[1]), _size(kept[-1]), f"{growth / 1024:.1f} KiB"]
        lines.append(
            f"| {row['label']} | {_fmt_time(row['median_s'])} | {row['ratio']:.2f}× | {met} | "
            + " | ".join(cells)
            + " |"
        )
    lines += _generation_floor(gen)
    if memory:
        lines += [
            "",
            "Memory, each mode in a fresh process after two warm-up calls of `model.generate` (`bench.py`'s",
            "`generation_memory_child`): **peak** is how far the call raised the peak resident set, **held**",
            "what its result holds right after the call, before anything is read. Held counts what the",
            "*kept* columns cannot: a step's pending checks hold their inputs until a facet of theirs is read",
            "(the weights a derived facet is computed from among them, one copy for all the steps while the",
            "weights do not change).",
            "",
            "| Mode | Peak | Held |",
            "| --- | ---: | ---: |",
        ]
        for mode in memory:
            row = gen["modes"][mode]
            if "error" in row:
                cells = ["failed", "failed"]
            else:
                held = row.get("held_trimmed_bytes", row["held_bytes"])
                cells = [f"{_mib(row['peak_growth_bytes'])} MiB", f"{_mib(held)} MiB"]
            lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    nn = gen["modes"].get("nnsight_generate")
    lines += [
        "",
        "A decode step keeps one position per row. What it keeps grows from one step to the next only by",
        "the keys it read: the attention pattern's one row per new token and the joined keys and values,",
        "one position longer each step (the growth column), so `n` kept steps hold `n` times step 1's",
        "bytes plus that growth times about `n²/2`.",
    ]
    if nn is not None and nn["ratio"] < 1:
        lines += [
            "",
            "At this load the timings are noisy: nnsight's generate, which runs the same forwards with its own",
            f"hooks added, measured {nn['ratio']:.2f}× `model.generate`.",
        ]
    lines.append("")
    return "\n".join(lines)


#: The issue's targets for `trace(..., grads=)`, as ratios to a plain forward and backward.
GRADIENT_TARGETS = {"grad_all": 1.3, "grad_resid_post": 1.1}
#: The models the gradient targets name (GPT-2 small at 128 and 1024 tokens).
GRADIENT_TARGET_MODELS = ("L12-T128", "L12-T1024")


def _grad_row(mode: str, row: dict) -> str:
    check = row.get("check")
    diff = (
        "reference"
        if mode == "fb_hooks"
        else "—"
        if check is None
        else f"{check['max_abs_diff']:.1e} (of {check['ref_max_abs']:.2g})"
    )
    if "error" in row:
        mem = ["failed", "", ""]
    else:
        held = row.get("held_trimmed_bytes", row.get("held_bytes"))
        kept = row.get("kept_with_output_bytes", row.get("kept_bytes"))
        mem = [
            _mib(row["peak_growth_bytes"]) if "peak_growth_bytes" in row else "—",
            _mib(held) if held is not None else "—",
            _mib(kept) if kept is not None else "—",
        ]
    return (
        f"| {_label(row['label'])} | {_fmt_time(row['median_s'])} | {row['ratio']:.2f}× | "
        f"{row['cpu_ratio']:.2f}× | {diff} | " + " | ".join(mem) + " |"
    )


def _gradient_targets(models: dict) -> list[str]:
    """The gradient targets, each met or not in this run: time on both the wall-clock and the CPU
    ratio (met only if both are within), peak memory against the plain forward and backward's
    peak plus what the trace keeps."""
    rows = []
    for name in GRADIENT_TARGET_MODELS:
        if name not in models:
            rows.append(
                f"| every target on {_title(name, _spec(name))} | not measured | **not met** |"
            )
            continue
        modes, title = models[name]["modes"], _title(name, models[name]["spec"])
        fb = modes["fb"]
        for mode, limit in GRADIENT_TARGETS.items():
            r = modes.get(mode)
            if r is None:
                continue
            ok = r["ratio"] <= limit and r["cpu_ratio"] <= limit
            rows.append(
                f"| {_label(r['label'])} at most {limit:g}× a plain forward and backward, {title} "
                f"| {r['ratio']:.2f}× (cpu {r['cpu_ratio']:.2f}×) | {'met' if ok else '**not met**'} |"
            )
            kept = r.get("kept_with_output_bytes", r.get("kept_bytes"))
            if "peak_growth_bytes" in r and "peak_growth_bytes" in fb and kept is not None:
                limit_b = fb["peak_growth_bytes"] + kept
                rows.append(
                    f"| {_label(r['label'])} peak at most the plain forward and backward's "
                    f"({_mib(fb['peak_growth_bytes'])} MiB) plus what the trace keeps "
                    f"({_mib(kept)} MiB), {title} | {_mib(r['peak_growth_bytes'])} MiB "
                    f"| {'met' if r['peak_growth_bytes'] <= limit_b else '**not met**'} |"
                )
    return rows


def gradients_section(data: dict) -> str:
    """The Gradients section: each gradient mode's time and memory beside a plain forward and
    backward, TransformerLens's backward hooks and nnsight's `.grad`, the gradient check that
    makes them equal work, and the targets, all from one `bench.py --gradients` run."""
    m = data["machine"]
    names = list(data["models"])
    lines = [
        "## Gradients",
        "",
    ]
    if data.get("smoke"):
        lines += [
            '!!! warning "Smoke run, not the measurement"',
            "    These figures come from a smoke run of the benchmark (few rounds, "
            + ", ".join(f"`{n}`" for n in names)
            + ") on a loaded machine, committed so that the section renders; they are not the",
            "    measurement the targets ask for. Regenerate with "
            "`python scripts/bench.py --gradients L12-T128 L12-T1024 --threads 1 "
            "--mmap-threshold 65536 --json build/gradients.json` and "
            "`python scripts/gen_perf_page.py --gradients build/gradients.json`.",
            "",
        ]
    lines += [
        "`tl.trace(model, ids, save=..., grads=loss)` against a plain forward and backward of the same",
        "loss on the same model, and the peers' ways of keeping gradients, measured in one run",
        f"(`python scripts/bench.py --gradients {' '.join(names)}`, started {data.get('started', '?')}):",
        f"{m['cpus']} CPU cores, {m['torch_threads']} torch thread(s), load average "
        f"{m['load_at_start'][0]:.2f} at the start"
        + (f", TorchLens commit `{m['torchlens_commit']}`" if m.get("torchlens_commit") else "")
        + ".",
        "",
        "- The loss of every mode is the logsumexp of the last position's logits.",
        "- Every model's weights are frozen (`requires_grad_(False)`), as interpretability code has",
        "  them. The baseline, *plain forward + backward*, is `loss(model(ids)).backward()` with the",
        "  outputs of the token and position embeddings made autograd leaves by a forward hook: the",
        "  backward then runs through every layer down to the embeddings and writes no parameter's",
        "  `.grad`, the work TorchLens's backward does for `save='all'` (it takes the gradient at every",
        "  kept tensor and at no weight). Unfrozen weights would add every weight's gradient to the",
        "  baseline, work no mode here needs.",
        "- *Weights made to require grad for the forward (a floor)*, where the run has it: the same",
        "  forward with every frozen weight made to require grad while it runs, then one",
        "  `torch.autograd.grad` of the loss at the embeddings' outputs (no weight gradient asked",
        "  for): the least a design that unfreezes the weights for the traced forward can cost (the",
        "  one TorchLens's `grads=` had before it left them frozen). Autograd then saves every",
        "  weight's other operand (each linear's input) for a weight gradient nobody takes. TorchLens",
        "  leaves the weights frozen and starts the graph at the first ops that read a weight",
        "  together with the input (the embeddings' lookups), as the baseline's forward hook does.",
        "- TorchLens is called under `torch.no_grad()`, as the Gradients guide calls it (`grads=` turns",
        "  autograd on for the trace's own forward). With `save=['resid_post']` its backward stops at",
        "  the first block's output, the earliest tensor it keeps.",
        "- TransformerLens 4.3: the bridge's caching hooks for every hook point, forward and backward",
        "  (`get_caching_hooks(incl_bwd=True)` under `bridge.hooks(...)`, what",
        "  `run_with_cache(incl_bwd=True)` adds), on the bridge booted from its own copy of the model",
        "  (eager attention); its ratio is to the plain forward and backward of the unbooted model.",
        "- nnsight 0.8.1: every block's output read in `model.trace(ids)` and its `.grad` saved inside",
        "  `with loss.backward():`, on its own copy of the model.",
        "- Same work: before the timed rounds, each mode's gradient at the middle block's output is",
        "  compared with a tensor hook's (`register_hook`, the second row) and the run stops on a",
        "  difference above 1e-4 of the largest element; the *check* column is that difference.",
        "- Time: interleaved rounds after a warm-up, median; ratios are paired per round, wall-clock and",
        "  CPU time. Memory: each mode once more in a fresh process, after two plain forwards and",
        "  backwards (*peak*, *held* as above); *kept* is the storage a trace keeps, its gradients and",
        "  its `output` (the logits) included.",
        "",
    ]
    for name in names:
        model = data["models"][name]
        lines += [
            f"### {_title(name, model['spec'])}, {model['rounds']} rounds",
            "",
            f"Checked at `{model['checked_at']}`'s output.",
            "",
            "| Mode | Median | × fwd+bwd | × fwd+bwd (CPU) | check: max difference | Peak MiB "
            "| Held MiB | Kept MiB |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        lines += [_grad_row(mode, row) for mode, row in model["modes"].items()]
        lines.append("")
    lines += [
        "### Targets",
        "",
        "Checked in this run. A time target is met only if both the wall-clock and the CPU-time ratio",
        "are within it.",
        "",
        "| target | this run | |",
        "|---|---:|---|",
    ]
    lines += _gradient_targets(data["models"]) + [""]
    return "\n".join(lines)


def outputs(run: dict, profile: dict | None) -> dict[Path, str]:
    run = dict(run)  # a run cut short lists models it never measured: leave those out, and say so
    planned = [n for key in ("table", "token_sweep", "layer_sweep") for n in run.get(key, [])]
    # what a pass did not measure, the models left out with a reason (`not_measured`) apart
    planned = [n for n in dict.fromkeys(planned) if n not in (run.get("not_measured") or {})]
    run["missing"] = sorted(n for n in planned if n not in run["models"])
    # a later thread count's pass cut short (the run is resumed model by model): what it lacks
    # (the first count's missing models are `missing`; a count not begun has measured none)
    by_threads = run.get("by_threads") or {}
    later = [str(t) for t in (run.get("threads") or [])[1:]]
    run["missing_by_threads"] = {
        t: missing
        for t in later
        if (missing := [n for n in planned if n not in by_threads.get(t, {})])
    }
    for key in ("table", "token_sweep", "layer_sweep"):
        run[key] = [n for n in run.get(key, []) if n in run["models"]]
    run["models"] = {n: _pypi_checked(m) for n, m in run["models"].items()}
    charts = {"performance.svg": bar_chart(run), **sweep_charts(run)}
    out = {ASSETS / name: text for name, text in charts.items()}
    page = render(run, profile, list(charts))
    if GENERATION.exists():
        page += "\n" + generation_section(json.loads(GENERATION.read_text()))
    if GRADIENTS.exists():
        page += "\n" + gradients_section(json.loads(GRADIENTS.read_text()))
    if PAGE.exists():  # a hand-written section appended after the marker is kept as it is
        old = PAGE.read_text(encoding="utf-8")
        if APPENDED in old:
            page += "\n" + old[old.index(APPENDED) :]
    out[PAGE] = page
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", help="a bench.py --json result to copy into the docs and render")
    parser.add_argument("--profile", help="a bench.py --profile --json result to copy and render")
    parser.add_argument(
        "--generation", help="a bench.py --generation --json result to copy and render"
    )
    parser.add_argument(
        "--gradients", help="a bench.py --gradients --json result to copy and render"
    )
    parser.add_argument(
        "--check", action="store_true", help="report stale files instead of writing them"
    )
    args = parser.parse_args(argv)
    if args.check and (args.run or args.profile or args.generation or args.gradients):
        parser.error(
            "--check renders the committed data; it takes no --run/--profile/--generation/--gradients"
        )
    if args.gradients:
        shutil.copyfile(args.gradients, GRADIENTS)
    if args.generation:
        shutil.copyfile(args.generation, GENERATION)
    if args.run:
        shutil.copyfile(args.run, RUN)
    if args.profile:
        shutil.copyfile(args.profile, PROFILE)
    run = json.loads(RUN.read_text())
    profile = json.loads(PROFILE.read_text()) if PROFILE.exists() else None
    return write_or_check(
        outputs(run, profile), args.check, ROOT, "python scripts/gen_perf_page.py"
    )


if __name__ == "__main__":
    sys.exit(main())

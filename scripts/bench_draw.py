"""Time `Trace.draw` on a GPT-2-small-shaped trace: rolled, unrolled, and the layout engine alone.

GPT-2 small's shape (12 layers, d_model 768, 12 heads) with random weights
(`transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12)`, seeded), traced with `save="none"`
on 8 tokens: the drawing reads only the records, so what the trace saved does not matter. Each
drawing is made `--repeat` times in this process and the best time is reported, with Graphviz's
share (`Drawing.layout_seconds`). A wider sweep (`--layers 24 48 96`, d_model 64) shows how the
layout grows with the number of nodes, which is what `torchlens._draw.MAX_NODES` is set from.

Usage:
    python scripts/bench_draw.py                 # GPT-2 small, rolled and unrolled
    python scripts/bench_draw.py --layers 24 48  # also unrolled GPT-2s that deep (d_model 64)
"""

from __future__ import annotations

import argparse
import time

import torch


def gpt2(n_layer: int, n_embd: int, n_head: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head)
    return transformers.GPT2LMHeadModel(config).eval()


def best(fn, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main(argv: list[str] | None = None) -> int:
    import torchlens as tl

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--layers", type=int, nargs="*", default=[], help="also time unrolled GPT-2s this deep"
    )
    args = parser.parse_args(argv)
    ids = torch.arange(8).unsqueeze(0)
    trace = tl.trace(gpt2(12, 768, 12), ids, save="none")
    print(f"GPT-2 small shape: {len(trace.ops)} ops, {len(trace.modules)} modules")
    for label, kw in (
        ("rolled", {}),
        ("rolled, highlight='facets'", {"highlight": "facets"}),
        ("unrolled", {"rolled": False}),
        ("unrolled, depth=2", {"rolled": False, "depth": 2}),
    ):
        seconds, d = best(lambda kw=kw: trace.draw(**kw), args.repeat)
        print(f"  {label:28} {seconds:6.2f} s  (Graphviz {d.layout_seconds:5.2f} s)  {d!r}")
    for n in args.layers:
        t = tl.trace(gpt2(n, 64, 4), ids, save="none")
        seconds, d = best(lambda t=t: t.draw(rolled=False, max_nodes=None), 1)
        print(
            f"  {n} layers, d 64, unrolled: {len(t.ops)} ops, {seconds:6.2f} s  (Graphviz {d.layout_seconds:5.2f} s)  "
            f"{d!r}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

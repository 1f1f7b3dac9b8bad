"""Time `compare`'s mismatch diagnosis on a GPT-2-small-shaped trace.

Model: a random-init `transformers.GPT2LMHeadModel` with GPT-2 small's shape (12 layers,
d_model 768, 12 heads, vocab 50257), float32 on the CPU, 128 tokens, traced with `save="all"`.
Nothing is downloaded.

Measured (median of `--rounds` runs, after one warm-up that also builds the per-trace pool of
tensor statistics), through the public API only:

- `pool`: the first diagnosis on a trace indexes every saved tensor by shape, and stacks the
  tensors of each shape it needs into one matrix (norms, means, dot products). Timed as the
  first one-mismatch `compare` on a fresh trace minus the median of the later ones (one cold
  call per trace, so one sample).
- `one mismatch`: `compare` of one name whose tensor is wrong (`blocks.3.hook_attn_out` handed
  the residual after the attention add), explanation included.
- `one mismatch, no match`: the same name handed random noise (nothing matches, so every
  search runs to the end: scale fits and sums of two sites included).
- `150 sites, 20 mismatches`: a report over 150 readable 2.x names, 20 of them given wrong
  tensors of several classes (residual included, neighbouring layer, after the norm, scale
  factor, head-major, noise).
- `150 sites, 20 mismatches, explain=False`: the same report without the search, for scale.

Usage:
    python scripts/bench_diagnosis.py                 # prints a Markdown table
    python scripts/bench_diagnosis.py --rounds 5 --json build/bench-diagnosis.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import transformers

import torchlens as tl
import torchlens.mechinterp as mi


def build(tokens: int):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    return model, ids


def values(trace, n_sites: int = 150, n_wrong: int = 20) -> dict:
    """150 readable 2.x names with the trace's own tensors, 20 of them replaced by wrong ones."""
    names = [r.query for r in mi.alias_report(trace, generation="2.x") if r.readable][:n_sites]
    out = {n: mi.resolve_alias(trace, n, generation="2.x").tensor for n in names}
    m = trace.modules
    gen = torch.Generator().manual_seed(1)
    wrong = []
    for layer in range(12):
        b = f"transformer.h.{layer}"
        wrong += [
            (f"blocks.{layer}.hook_attn_out", m[b].facets["resid_mid"]),  # residual included
            (
                f"blocks.{layer}.hook_resid_post",
                m[f"transformer.h.{(layer + 1) % 12}"].facets["resid_post"],
            ),
            (f"blocks.{layer}.hook_resid_pre", m[b + ".ln_1"].facets["output"]),  # after the norm
            (f"blocks.{layer}.hook_mlp_out", 0.5 * m[b + ".mlp"].facets["output"]),  # scale factor
            (
                f"blocks.{layer}.attn.hook_q",
                m[b + ".attn"].facets["q"].transpose(1, 2),
            ),  # head-major
        ]
    wrong = [(n, v) for n, v in wrong if n in out][: n_wrong - 2]
    for n, v in wrong:
        out[n] = v
    taken = {n for n, _ in wrong}
    for n in [
        n for n, v in out.items() if n not in taken and v.is_floating_point() and v.dim() == 3
    ][:2]:
        out[n] = torch.randn(out[n].shape, generator=gen)  # noise: no match
    return out


def median_s(fn, rounds: int) -> tuple[float, float]:
    """Median wall time and median CPU time of this process (the second is what a busy machine
    does not inflate)."""
    wall, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads (default: torch's choice)"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, ids = build(args.tokens)
    t0 = time.perf_counter()
    trace = tl.trace(model, ids, save="all")
    trace_s = time.perf_counter() - t0

    attn_mid = trace.modules["transformer.h.3"].facets["resid_mid"]
    one = {"blocks.3.hook_attn_out": attn_mid}
    noise = {
        "blocks.3.hook_attn_out": torch.randn(
            attn_mid.shape, generator=torch.Generator().manual_seed(2)
        )
    }
    cold_s = median_s(lambda: mi.compare(trace, one, generation="2.x"), 1)  # builds the pool
    first = mi.compare(trace, one, generation="2.x")
    warm_s = median_s(lambda: mi.compare(trace, one, generation="2.x"), args.rounds)
    pool_s = (cold_s[0] - warm_s[0], cold_s[1] - warm_s[1])
    report_values = values(trace)
    report = mi.compare(trace, report_values, generation="2.x")
    rows = [
        ("pool (once per trace: first call minus a later one)", pool_s),
        ("one mismatch (first call, pool included)", cold_s),
        ("one mismatch", warm_s),
        (
            "one mismatch, no match",
            median_s(lambda: mi.compare(trace, noise, generation="2.x"), args.rounds),
        ),
        (
            f"{len(report)} sites, {len(report.mismatched)} mismatches",
            median_s(lambda: mi.compare(trace, report_values, generation="2.x"), args.rounds),
        ),
        (
            f"{len(report)} sites, {len(report.mismatched)} mismatches, explain=False",
            median_s(
                lambda: mi.compare(trace, report_values, generation="2.x", explain=False),
                args.rounds,
            ),
        ),
    ]
    print(
        f"GPT-2-small shape, {args.tokens} tokens, random init, float32, CPU; {len(trace.ops)} ops; "
        f"trace(save='all') took {trace_s:.2f} s; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(f"example explanation: {first[0].explanation}")
    explained = sum(bool(c.explanation) for c in report if not c.passed)
    print(f"report: {explained}/{len(report.mismatched)} mismatches explained; first three:")
    for c in [c for c in report if not c.passed][:3]:
        print(f"  {c.name}: {c.explanation}")
    print()
    print("| what | median wall | median CPU time |")
    print("|---|---:|---:|")
    for what, (wall, cpu) in rows:
        print(f"| {what} | {wall * 1000:.0f} ms | {cpu * 1000:.0f} ms |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "tokens": args.tokens,
                    "rounds": args.rounds,
                    "ops": len(trace.ops),
                    "rows": {w: {"wall_s": a, "cpu_s": b} for w, (a, b) in rows},
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()

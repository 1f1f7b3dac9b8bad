"""Benchmark TorchLens capture against a plain forward pass and the alternatives.

Two models, random weights, float32 on CPU:

- `gpt2-small`: GPT-2 small's shape (12 layers, d_model 768, 12 heads), 128 tokens.
- `tiny`: a 2-layer GPT-2 (d_model 32, 2 heads), 4 tokens.

Timing: every mode runs in one process, interleaved round by round after a warm-up, and the
median of the rounds is reported. Memory: each mode runs once more in a fresh subprocess, and
the growth of the peak resident set over a plain forward is reported beside the bytes the trace
keeps.

Usage:
    python scripts/bench.py                       # print a table
    python scripts/bench.py --json build/bench.json --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import transformers

import torchlens as tl

SHAPES = {
    "gpt2-small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, tokens=128),
    "tiny": dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, tokens=4),
}


def build(shape: str):
    spec = dict(SHAPES[shape])
    tokens = spec.pop("tokens")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**spec)).eval()
    ids = torch.randint(0, spec["vocab_size"], (1, tokens))
    return model, ids


def hooks_forward(model, ids):
    """What a user writes by hand: a forward hook on every module keeping a detached output."""
    kept, handles = {}, []

    def keep(name):
        def hook(mod, args, out):
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor):
                kept[name] = t.detach().clone()
        return hook

    for name, mod in model.named_modules():
        handles.append(mod.register_forward_hook(keep(name)))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return kept


def nnsight_forward(engine, model, ids):
    """nnsight reading every block's input and output (the seed's pattern, all blocks)."""
    saved = []
    with engine.trace(ids):
        for block in engine.transformer.h:
            saved.append(block.input.save())
            saved.append(block.output.save())
    return saved


def modes(model, ids):
    out = {
        "plain forward": lambda: model(ids),
        "trace save='all'": lambda: tl.trace(model, ids, save="all"),
        "trace save='none'": lambda: tl.trace(model, ids, save="none"),
        "trace save=['resid_post']": lambda: tl.trace(model, ids, save=["resid_post"]),
        "forward hooks on every module": lambda: hooks_forward(model, ids),
    }
    try:
        from nnsight import NNsight

        engine = NNsight(model)
        out["nnsight (block in+out)"] = lambda: nnsight_forward(engine, model, ids)
    except ImportError:
        pass
    return out


def time_modes(shape: str, rounds: int) -> dict[str, float]:
    model, ids = build(shape)
    fns = modes(model, ids)
    with torch.no_grad():
        for fn in fns.values():  # warm-up
            fn()
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def saved_bytes(trace) -> int:
    """Bytes of distinct storage the trace keeps alive (ops and facets)."""
    seen, total = set(), 0
    tensors = [t for op in trace.ops for t in op.tensors if t is not None]
    tensors += [s.tensor for r in trace.modules.values() for c in r.calls for s in c.facets.sites.values()
                if s.tensor is not None]
    for t in tensors:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def _rss(field: str) -> int:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(shape: str, mode: str) -> dict:
    """Run in a subprocess: how far one run of `mode` raises the resident set.

    The peak counter is reset (`/proc/self/clear_refs`) after the model is built and has run
    twice, so the reported peak is that of the measured run alone.
    """
    model, ids = build(shape)
    with torch.no_grad():
        model(ids)
        model(ids)
    base = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    with torch.no_grad():
        result = modes(model, ids)[mode]()
    peak = _rss("VmHWM") - base
    held = _rss("VmRSS") - base
    kept = saved_bytes(result) if isinstance(result, tl.Trace) else None
    return {"peak_growth_bytes": peak, "held_bytes": held, "kept_bytes": kept}


def memory(shape: str, mode: str) -> dict:
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import bench, json; " \
           f"print(json.dumps(bench.memory_child({shape!r}, {mode!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark TorchLens capture.")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args(argv)
    results = {
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__, "torchlens": tl.__version__},
        "rounds": args.rounds,
        "shapes": {},
    }
    for shape in args.shapes:
        times = time_modes(shape, args.rounds)
        plain = times["plain forward"]
        rows = {name: {"median_s": t, "ratio": t / plain} for name, t in times.items()}
        if not args.no_memory:
            for name in ("plain forward", "trace save='all'", "trace save='none'", "forward hooks on every module"):
                rows[name].update(memory(shape, name))
        results["shapes"][shape] = rows
        print(f"\n{shape} ({SHAPES[shape]['n_layer']} layers, d={SHAPES[shape]['n_embd']}, "
              f"{SHAPES[shape]['tokens']} tokens), median of {args.rounds}")
        for name, row in rows.items():
            mem = ""
            if "peak_growth_bytes" in row:
                mem = f"  peak +{row['peak_growth_bytes'] / 2**20:7.1f} MiB"
                if row.get("kept_bytes") is not None:
                    mem += f"  kept {row['kept_bytes'] / 2**20:7.1f} MiB"
            print(f"  {name:32s} {row['median_s'] * 1e3:9.2f} ms  {row['ratio']:5.2f}x{mem}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark TorchLens capture against a plain forward pass and the alternatives, side by side.

Models: random-weight GPT-2s (`transformers.GPT2LMHeadModel`), float32 on CPU, built from a
config with a fixed seed (nothing is downloaded):

- `tiny`: 2 layers, d_model 32, 2 heads, 4 tokens.
- `L{layers}-T{tokens}`: GPT-2 small's width (d_model 768, 12 heads, vocab 50257) with that many
  layers and tokens; `L12-T128` and `L12-T1024` are GPT-2 small at 128 and 1024 tokens.

Timing: for each model, every mode runs in ONE process, interleaved round by round after a
warm-up, and the median of the rounds is reported; the ratio is to the plain forward of the same
rounds. The PyPI package also named `torchlens` (2.36.1, a different project) cannot share the
process with this one, so it runs in its own process and virtual environment
(`--pypi-python`), timed against a plain forward interleaved in that process.

Memory: each mode runs once more in a fresh subprocess. After the model has run twice (plain
forwards), freed heap is returned to the system (`malloc_trim`) and the peak counter is reset
(`/proc/self/clear_refs`); the growth of the peak resident set (VmHWM) over the resident set
before the run is reported, then what is still resident while the result is alive (after another
`malloc_trim`), with the bytes of tensor storage a trace keeps. glibc's adaptive mmap threshold
lets freed tensors stay in the heap, so a peak can vary by about 100 MiB between runs of one mode;
`--mmap-threshold 65536` fixes it for the memory children, making peaks repeatable.

Grad modes: every in-process mode runs twice in the same rounds, under `torch.no_grad()` (its
plain name, `all`) and with autograd on, as the docs call `tl.trace` (`all+grad`); each ratio is
to the plain forward in the same grad mode, and `grad_over_no_grad` is the median over the
rounds of a mode's time with autograd over its time without (`--grad off|on|both`).

Threads: the whole plan runs once per `--threads` count (default 1, then 2), in the same process;
the first count's results are the top-level `models` (what `gen_perf_page.py` always read), every
count's are under `by_threads`. Memory is measured for the first count only.

Times: wall-clock seconds (`samples`, `median_s`, `ratio`) and, beside them, the process's CPU
seconds over the same calls (`cpu_samples`, `cpu_ratio`), which a loaded machine disturbs less.

Modes:
    plain: `model(ids)` (under `torch.no_grad()`, or with autograd for `plain+grad`).
    all, none: `torchlens.trace(model, ids, save=...)`.
    resid_post, modlist, output: module-level `save=` lists (`["resid_post"]`,
        `["resid_pre", "resid_post", "logits"]`, `["output"]`: every module's output, what the
        `hooks` baseline keeps); pattern, qkvz: lists of op-level facets (`["pattern"]`,
        `["q", "k", "v", "z"]`).
    tl_cache: TransformerLens 4.x `TransformerBridge.run_with_cache(ids)` on a bridge booted
        from its own copy of the same random-init model (`boot_transformers(..., hf_model=copy)`).
        Booting changes that copy in place: it switches it to eager attention and replaces its
        submodules by the bridge's components (34 modules become 152 on `tiny`, hook points
        included). Its `ratio` is to the plain forward of the unbooted model (GPT-2's default sdpa
        attention: the model a user has); `ratio_to_booted_plain` is to `plain_booted`.
    plain_booted, all_booted: the plain forward and `trace(save="all")` of that booted copy (what
        `model(ids)` runs once `boot_transformers(..., hf_model=model)` has changed `model`), each
        with `ratio_to_booted_plain`: the second TransformerLens setup, where every ratio is to
        the booted model's forward.
    nnsight: nnsight `NNsight(model).trace(ids)` saving every module's output.
    hooks: a forward hook on every module keeping a clone of its output.
    floor_pass, floor_keep: the floors of any capture that sees every op through a
        `TorchFunctionMode`, as TorchLens does: a mode that only passes each op through, and one
        that also keeps a reference to every op output (the memory `save="all"` must hold, with
        none of the bookkeeping). `save="none"` cannot cost less than `floor_pass`, nor
        `save="all"` less than `floor_keep`, on the same model in the same rounds.
    floor_record: (only when named with `--modes`) a mode and module hooks that record each op's
        function, argument ids, output id, shape and dtype, and the module running, and nothing
        else: the least any capture that records the op graph and the module calls in Python
        does, with no reference resolved, no version taken, nothing kept or assembled.
    pypi: PyPI `torchlens` 2.36.1 `trace(model, ids)` (its default saves every layer's output).

Gradients (`--gradients MODEL...`, its own JSON and its own section of the page): every model's
weights frozen, the loss the logsumexp of the last position's logits (`last_logsumexp`).
    fb: the plain forward and backward, `loss(model(ids)).backward()`, with the embeddings' outputs
        made autograd leaves (`_embedding_leaves`): the backward runs down to the embeddings and
        writes no parameter's `.grad`, the work TorchLens's backward does for `save="all"`.
    fb_hooks: the same with a tensor hook (`register_hook`) keeping each block output's gradient:
        the reference every other mode's gradient at the middle block's output is checked against
        before the timed rounds (the run stops on a mismatch).
    fb_unfrozen: the floor of the design that makes the frozen weights require grad for the
        forward (TorchLens's `grads=` before its first activations became the leaves): every
        floating parameter requires grad during the forward, then one `torch.autograd.grad` of
        the loss with respect to the embeddings' outputs (no weight gradient asked for). Not
        checked against the hooks (its gradients are at the embeddings).
    grad_all, grad_resid_post: `trace(model, ids, save=..., grads=loss)` under `torch.no_grad()`.
    tl_bwd: TransformerLens 4.x, the bridge's caching hooks for every hook point forward and
        backward (`get_caching_hooks(incl_bwd=True)` under `bridge.hooks(...)`).
    nnsight_grad: nnsight, every block's output read in the trace and its `.grad` saved inside
        `with loss.backward():`.

The working tree may be in flux; to measure one commit, export it and say which:

    git archive HEAD src | tar -x -C build/bench-src
    BENCH_COMMIT=$(git rev-parse --short HEAD) PYTHONPATH=build/bench-src/src python scripts/bench.py ...

Usage:
    python scripts/bench.py --json build/bench.json                  # the full run
    python scripts/bench.py --json build/bench.json --resume         # go on with it after a cut
    python scripts/bench.py --models tiny --rounds 3                 # a quick look
    python scripts/bench.py --models tiny L12-T128 --modes none resid_post --threads 1   # a few modes
    python scripts/bench.py --profile L12-T1024 --json build/profile.json   # where save="all" spends
    python scripts/bench.py --models tiny --threads 1 --grad on --modes all tl_cache   # autograd only
    python scripts/bench.py --gradients L12-T128 L12-T1024 --threads 1 --json build/gradients.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import os
import platform
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import weakref

import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_PYPI_PYTHON = os.path.join(ROOT, "build", "pypi-torchlens", "venv", "bin", "python")

#: What each mode is called on the page.
LABELS = {
    "plain": "plain forward (no_grad)",
    "all": "TorchLens save='all'",
    "none": "TorchLens save='none'",
    "resid_post": "TorchLens save=['resid_post']",
    "modlist": "TorchLens save=['resid_pre','resid_post','logits']",
    "output": "TorchLens save=['output'] (every module)",
    "pattern": "TorchLens save=['pattern']",
    "qkvz": "TorchLens save=['q','k','v','z']",
    "tl_cache": "TransformerLens 4.3 run_with_cache",
    "plain_booted": "plain forward of the model booted into TransformerLens",
    "all_booted": "TorchLens save='all' of the model booted into TransformerLens",
    "nnsight": "nnsight, every module's output saved",
    "hooks": "forward hook on every module (clone)",
    "pypi": "PyPI torchlens 2.36.1 (own process)",
    "all_dir": "TorchLens save='all', store=<directory>",
    "floor_pass": "floor: a torch function mode passing every op through",
    "floor_keep": "floor: a torch function mode keeping every op output",
    "floor_copy": "floor: keeping every op output, copying what the caller holds",
    "floor_record": "floor: recording every op and module call in Python, nothing else",
}
#: The suffix of a mode run with autograd on (`all+grad`), and how its label says so.
GRAD = "+grad"
GRAD_LABEL = " (autograd on)"
#: The `save=` argument of each TorchLens mode.
SAVES = {
    "all": "all",
    "none": "none",
    "resid_post": ["resid_post"],
    "modlist": ["resid_pre", "resid_post", "logits"],
    "output": ["output"],
    "pattern": ["pattern"],
    "qkvz": ["q", "k", "v", "z"],
}
#: Modes whose `ratio_to_booted_plain` is also reported (to `plain_booted`, same grad mode).
BOOTED_REF = ("tl_cache", "all_booted", "plain_booted")
#: `--mmap-threshold`: glibc's MALLOC_MMAP_THRESHOLD_ for the memory children (None: glibc's default).
MMAP_THRESHOLD: list[int | None] = [None]
#: Where the directory-store mode writes (removed after each memory run).
STORE_ROOT = os.path.join(ROOT, "build", "bench-store")
SETTLE = [False]  # --settle: a cold heap before every timed call (see `time_modes`)
IN_PROCESS = [
    "plain",
    "all",
    "none",
    "resid_post",
    "modlist",
    "output",
    "pattern",
    "qkvz",
    "tl_cache",
    "nnsight",
    "hooks",
    "floor_pass",
    "floor_keep",
    "floor_copy",
    "plain_booted",
    "all_booted",
]

#: In-process modes a run has only when `--modes` names them (not on the page).
ONLY_NAMED = ["floor_record"]

#: The side-by-side table: every mode.
TABLE_MODELS = ["tiny", "L12-T128", "L12-T1024", "L12-T2048"]
#: The scaling plots: fewer modes, more sizes.
TOKEN_SWEEP = ["L12-T128", "L12-T256", "L12-T512", "L12-T1024", "L12-T2048"]
LAYER_SWEEP = ["L2-T128", "L6-T128", "L12-T128", "L24-T128"]
SWEEP_MODES = ["plain", "all", "none", "resid_post", "tl_cache", "hooks"]
#: Modes left out above 1024 tokens: the targets name the save= lists at 128 and 1024 tokens and
#: the booted TransformerLens setup on the tiny model, and every mode in both grad modes at 2048
#: tokens in one process needs more than 24 GiB (each trace there keeps about 9 GiB).
BIG_SKIP = {"modlist", "output", "pattern", "qkvz", "plain_booted", "all_booted", "floor_pass"}
#: Modes whose memory is also measured with autograd on (the memory children take time).
MEMORY_GRAD_MODES = {"plain", "all", "none", "resid_post", "tl_cache", "nnsight", "hooks"}


def spec(name: str) -> dict:
    """The GPT-2 config and token count a model name stands for."""
    if name == "tiny":
        return dict(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, tokens=4)
    m = re.fullmatch(r"L(\d+)-T(\d+)", name)
    if not m:
        raise SystemExit(
            f"unknown model {name!r}: use 'tiny' or L<layers>-T<tokens>, e.g. L12-T1024"
        )
    layers, tokens = int(m[1]), int(m[2])
    return dict(
        n_layer=layers,
        n_embd=768,
        n_head=12,
        vocab_size=50257,
        n_positions=max(1024, tokens),
        tokens=tokens,
    )


def build(name: str):
    """A random-init GPT-2 (seed 0) in eval mode and its input ids (seed 1)."""
    s = dict(spec(name))
    tokens = s.pop("tokens")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**s)).eval()
    ids = torch.randint(0, s["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(1))
    return model, ids


def _forward_order(model, ids) -> list[str]:
    """Module addresses in the order their forwards finish (the order nnsight must read them)."""
    order, handles = [], []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_hook(lambda m, a, o, n=name: order.append(n)))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return order


def hooks_forward(model, ids):
    """What a user writes by hand: a forward hook on every module keeping a clone of its output."""
    kept, handles = {}, []

    def keep(name):
        def hook(mod, args, out):
            t = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
            if isinstance(t, torch.Tensor):
                kept[name] = t.detach().clone()

        return hook

    for name, mod in model.named_modules():
        handles.append(mod.register_forward_hook(keep(name)))
    try:
        model(ids)  # in the caller's grad mode
    finally:
        for h in handles:
            h.remove()
    return kept


@contextlib.contextmanager
def _collector_off():
    """Python's cyclic garbage collector off for a floor's call, and back as it was: a trace
    pauses it (`torchlens._capture.collector`), so any capture design may, and a floor that kept
    the collector's passes would not be the least such a capture pays. Not `paused` itself: this
    script also measures commits whose source has no `torchlens._capture.collector`."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _FloorMode(torch.overrides.TorchFunctionMode):
    """The floor of op capture: every torch function runs through the mode and nothing else is
    done, or (`keep`) a reference to each result is appended to a list."""

    def __init__(self, keep: bool):
        super().__init__()
        self.kept: list | None = [] if keep else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.kept is not None:
            self.kept.append(out)
        return out


def floor_forward(model, ids, keep: bool, copy: bool = False):
    """A plain forward under `_FloorMode` in the caller's grad mode; returns what the mode kept
    (None when it kept nothing), each kept output detached (as any capture keeps it, so the
    floor records no autograd history of its own).

    With `copy`, the kept outputs that share memory with what the caller still holds afterwards
    (the returned logits and KV cache) are replaced by copies, as a capture must that no later
    write by the caller changes: the floor of a `save="all"` that keeps that promise.
    """
    mode = _FloorMode(keep)
    with _collector_off(), mode:
        out = model(ids)
    if mode.kept is not None:
        mode.kept = [o.detach() if isinstance(o, torch.Tensor) else o for o in mode.kept]
    if copy and mode.kept is not None:
        held = {t.untyped_storage().data_ptr() for t in _tensors_in(out)}
        with torch.no_grad():
            mode.kept = [
                o.clone()
                if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in held
                else o
                for o in mode.kept
            ]
    return mode.kept


class _RecordMode(torch.overrides.TorchFunctionMode):
    """The floor of recording the op graph in Python: for each op with a tensor output, one tuple
    (function, the ids of its tensor arguments, its output's id, shape and dtype, the module
    running), appended to a list; nothing else (no references resolved, no versions, no tensor
    kept, nothing assembled)."""

    def __init__(self):
        super().__init__()
        self.ops: list = []
        self.stack: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            ins = [id(a) for a in args if isinstance(a, torch.Tensor)]
            where = self.stack[-1] if self.stack else None
            self.ops.append((func, ins, id(out), out.shape, out.dtype, where))
        return out


def record_forward(model, run, mode: _RecordMode | None = None):
    """`run()` under `_RecordMode` (or `mode`, one made from it), with a pre- and a post-hook on
    every module keeping the stack of module calls and a list of them: the least any capture that
    records every op and module call of a forward in Python does (`floor_record`,
    `floor_record_generate`). Returns the mode."""
    mode, handles = mode if mode is not None else _RecordMode(), []

    def pre(module, args):
        mode.stack.append(module)

    def post(module, args, out):
        mode.stack.pop()

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        with _collector_off(), mode:
            run()
    finally:
        for h in handles:
            h.remove()
    return mode


class _KeepMode(_RecordMode):
    """`_RecordMode` that also keeps every tensor an op returns (alone, or in a tuple or list, as a
    `split` returns them), detached, beside a weak reference to the tensor the model got
    (`keep_generate`)."""

    def __init__(self):
        super().__init__()
        self.kept: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.kept.append((weakref.ref(t), t.detach()))
        return out


def _copied(kept: list, live: set) -> list:
    """`kept` with each tensor whose storage is in `live` replaced by a copy: one copy of the
    storage serves all its kept views where that costs no more than copying each (as
    `torchlens._capture.snapshot` copies), else each view is copied."""
    by_storage: dict[int, list] = {}
    for t in kept:
        ptr = t.untyped_storage().data_ptr()
        if ptr in live:
            by_storage.setdefault(ptr, []).append(t)
    swap: dict[int, torch.Tensor] = {}
    for views in by_storage.values():
        storage = views[0].untyped_storage()
        if len(views) > 1 and storage.nbytes() <= sum(v.numel() * v.element_size() for v in views):
            new, bases = storage.clone(), {}
            for v in views:
                if v.dtype not in bases:
                    bases[v.dtype] = torch.empty(0, dtype=v.dtype).set_(new, 0, (0,), (1,))
                swap[id(v)] = bases[v.dtype].as_strided(v.size(), v.stride(), v.storage_offset())
        else:
            swap.update({id(v): v.clone() for v in views})
    return [swap.get(id(t), t) for t in kept]


def keep_generate(model, run):
    """`run()` under `_KeepMode` with `record_forward`'s module hooks, and at the end of each
    forward call of the root (a prefill or a decode step) a copy of every kept output whose
    memory the caller can still reach: the storage of a parameter, buffer or input, or of a
    tensor the model made that is still alive (the KV cache, the logits). The least a capture
    pays that keeps every op output of every step and copies, once the step's forward is over,
    what the caller could still write into (`floor_keep_generate`): nothing resolved, checked or
    assembled, and no copy before a write during the forward. Returns the steps' kept tensors."""
    mode, steps = _KeepMode(), []

    def step_end(module, args, kwargs, out):
        with torch._C.DisableTorchFunction(), torch.no_grad():  # the floor's own calls: unrecorded
            held = [*model.parameters(), *model.buffers(), *_tensors_in((args, kwargs))]
            held += [t for ref, _ in mode.kept if (t := ref()) is not None]
            live = {t.untyped_storage().data_ptr() for t in held}
            steps.append(_copied([t for _, t in mode.kept], live))
        mode.kept = []

    handle = model.register_forward_hook(step_end, with_kwargs=True)
    try:
        record_forward(model, run, mode)
    finally:
        handle.remove()
    return steps


def _stored(site):
    """The tensor a facet site holds now, computing nothing (`FacetSite._value`; an instance
    dictionary's `"tensor"` in a TorchLens commit from before sites were slotted, which
    `BENCH_COMMIT` may measure)."""
    if hasattr(type(site), "_value"):
        return site._value
    return site.__dict__.get("tensor")


def _tensors_in(value, depth: int = 0) -> list:
    """The tensors in a model output (tensors, containers, `ModelOutput`s and a KV cache's layers)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 6:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    elif hasattr(value, "layers") and not isinstance(value, (list, tuple)):  # a transformers Cache
        value = [
            x
            for layer in value.layers
            for x in (getattr(layer, "keys", None), getattr(layer, "values", None))
        ]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v, depth + 1)]
    return []


def _nnsight(name: str):
    """nnsight wrapping its own copy of the model, saving every module's output."""
    from nnsight import NNsight

    model, ids = build(name)
    order = _forward_order(model, ids)
    engine = NNsight(model)
    envoys = []
    for path in order:
        e = engine
        for part in path.split(".") if path else []:
            e = e[int(part)] if part.isdigit() else getattr(e, part)
        envoys.append(e)

    def run():
        saved = []
        with engine.trace(ids):  # in the caller's grad mode
            for e in envoys:
                saved.append(e.output.save())
        return saved

    return run, lambda: model(ids)


def _tl_cache(name: str):
    """TransformerLens 4.x's bridge booted from its own copy of the same random-init model:
    `(run_with_cache, the bridge's forward, the booted copy)`."""
    bridge, model, ids = _boot_bridge(name)

    def run():  # in the caller's grad mode
        return bridge.run_with_cache(ids)

    def plain():
        return bridge(ids)

    return run, plain, model


def _boot_bridge(name: str):
    """`(bridge, the booted copy, ids)`: TransformerLens 4.x's `TransformerBridge` booted from its
    own copy of the model `build(name)` gives (`boot_transformers(..., hf_model=copy)`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformer_lens.model_bridge import TransformerBridge

    model, ids = build(name)
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, "<pad>": 3, **{f"t{i}": i for i in range(4, 64)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
    )
    with tempfile.TemporaryDirectory() as tokdir, contextlib.redirect_stdout(sys.stderr):
        tok.save_pretrained(tokdir)  # boot reloads the tokenizer from its name_or_path
        bridge = TransformerBridge.boot_transformers(tokdir, hf_model=model, device="cpu")
    return bridge, model, ids


def _store_dir() -> str:
    os.makedirs(STORE_ROOT, exist_ok=True)
    return tempfile.mkdtemp(prefix="tl-store-", dir=STORE_ROOT)


def make_modes(name: str, wanted: list[str], with_plain: bool = False) -> dict:
    """Callables for the in-process modes in `wanted` (each mode that wraps a model gets its own).

    With `with_plain`, each value is `(run, plain)`: `plain` is a plain forward of the model
    `run` uses (the memory baseline).
    """
    import torchlens as tl

    model, ids = build(name)
    plain = lambda: model(ids)
    fns = {
        "plain": plain,
        **{
            mode: (lambda s: lambda: tl.trace(model, ids, save=s))(save)
            for mode, save in SAVES.items()
        },
        "hooks": lambda: hooks_forward(model, ids),
        "all_dir": lambda: tl.trace(model, ids, save="all", store=_store_dir()),
        "floor_pass": lambda: floor_forward(model, ids, keep=False),
        "floor_keep": lambda: floor_forward(model, ids, keep=True),
        "floor_copy": lambda: floor_forward(model, ids, keep=True, copy=True),
        "floor_record": lambda: record_forward(model, lambda: model(ids)),
    }
    booted = None
    if any(m.endswith("_booted") or m == "tl_cache" for m in wanted):
        run, bridge_plain, booted = _tl_cache(
            name
        )  # one bridge: run_with_cache and its booted model
        fns["tl_cache"] = run
        fns["plain_booted"] = lambda: booted(ids)
        fns["all_booted"] = lambda: tl.trace(booted, ids, save="all")
    out = {}
    for mode in wanted:
        if mode.endswith(GRAD):  # the same callable, run with autograd on
            continue
        if mode == "tl_cache":
            out[mode] = (fns[mode], bridge_plain)
        elif mode == "nnsight":
            out[mode] = _nnsight(name)
        elif mode in fns:
            out[mode] = (fns[mode], fns["plain_booted"] if mode.endswith("_booted") else plain)
        if mode in out and not with_plain:
            out[mode] = out[mode][0]
    return out


def grad_of(mode: str) -> bool:
    """Whether `mode` (a mode name, `+grad` for autograd on) runs with autograd."""
    return mode.endswith(GRAD)


def base_of(mode: str) -> str:
    return mode[: -len(GRAD)] if mode.endswith(GRAD) else mode


def time_modes(
    fns: dict, rounds: int, settle: bool = False, cpu: dict | None = None
) -> dict[str, list[float]]:
    """Per-mode wall times of `rounds` interleaved rounds, after one warm-up round.

    A mode named `X+grad` runs `fns[X]` with autograd on; every other mode runs under
    `torch.no_grad()`. With `cpu`, the process's CPU seconds of each call are appended there too.

    With `settle` (`--settle`), before each timed call the garbage collector runs and glibc
    returns its free heap to the system (`malloc_trim`), untimed: every mode then starts from a
    cold heap and page-faults all the memory it keeps, instead of reusing what the mode before it
    freed. That raises every ratio of a mode that keeps memory (at 128 tokens `save="all"` went
    from about 1.25x to 1.45x, TransformerLens from 1.15x to 1.22x); the default measures the warm
    heap a loop of traces sees.

    Each call's result is held over one allocation Python's garbage collector counts (`held`),
    inside the timing: a collection due when the call returns (a trace pauses the collector,
    `torchlens._capture.collector`, so its objects are counted but not yet collected) runs there,
    with what the call returned still alive, as it would in a caller that keeps it, and is timed
    as part of the call.
    """
    samples: dict[str, list[float]] = {k: [] for k in fns}
    if cpu is not None:
        cpu.update({k: [] for k in fns})
    for r in range(rounds + 1):
        for mode, fn in fns.items():
            with torch.set_grad_enabled(grad_of(mode)):
                if settle:
                    gc.collect()
                    _trim()
                c0 = time.process_time()
                t0 = time.perf_counter()
                result = fn()
                held = [result]  # a counted allocation with the result alive (see the docstring)
                dt = time.perf_counter() - t0
                dc = time.process_time() - c0
                del result, held
            if r:
                samples[mode].append(dt)
                if cpu is not None:
                    cpu[mode].append(dc)
    return samples


def saved_bytes(trace, with_output: bool = False) -> int:
    """Bytes of distinct tensor storage a TorchLens trace keeps alive (op outputs, facets and,
    for a trace taken with `grads=`, the facets' gradients); `with_output` adds the model's return
    value the trace holds (`trace.output`: the logits, the KV cache), counted once."""
    seen, total = set(), 0
    tensors = [t for op in trace.ops for t in op.tensors if t is not None]
    tensors += [
        s.tensor
        for r in trace.modules.values()
        for c in r.calls
        for s in c.facets.sites.values()
        if s.tensor is not None
    ]
    tensors += [  # with grads=: the gradients it keeps (a derived one once it has been computed)
        _stored(s)
        for r in trace.modules.values()
        for c in r.calls
        if c.grads is not None
        for s in c.grads.sites.values()
        if isinstance(_stored(s), torch.Tensor)
    ]
    if with_output:
        tensors += _tensors_in(trace.output)
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _status(field: str) -> int:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _trim() -> bool:
    """Return the free heap memory glibc keeps to the system (so RSS counts live memory only)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def _measure_memory(
    fn, warm, trace_type=None, grad: bool = False, with_output: bool = False
) -> dict:
    with torch.set_grad_enabled(grad):
        warm()
        warm()
    _trim()
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    with torch.set_grad_enabled(grad):
        result = fn()
    out = {"peak_growth_bytes": _status("VmHWM") - base, "held_bytes": _status("VmRSS") - base}
    if _trim():  # what the result holds, without the freed heap glibc would keep for reuse
        out["held_trimmed_bytes"] = _status("VmRSS") - base
    if trace_type is not None and isinstance(result, trace_type):
        out["kept_bytes"] = saved_bytes(result)
        if with_output:
            out["kept_with_output_bytes"] = saved_bytes(result, with_output=True)
    return out


def memory_child(name: str, mode: str) -> dict:
    """In a fresh process: how far one run of `mode` raises the peak resident set."""
    if mode == "pypi":
        pypi_torchlens = _pypi_torchlens()  # the PyPI package of that name, in its own venv

        model, ids = build(name)
        with torch.no_grad():
            return _measure_memory(lambda: pypi_torchlens.trace(model, ids), lambda: model(ids))
    import torchlens as tl

    fn, warm = make_modes(name, [base_of(mode)], with_plain=True)[base_of(mode)]
    try:
        return _measure_memory(fn, warm, tl.Trace, grad_of(mode))
    finally:
        shutil.rmtree(STORE_ROOT, ignore_errors=True)


def _pypi_torchlens():
    """The PyPI package named `torchlens` (a different project), refusing this project's."""
    import torchlens as pypi_torchlens

    path = os.path.realpath(pypi_torchlens.__file__)
    if "site-packages" not in path or hasattr(pypi_torchlens, "mechinterp"):
        raise RuntimeError(f"imported this project's torchlens ({path}), not the PyPI package")
    return pypi_torchlens


def pypi_child(name: str, rounds: int, settle: bool = False) -> dict:
    """In the PyPI-torchlens venv: plain forward and its `trace` (saving everything), interleaved."""
    pypi_torchlens = _pypi_torchlens()

    model, ids = build(name)
    fns = {"plain": lambda: model(ids), "pypi": lambda: pypi_torchlens.trace(model, ids)}
    samples = time_modes(fns, rounds, settle)  # both under no_grad
    from importlib.metadata import version

    return {"samples": samples, "version": version("torchlens")}


def _child(python: str, call: str, timeout: float = 3600) -> dict:
    code = f"import sys; sys.path.insert(0, {HERE!r}); import bench, json; print('BENCH' + json.dumps(bench.{call}))"
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    if os.path.abspath(python) != os.path.abspath(
        sys.executable
    ):  # not realpath: venvs link one base
        # Another interpreter (the PyPI torchlens venv) must import its own packages: a PYTHONPATH
        # set for this run (`build/bench-src/src`) would put this project's torchlens first.
        env.pop("PYTHONPATH", None)
    if (
        MMAP_THRESHOLD[0] is not None
    ):  # a fixed threshold: glibc's adaptive one makes peaks vary by ~100 MiB
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD[0])
    proc = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, timeout=timeout, env=env
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1][5:])


def profile(name: str, top: int = 25, grad: bool = False) -> dict:
    """cProfile of one `trace(save="all")` run, by cumulative time, TorchLens functions only
    (under `torch.no_grad()`, or with autograd on with `grad`).

    The garbage collector's passes during the profiled call are recorded apart (`collections`:
    per generation, how many and their seconds): cProfile charges a pass to whatever function was
    allocating when it started, so one full pass (about 0.15 s with GPT-2 small's modules
    alive) would show as the own time of an unrelated function. A full collection runs before
    the profiled call, so a pass during it is the call's own."""
    import torchlens as tl

    model, ids = build(name)
    passes: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started: list[float] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            passes[info["generation"]].append(time.perf_counter() - started.pop())

    with torch.set_grad_enabled(grad):
        tl.trace(model, ids, save="all")
        t0 = time.perf_counter()
        model(ids)
        plain = time.perf_counter() - t0
        gc.collect()
        prof = cProfile.Profile()
        gc.callbacks.append(watch)
        try:
            t0 = time.perf_counter()
            prof.enable()
            tl.trace(model, ids, save="all")
            prof.disable()
            total = time.perf_counter() - t0
        finally:
            gc.callbacks.remove(watch)
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in stats.stats.items():
        if "torchlens" in file and "site-packages" not in file:
            rows.append((ct, tt, nc, f"{os.path.basename(file)}:{line} {func}"))
    rows.sort(reverse=True)
    return {
        "model": name,
        "profiled_s": total,
        "plain_s": plain,
        "torch_threads": torch.get_num_threads(),
        "grad": grad,
        "torchlens_commit": os.environ.get("BENCH_COMMIT"),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "collections": {str(g): [len(ts), sum(ts)] for g, ts in passes.items()},
        "rows": [
            {"cumulative_s": ct, "own_s": tt, "calls": nc, "function": fn}
            for ct, tt, nc, fn in rows[:top]
        ],
    }


#: The phases `phases` times: (module, attribute, label). Each is a function `trace` or a
#: generation's step calls once per forward call; `finish` holds the others but `setup` ones.
PHASES = [
    ("torchlens._tracing", "module_names", "setup: module_names"),
    ("torchlens._tracing", "static_roles", "setup: static_roles"),
    ("torchlens._tracing", "parameter_names", "setup: parameter_names"),
    ("torchlens._tracing", "finish", "finish"),
    ("torchlens._generation.session", "finish", "finish"),
    ("torchlens._assemble", "Graph", "finish: graph"),
    ("torchlens._assemble", "find_structure", "finish: structure"),
    ("torchlens._assemble", "derive", "finish: derive"),
    ("torchlens._assemble", "module_records", "finish: module_records"),
    ("torchlens._tracing", "snapshot", "finish: snapshot"),
    ("torchlens._tracing", "seal_checks", "finish: seal_checks"),
    ("torchlens._tracing", "arm_guards", "finish: arm_guards"),
]


def phases(name: str, save: str, calls: int, new_tokens: int = 0) -> dict:
    """Milliseconds per forward call in each phase of `PHASES` (wall clock, median over `calls`
    runs after warm-up): `trace(model, ids, save=save)` on `name`, or with `new_tokens`,
    `trace_generate` of that many tokens (each step one forward call). A diagnostic run of its
    own: the phases are timed by wrapping the functions in this process only, which is not
    free, so its totals are not the benchmark's; it says where a trace's own time goes."""
    import importlib

    import torchlens as tl

    spent: dict[str, float] = {}
    for module, attr, label in PHASES:
        mod = importlib.import_module(module)
        fn = getattr(mod, attr)

        def timed(*a, __fn=fn, __label=label, **k):
            t0 = time.perf_counter()
            try:
                return __fn(*a, **k)
            finally:
                spent[__label] = spent.get(__label, 0.0) + time.perf_counter() - t0

        setattr(mod, attr, timed)
    selection = save if save in ("all", "none") else save.split(",")
    model, ids = build(name)
    if new_tokens:
        kwargs = dict(  # as `generation_modes` calls it
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )

        def run():
            return tl.trace_generate(model, ids, save=selection, **kwargs)

        per_run = new_tokens  # forward calls per run: the prefill and new_tokens - 1 decodes
    else:

        def run():
            return tl.trace(model, ids, save=selection)

        per_run = 1
    with torch.no_grad():
        for _ in range(3):
            run()
        totals, runs = [], []
        for _ in range(calls):
            spent.clear()
            t0 = time.perf_counter()
            run()
            totals.append(time.perf_counter() - t0)
            runs.append(dict(spent))
    labels = [label for _, _, label in PHASES if any(label in r for r in runs)]
    return {
        "model": name,
        "save": save,
        "new_tokens": new_tokens,
        "forward_calls_per_run": per_run,
        "run_ms": 1000 * statistics.median(totals),
        "ms_per_forward_call": {
            label: 1000 * statistics.median(r.get(label, 0.0) for r in runs) / per_run
            for label in dict.fromkeys(labels)
        },
    }


def format_profile(p: dict) -> str:
    lines = [
        f"profile of trace(save='all') on {p['model']}: {p['profiled_s']:.2f} s under cProfile "
        f"(plain forward {p['plain_s']:.2f} s without it); garbage collector passes by generation "
        + ", ".join(f"{g}: {n} ({s:.3f} s)" for g, (n, s) in p.get("collections", {}).items()),
        f"{'cumulative s':>12} {'own s':>8} {'calls':>8}  function",
    ]
    lines += [
        f"{r['cumulative_s']:12.3f} {r['own_s']:8.3f} {r['calls']:8d}  {r['function']}"
        for r in p["rows"]
    ]
    return "\n".join(lines)


def _loadavg() -> list[float]:
    try:
        return [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    except OSError:
        return []


def _paired_ratio(mode: list[float], plain: list[float]) -> float:
    """The median over the rounds of the mode's time over the plain forward's in the same round
    (a round's pair shares the machine's state, so a drift in its speed across rounds cancels)."""
    return statistics.median(m / p for m, p in zip(mode, plain, strict=True))


def _rows(samples: dict[str, list[float]], cpu: dict[str, list[float]]) -> dict[str, dict]:
    """One row per timed mode: medians and paired ratios to the plain forward of the same grad
    mode (wall and CPU), and the ratios the grad-mode and eager-attention comparisons read."""
    rows = {}
    for m, v in samples.items():
        grad = grad_of(m)
        plain = "plain" + (GRAD if grad else "")
        row = {
            "median_s": statistics.median(v),
            "ratio": _paired_ratio(v, samples[plain]),
            "samples": v,
        }
        if m in cpu and plain in cpu:
            row.update(
                cpu_samples=cpu[m],
                cpu_median_s=statistics.median(cpu[m]),
                cpu_ratio=_paired_ratio(cpu[m], cpu[plain]),
            )
        if grad:
            row["grad"] = True
            if "plain" in samples:
                row["ratio_to_no_grad_plain"] = _paired_ratio(v, samples["plain"])
            if base_of(m) in samples:
                row["grad_over_no_grad"] = _paired_ratio(v, samples[base_of(m)])
                if base_of(m) in cpu:
                    row["cpu_grad_over_no_grad"] = _paired_ratio(cpu[m], cpu[base_of(m)])
        booted = "plain_booted" + (GRAD if grad else "")
        if base_of(m) in BOOTED_REF and booted in samples:
            row["ratio_to_booted_plain"] = _paired_ratio(v, samples[booted])
            if m in cpu and booted in cpu:
                row["cpu_ratio_to_booted_plain"] = _paired_ratio(cpu[m], cpu[booted])
        rows[m] = row
    return rows


def label(mode: str) -> str:
    """A mode's label, `(autograd on)` added for a `+grad` mode."""
    return LABELS[base_of(mode)] + (GRAD_LABEL if grad_of(mode) else "")


def run_model(
    name: str,
    modes: list[str],
    rounds: int,
    memory: bool,
    pypi_python: str | None,
    grads: tuple[bool, ...] = (False, True),
) -> dict:
    timed = [
        m + (GRAD if g else "") for g in grads for m in modes if m in IN_PROCESS or m in ONLY_NAMED
    ]
    if "plain" in modes and False not in grads:
        timed.insert(
            0, "plain"
        )  # with autograd only, still measured once without it (the on/off ratios)
    print(
        f"{name}: {', '.join(timed)}; {rounds} rounds, {torch.get_num_threads()} torch thread(s)",
        file=sys.stderr,
        flush=True,
    )
    load_before = _loadavg()
    t0 = time.perf_counter()
    made = make_modes(name, list(dict.fromkeys(base_of(m) for m in timed)))
    fns = {m: made[base_of(m)] for m in timed if base_of(m) in made}
    cpu: dict[str, list[float]] = {}
    samples = time_modes(fns, rounds, SETTLE[0], cpu)
    rows = _rows(samples, cpu)
    if "pypi" in modes and pypi_python and False in grads:
        res = _child(pypi_python, f"pypi_child({name!r}, {rounds}, {SETTLE[0]!r})")
        if "error" in res:
            rows["pypi"] = {"error": res["error"]}
        else:
            p, q = (
                statistics.median(res["samples"]["plain"]),
                statistics.median(res["samples"]["pypi"]),
            )
            rows["pypi"] = {
                "median_s": q,
                "ratio": _paired_ratio(res["samples"]["pypi"], res["samples"]["plain"]),
                "samples": res["samples"]["pypi"],
                "own_plain_s": p,
                "version": res["version"],
            }
    if memory and "all" in rows:
        rows["all_dir"] = {"memory_only": True}
    if memory:
        for m in list(rows):
            if "error" in rows[m] or (grad_of(m) and base_of(m) not in MEMORY_GRAD_MODES):
                continue
            python = pypi_python if m == "pypi" else sys.executable
            rows[m].update(_child(python, f"memory_child({name!r}, {m!r})"))
    out = {
        "spec": spec(name),
        "rounds": rounds,
        "modes": rows,
        "seconds": time.perf_counter() - t0,
        "load_before": load_before,
        "load_after": _loadavg(),
        "torch_threads": torch.get_num_threads(),
    }
    for m, r in rows.items():
        if "error" in r:
            print(f"  {label(m):58s} error: {r['error']}", file=sys.stderr)
            continue
        mem = (
            f"  peak +{r['peak_growth_bytes'] / 2**20:8.1f} MiB" if "peak_growth_bytes" in r else ""
        )
        mem += f"  held +{r['held_bytes'] / 2**20:8.1f} MiB" if "held_bytes" in r else ""
        timing = (
            f"{r['median_s'] * 1e3:10.2f} ms  {r['ratio']:6.2f}x"
            if "median_s" in r
            else f"{'(memory only)':>21s}"
        )
        if "cpu_ratio" in r:
            timing += f"  cpu {r['cpu_ratio']:6.2f}x"
        if "ratio_to_booted_plain" in r:
            timing += f"  /booted {r['ratio_to_booted_plain']:5.2f}x"
        if "grad_over_no_grad" in r:
            timing += f"  on/off {r['grad_over_no_grad']:5.2f}"
        print(f"  {label(m):58s} {timing}{mem}", file=sys.stderr)
    return out


# -- generation: trace_generate against model.generate ----------------------------------------

#: The generation modes, in the order they run each round.
GENERATION_MODES = [
    "generate",
    "gen_resid_post",
    "gen_all",
    "gen_none",
    "nnsight_generate",
    "floor_record_generate",
    "floor_keep_generate",
]
GENERATION_LABELS = {
    "generate": "model.generate (no_grad)",
    "gen_resid_post": "TorchLens trace_generate save=['resid_post']",
    "gen_all": "TorchLens trace_generate save='all'",
    "gen_none": "TorchLens trace_generate save='none'",
    "nnsight_generate": "nnsight generate, every block's output saved at every step",
    "floor_record_generate": "floor: generate with every op and module call recorded in Python",
    "floor_keep_generate": (
        "floor: the same, every op output kept, those the caller can still reach copied after each forward"
    ),
}


def generation_modes(name: str, new_tokens: int) -> dict:
    """Callables for the generation modes: greedy, `new_tokens` new tokens from the model's prompt
    (nnsight wraps a copy of its own)."""
    from nnsight import TransformersModel

    import torchlens as tl
    from torchlens import testing

    model, ids = build(name)
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    engine = TransformersModel(
        build(name)[0], task="text-generation", tokenizer=testing.tokenizer()
    )
    n_layer = model.config.n_layer

    def nnsight_generate():
        with engine.generate(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, **kwargs
        ) as tracer:
            saved = list().save()
            for _ in tracer.iter[:new_tokens]:
                saved.append([engine.transformer.h[i].output for i in range(n_layer)])
        return saved

    return {
        "generate": lambda: model.generate(ids, **kwargs),
        "gen_resid_post": lambda: tl.trace_generate(model, ids, save=["resid_post"], **kwargs),
        "gen_all": lambda: tl.trace_generate(model, ids, save="all", **kwargs),
        "gen_none": lambda: tl.trace_generate(model, ids, save="none", **kwargs),
        "nnsight_generate": nnsight_generate,
        "floor_record_generate": lambda: record_forward(
            model, lambda: model.generate(ids, **kwargs)
        ),
        "floor_keep_generate": lambda: keep_generate(model, lambda: model.generate(ids, **kwargs)),
    }


def generation_memory_child(name: str, new_tokens: int, mode: str) -> dict:
    """In a fresh process: how far one run of generation `mode` raises the peak resident set, and
    what its result holds right after the call (`_measure_memory`, `model.generate` the warm-up),
    before anything reads it: a step's pending checks still hold their inputs then (the weights a
    derived facet is computed from among them), which `saved_bytes` cannot count without running
    the checks."""
    fns = generation_modes(name, new_tokens)
    with torch.no_grad():  # the Generation guide's calls; trace_generate runs its forwards so too
        return _measure_memory(fns[mode], fns["generate"])


def generation_bench(
    name: str, new_tokens: int, rounds: int, modes: list[str] | None = None, memory: bool = True
) -> dict:
    """Time each generation mode in one process (interleaved rounds, median, paired ratio to
    `model.generate`), then, for the TorchLens modes, the bytes each step's trace keeps: the
    memory grows linearly in the steps (a decode step's pattern is one query row per new token).
    With `memory`, each mode's peak and held resident memory, each in a fresh process
    (`generation_memory_child`)."""
    import warnings

    warnings.filterwarnings("ignore", module="nnsight")
    fns = generation_modes(name, new_tokens)
    fns = {k: v for k, v in fns.items() if modes is None or k in modes or k == "generate"}
    samples = time_modes(fns, rounds)
    out = {"model": name, "new_tokens": new_tokens, "rounds": rounds, "modes": {}}
    for mode, times in samples.items():
        out["modes"][mode] = {
            "label": GENERATION_LABELS[mode],
            "median_s": statistics.median(times),
            "ratio": _paired_ratio(times, samples["generate"]),
        }
    for mode in ("gen_resid_post", "gen_all"):
        if mode in fns:
            with torch.no_grad():
                gen = fns[mode]()
            out["modes"][mode]["kept_bytes_per_step"] = [saved_bytes(t) for t in gen.steps]
    if memory:
        for mode in out["modes"]:
            out["modes"][mode].update(
                _child(sys.executable, f"generation_memory_child({name!r}, {new_tokens}, {mode!r})")
            )
    return out


# -- gradients: trace(..., grads=) against a plain forward and backward -------------------------

#: The gradient modes, in the order they run each round.
GRADIENT_MODES = [
    "fb",
    "fb_hooks",
    "fb_unfrozen",
    "grad_all",
    "grad_resid_post",
    "tl_bwd",
    "nnsight_grad",
]
GRADIENT_LABELS = {
    "fb": "plain forward + backward",
    "fb_unfrozen": "forward + backward, weights made to require grad for the forward (a floor)",
    "fb_hooks": "forward + backward, a tensor hook keeping each block output's gradient",
    "grad_all": "TorchLens save='all', grads=loss",
    "grad_resid_post": "TorchLens save=['resid_post'], grads=loss",
    "tl_bwd": "TransformerLens 4.3 caching hooks with backward hooks (every hook point)",
    "nnsight_grad": "nnsight, every block output's .grad saved",
}
#: The modes not checked against the hook baseline: the baselines themselves, and the unfrozen
#: floor, whose gradients are at the embeddings' outputs (the end points `fb`'s backward has).
UNCHECKED_GRADIENT_MODES = ("fb", "fb_hooks", "fb_unfrozen")
#: The TorchLens gradient modes: called under `torch.no_grad()`, as the Gradients guide calls
#: them (`grads=` turns autograd on for the trace's own forward); every other mode runs with it on.
TORCHLENS_GRAD_MODES = ("grad_all", "grad_resid_post")
#: How far a mode's gradient at the checked block output may be from the hook baseline's, relative
#: to the largest element there (TransformerLens runs eager attention, GPT-2 here sdpa).
GRAD_CHECK_RTOL = 1e-4


def last_logsumexp(out) -> torch.Tensor:
    """The loss of every gradient mode: the logsumexp of the last position's logits."""
    logits = getattr(out, "logits", out)
    return logits[0, -1].logsumexp(-1)


@contextlib.contextmanager
def _embedding_leaves(model):
    """While the block runs, the output of each of `model`'s `nn.Embedding`s is made an autograd
    leaf: with frozen weights nothing else requires grad, so a backward of the loss goes through
    every layer down to the embeddings (as TorchLens's backward for `save='all'` does) and writes
    no parameter's `.grad`."""

    def leaf(mod, args, out):
        return out if out.requires_grad else out.requires_grad_()

    handles = [
        m.register_forward_hook(leaf) for m in model.modules() if isinstance(m, torch.nn.Embedding)
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def forward_backward(model, ids, blocks=()) -> dict:
    """`last_logsumexp(model(ids)).backward()` with autograd on, the weights frozen and the
    embeddings' outputs the leaves; with `blocks`, a forward hook on each registers a tensor hook
    keeping the gradient at its output (returned by block index)."""
    kept: dict[int, torch.Tensor] = {}
    handles = []
    for i, block in enumerate(blocks):

        def keep(mod, args, out, i=i):
            out.register_hook(lambda g: kept.__setitem__(i, g))

        handles.append(block.register_forward_hook(keep))
    try:
        with torch.enable_grad(), _embedding_leaves(model):
            last_logsumexp(model(ids)).backward()
    finally:
        for h in handles:
            h.remove()
    return kept


def forward_backward_unfrozen(model, ids) -> tuple:
    """The floor of a design that makes every frozen weight require grad for the forward (as
    TorchLens's `grads=` did before its first activations became the leaves): the forward with
    every floating parameter requiring grad, then one `torch.autograd.grad` of the loss with
    respect to the embeddings' outputs only (the same end points as `forward_backward`; no
    weight's gradient is asked for, none is written). What the weights requiring grad costs over
    `forward_backward` is autograd saving every weight's other operand (a linear's input) in the
    forward for a weight gradient nobody takes."""
    outs: list[torch.Tensor] = []
    handles = [
        m.register_forward_hook(lambda mod, args, out: outs.append(out))
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding)
    ]
    frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
    try:
        for p in frozen:
            p.requires_grad_(True)
        with torch.enable_grad():
            loss = last_logsumexp(model(ids))
    finally:
        for p in frozen:
            p.requires_grad_(False)
        for h in handles:
            h.remove()
    return torch.autograd.grad(loss, outs)


def _tl_bwd(name: str):
    """TransformerLens 4.x: the bridge's caching hooks for every hook point, forward and backward
    (`get_caching_hooks(incl_bwd=True)`, what `run_with_cache(incl_bwd=True)` adds), over a forward
    and a backward of the loss: `(run, the bridge's plain forward and backward)`."""
    bridge, _model, ids = _boot_bridge(name)
    bridge.requires_grad_(False)

    def run():
        cache, fwd, bwd = bridge.get_caching_hooks(incl_bwd=True)
        with (
            torch.enable_grad(),
            _embedding_leaves(bridge),
            bridge.hooks(fwd_hooks=fwd, bwd_hooks=bwd),
        ):
            last_logsumexp(bridge(ids)).backward()
        return cache

    return run, lambda: forward_backward(bridge, ids)


def _nnsight_grad(name: str):
    """nnsight on its own copy of the model: every block's output read in the trace, and its
    `.grad` saved inside `with loss.backward():` (latest block first, as nnsight requires)."""
    from nnsight import NNsight

    model, ids = build(name)
    model.requires_grad_(False)
    engine = NNsight(model)
    n = model.config.n_layer

    def run():
        with torch.enable_grad(), _embedding_leaves(model), engine.trace(ids):
            outs = [engine.transformer.h[i].output for i in range(n)]
            loss = last_logsumexp(engine.output)
            saved = list().save()
            with loss.backward():
                for i in reversed(range(n)):
                    saved.append(outs[i].grad.save())
        return saved[::-1]

    return run, lambda: forward_backward(model, ids)


def gradient_modes(name: str, wanted: list[str]) -> dict:
    """`mode -> (run, the plain forward and backward of the model run uses)` for the gradient
    modes in `wanted`; every model's weights are frozen, as interpretability code has them."""
    import torchlens as tl

    model, ids = build(name)
    model.requires_grad_(False)
    blocks = list(model.transformer.h)

    def fb():
        return forward_backward(model, ids)

    def trace(save):
        return lambda: tl.trace(model, ids, save=save, grads=last_logsumexp)

    fns = {
        "fb": (fb, fb),
        "fb_hooks": (lambda: forward_backward(model, ids, blocks), fb),
        "fb_unfrozen": (lambda: forward_backward_unfrozen(model, ids), fb),
        "grad_all": (trace("all"), fb),
        "grad_resid_post": (trace(["resid_post"]), fb),
    }
    if "tl_bwd" in wanted:
        fns["tl_bwd"] = _tl_bwd(name)
    if "nnsight_grad" in wanted:
        fns["nnsight_grad"] = _nnsight_grad(name)
    return {m: fns[m] for m in wanted}


def _block_grad(mode: str, result, k: int) -> torch.Tensor:
    """The gradient a mode's result holds at block `k`'s output."""
    if mode in TORCHLENS_GRAD_MODES:
        return result.modules[f"transformer.h.{k}"].grads["resid_post"]
    if mode == "tl_bwd":
        return result[f"blocks.{k}.hook_out_grad"]
    return result[k]  # fb_hooks, nnsight_grad


def _timed_name(mode: str) -> str:
    return mode if mode in TORCHLENS_GRAD_MODES else mode + GRAD


def gradient_memory_child(name: str, mode: str) -> dict:
    """In a fresh process: how far one run of gradient mode `mode` raises the peak resident set,
    after two plain forwards and backwards of the model it uses."""
    import torchlens as tl

    fn, warm = gradient_modes(name, [mode])[mode]
    return _measure_memory(fn, warm, tl.Trace, mode not in TORCHLENS_GRAD_MODES, with_output=True)


def gradient_bench(name: str, rounds: int, memory: bool = True, modes=None) -> dict:
    """Each gradient mode on `name`: first its gradient at the middle block's output checked
    against the tensor-hook baseline's (a mismatch stops the run: the modes must do the same
    work), then interleaved timed rounds in one process (median, paired ratio to the plain forward
    and backward, wall and CPU), then, with `memory`, each mode once more in a fresh process."""
    import warnings

    warnings.filterwarnings("ignore", module="nnsight")
    wanted = [m for m in GRADIENT_MODES if not modes or m in modes or m in ("fb", "fb_hooks")]
    print(
        f"gradients {name}: {', '.join(wanted)}; {rounds} rounds, "
        f"{torch.get_num_threads()} torch thread(s)",
        file=sys.stderr,
        flush=True,
    )
    load_before = _loadavg()
    made = gradient_modes(name, wanted)
    k = spec(name)["n_layer"] // 2
    ref = made["fb_hooks"][0]()[k]
    checks = {}
    for m in wanted:
        if m in UNCHECKED_GRADIENT_MODES:
            continue
        with torch.set_grad_enabled(m not in TORCHLENS_GRAD_MODES):
            g = _block_grad(m, made[m][0](), k).detach().reshape(ref.shape)
        diff, scale = (g - ref).abs().max().item(), ref.abs().max().item()
        checks[m] = {"max_abs_diff": diff, "ref_max_abs": scale}
        if not diff <= GRAD_CHECK_RTOL * scale:
            raise SystemExit(
                f"{m}: the gradient at transformer.h.{k}'s output differs from the hook baseline's "
                f"by {diff:.3g} (largest element {scale:.3g}): the modes would not compare equal work"
            )
    cpu: dict[str, list[float]] = {}
    samples = time_modes({_timed_name(m): made[m][0] for m in wanted}, rounds, SETTLE[0], cpu)
    base = _timed_name("fb")
    rows = {}
    for m in wanted:
        t = _timed_name(m)
        rows[m] = {
            "label": GRADIENT_LABELS[m],
            "median_s": statistics.median(samples[t]),
            "ratio": _paired_ratio(samples[t], samples[base]),
            "cpu_median_s": statistics.median(cpu[t]),
            "cpu_ratio": _paired_ratio(cpu[t], cpu[base]),
            "samples": samples[t],
            "cpu_samples": cpu[t],
        }
        if m in checks:
            rows[m]["check"] = checks[m]
    del made
    if memory:
        for m in wanted:
            rows[m].update(_child(sys.executable, f"gradient_memory_child({name!r}, {m!r})"))
    for r in rows.values():
        mem = (
            f"  peak +{r['peak_growth_bytes'] / 2**20:8.1f} MiB" if "peak_growth_bytes" in r else ""
        )
        mem += f"  kept {r['kept_bytes'] / 2**20:8.1f} MiB" if "kept_bytes" in r else ""
        mem += f"  error: {r['error']}" if "error" in r else ""
        print(
            f"  {r['label']:72s} {r['median_s'] * 1e3:10.2f} ms  {r['ratio']:5.2f}x  "
            f"cpu {r['cpu_ratio']:5.2f}x{mem}",
            file=sys.stderr,
        )
    return {
        "spec": spec(name),
        "rounds": rounds,
        "checked_at": f"transformer.h.{k}",
        "modes": rows,
        "load_before": load_before,
        "load_after": _loadavg(),
    }


#: What a resumed run must share with the run it goes on with: its figures then come from the same
#: code under the same conditions, one model per process either way.
RESUME_KEYS = ("torchlens_commit", "torch", "transformers", "cpus", "settle", "mmap_threshold")


def resumed(path: str | None, fresh: dict) -> dict:
    """The run in `path` to go on with, checked against the one about to start (`fresh`): the same
    commit, library versions, machine size, grad modes and thread counts, else SystemExit. Its
    measured models are kept; each start after the first is listed in `resumed`."""
    if not path or not os.path.exists(path):
        raise SystemExit(f"--resume needs the run to go on with, in --json (got {path!r})")
    with open(path) as f:
        old = json.load(f)
    if "by_threads" not in old:
        raise SystemExit(f"{path} is not a bench.py table run (no by_threads)")
    differs = [
        f"{k}: {old['machine'].get(k)!r} there, {fresh['machine'].get(k)!r} now"
        for k in RESUME_KEYS
        if old["machine"].get(k) != fresh["machine"].get(k)
    ]
    if fresh["machine"].get("torchlens_commit") is None:
        differs.append("no BENCH_COMMIT set: a resumed run must name the commit it measures")
    for k in ("grad_modes", "threads"):
        if old.get(k) != fresh.get(k):
            differs.append(f"{k}: {old.get(k)!r} there, {fresh.get(k)!r} now")
    if differs:
        raise SystemExit(f"cannot resume {path}: " + "; ".join(differs))
    out = dict(fresh, started=old["started"], by_threads=old["by_threads"])
    if old.get("not_measured"):  # a model left out with its reason stays out
        out["not_measured"] = dict(old["not_measured"])
    out["machine"] = dict(fresh["machine"], load_at_start=old["machine"]["load_at_start"])
    out["resumed"] = [*old.get("resumed", []), fresh["started"]]
    out["labels"] = {**old.get("labels", {}), **fresh["labels"]}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark TorchLens capture side by side.")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--models", nargs="*", help="only these models (default: the table and both sweeps)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="rounds per model (default: 21 tiny, 7 up to GPT-2 small at 128 tokens, 5 above)",
    )
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="torch thread counts, each a whole run (default: 1, then 2)",
    )
    parser.add_argument(
        "--grad",
        choices=["both", "off", "on"],
        default="both",
        help="run each mode under no_grad (off), with autograd (on), or both in the same rounds",
    )
    parser.add_argument(
        "--no-pypi-above",
        type=int,
        default=1024,
        help="run PyPI torchlens only up to this many tokens (it is slow)",
    )
    parser.add_argument(
        "--pypi-python",
        default=DEFAULT_PYPI_PYTHON,
        help="python of a venv with PyPI torchlens 2.36.1 (skipped when missing)",
    )
    parser.add_argument(
        "--profile", metavar="MODEL", help="print a cProfile of trace(save='all') and exit"
    )
    parser.add_argument(
        "--profile-grad",
        action="store_true",
        help="profile with autograd on (as the docs call trace)",
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        metavar="BYTES",
        help="run the memory children with MALLOC_MMAP_THRESHOLD_=BYTES (e.g. 65536): large "
        "tensors are then mapped and unmapped, so peaks do not depend on heap reuse",
    )
    parser.add_argument(
        "--settle",
        action="store_true",
        help="collect garbage and malloc_trim before each timed call (a cold heap for every mode)",
    )
    parser.add_argument(
        "--modes",
        nargs="*",
        help="only these modes (a quick look; default: every mode of each model)",
    )
    parser.add_argument(
        "--generation",
        metavar="MODEL",
        help="benchmark trace_generate on MODEL (e.g. L12-T128: GPT-2 small, a 128-token prompt) "
        "against model.generate and nnsight's generate, print the JSON and exit",
    )
    parser.add_argument(
        "--new-tokens", type=int, default=32, help="new tokens per generation (default 32)"
    )
    parser.add_argument(
        "--phases",
        nargs=2,
        metavar=("MODEL", "SAVE"),
        help="a diagnostic: milliseconds per forward call in each phase of trace(model, ids, "
        "save=SAVE) (SAVE 'all', 'none' or a comma-separated list), or of each step of "
        "trace_generate with --phases-generate; print the JSON and exit",
    )
    parser.add_argument(
        "--phases-generate",
        action="store_true",
        help="with --phases: time trace_generate of --new-tokens tokens instead of one trace",
    )
    parser.add_argument(
        "--gradients",
        metavar="MODEL",
        nargs="+",
        help="benchmark trace(..., grads=) on each MODEL (e.g. L12-T128 L12-T1024) against a plain "
        "forward and backward, TransformerLens's backward hooks and nnsight's .grad, print the "
        "JSON and exit",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="with --gradients: mark the JSON as a smoke run (few rounds, small models, not the "
        "measurement; the Performance page says so)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="go on with the run in --json: keep each model it measured (every mode of a model "
        "runs in one process, so a model is the unit a run can be cut at) and measure the rest; "
        "refused unless that run measured the same commit (BENCH_COMMIT), grad modes and thread "
        "counts",
    )
    parser.add_argument(
        "--not-measured",
        nargs=2,
        action="append",
        default=[],
        metavar=("MODEL", "REASON"),
        help="leave MODEL of the plan unmeasured at every thread count, and record why (e.g. its "
        "process outgrew the machine's memory); the Performance page lists it with the reason",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads[0])
    MMAP_THRESHOLD[0] = args.mmap_threshold
    SETTLE[0] = args.settle
    if args.gradients:
        import torchlens as tl

        if args.modes and set(args.modes) - set(GRADIENT_MODES):
            raise SystemExit(
                f"unknown gradient mode(s) {sorted(set(args.modes) - set(GRADIENT_MODES))}: "
                f"use {', '.join(GRADIENT_MODES)}"
            )
        out = {
            "machine": {
                "cpus": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "torchlens": tl.__version__,
                "torchlens_commit": os.environ.get("BENCH_COMMIT"),
                "load_at_start": _loadavg(),
                "mmap_threshold": MMAP_THRESHOLD[0],
            },
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "smoke": args.smoke,
            "models": {},
        }
        for name in args.gradients:
            rounds = args.rounds or (21 if name == "tiny" else 5)
            out["models"][name] = gradient_bench(name, rounds, not args.no_memory, args.modes)
            if args.json:  # after every model, so a run that dies keeps what it measured
                os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
                with open(args.json, "w") as f:
                    json.dump(out, f, indent=1)
        print(json.dumps(out, indent=1))
        return 0
    if args.phases:
        out = phases(
            args.phases[0],
            args.phases[1],
            args.rounds or 9,
            args.new_tokens if args.phases_generate else 0,
        )
        print(json.dumps(out, indent=1))
        return 0
    if args.generation:
        load, started = _loadavg(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        g = generation_bench(
            args.generation,
            args.new_tokens,
            args.rounds or 5,
            [m for m in args.modes] if args.modes else None,
            not args.no_memory,
        )
        g["machine"] = {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_at_start": load,
            "torchlens_commit": os.environ.get("BENCH_COMMIT"),
        }
        g["started"] = started
        print(json.dumps(g, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(g, f, indent=1)
        return 0
    if args.profile:
        p = profile(args.profile, grad=args.profile_grad)
        print(format_profile(p))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(p, f, indent=1)
        return 0
    import torchlens as tl

    grads = {"both": (False, True), "off": (False,), "on": (True,)}[args.grad]
    pypi = args.pypi_python if os.path.exists(args.pypi_python) else None
    plan: dict[str, list[str]] = {}
    for name in TABLE_MODELS:
        modes = (
            IN_PROCESS
            if spec(name)["tokens"] <= 1024
            else [m for m in IN_PROCESS if m not in BIG_SKIP]
        )
        plan[name] = modes + (["pypi"] if spec(name)["tokens"] <= args.no_pypi_above else [])
    for name in TOKEN_SWEEP + LAYER_SWEEP:
        plan.setdefault(name, SWEEP_MODES)
    if args.models:
        plan = {n: plan.get(n, IN_PROCESS + ["pypi"]) for n in args.models}
    if args.modes:
        unknown = sorted(set(args.modes) - set(LABELS))
        if unknown:
            raise SystemExit(f"unknown mode(s) {unknown}: use {', '.join(LABELS)}")
        named = [m for m in ONLY_NAMED if m in args.modes]  # run only when asked for
        plan = {
            n: ["plain"] + [m for m in modes if m in args.modes and m != "plain"] + named
            for n, modes in plan.items()
        }
    for n, modes in plan.items():  # the booted modes are read against the booted model's forward
        if (
            any(m.endswith("_booted") or m == "tl_cache" for m in modes)
            and "plain_booted" not in modes
        ):
            plan[n] = modes + ["plain_booted"]
    labels = dict(LABELS)
    labels.update({m + GRAD: label(m + GRAD) for m in IN_PROCESS + ONLY_NAMED})
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": args.threads[0],
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torchlens": tl.__version__,
            "torchlens_commit": os.environ.get("BENCH_COMMIT"),
            "platform": platform.platform(),
            "device": "cpu",
            "load_at_start": _loadavg(),
            "settle": SETTLE[0],
            "mmap_threshold": MMAP_THRESHOLD[0],
        },
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "table": [n for n in TABLE_MODELS if n in plan],
        "token_sweep": [n for n in TOKEN_SWEEP if n in plan],
        "layer_sweep": [n for n in LAYER_SWEEP if n in plan],
        "labels": labels,
        "grad_modes": ["no_grad" if not g else "autograd" for g in grads],
        "threads": list(args.threads),
        "models": {},
        "by_threads": {},
    }

    if args.resume:
        results = resumed(args.json, results)
    for name, why in args.not_measured:  # kept in the plan's lists, so the page names it
        if name not in plan:
            raise SystemExit(
                f"--not-measured {name}: not a model of this run's plan ({', '.join(plan)})"
            )
        results.setdefault("not_measured", {})[name] = why

    def cost(name):
        return spec(name)["tokens"] * spec(name)["n_layer"]

    for k, threads in enumerate(args.threads):
        torch.set_num_threads(threads)
        models = results["by_threads"].setdefault(str(threads), {})
        if k == 0:
            results["models"] = models  # the first count's results, where every reader looks
        for name in sorted(
            plan, key=cost
        ):  # cheapest first: a run cut short keeps the small models
            if name in models or name in results.get("not_measured", {}):
                continue  # measured before the run was resumed, or left out with the reason
            modes = plan[name]
            rounds = args.rounds or (21 if name == "tiny" else 7 if cost(name) <= 12 * 128 else 5)
            # memory does not depend on the thread count: measured with the first count only
            models[name] = run_model(
                name, modes, rounds, not args.no_memory and k == 0, pypi if k == 0 else None, grads
            )
            if (
                args.json
            ):  # written after every model, so a long run that dies keeps what it measured
                os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

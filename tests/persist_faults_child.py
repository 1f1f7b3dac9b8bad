"""The child process of `test_persist_faults.py`: saves that are killed or whose writes fail.

Run as `python tests/persist_faults_child.py MODE DIR [ARGS]`; prints one JSON report as its last
line. It builds two traces of one model on different token ids ("old" and "new", the same shapes,
so only their values tell them apart), checks both against plain forward hooks (ground truth
from outside TorchLens), and then, by mode:

- `kill DIR ROUNDS SEED`: `old` is saved in DIR, then a forked process saves `new` over it and is
  killed with SIGKILL (1) just before each file-system call the save makes, in turn (every call
  but the writes of tensor bytes, of which a spread is taken) and (2) at random times while it
  saves `new` and `old` over each other in a loop. After each kill DIR is loaded: it must be
  `old` or `new` exactly.
- `fsize DIR`: writes fail for real (the kernel refuses them past `RLIMIT_FSIZE`, EFBIG) inside
  the tensor file, inside trace.json, and inside a `store=DIR` capture.
- `ns DIR` (run inside `unshare --user --map-root-user --mount`): tmpfs file systems mounted
  under DIR fill up (ENOSPC) inside the tensor file and inside trace.json, and one is made
  read-only (EROFS) under a saved trace and a store.

Nothing here is imported by the tests; it is a script (import-safe for `--doctest-modules`).
"""

from __future__ import annotations

import builtins
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
import warnings

#: the os functions a save may call on the file system, wrapped to count or to kill at a call
_STEPS = (
    "open",
    "write",
    "fsync",
    "close",
    "replace",
    "rename",
    "remove",
    "unlink",
    "makedirs",
    "mkdir",
    "listdir",
)


def _build(new_save="all"):
    import torch

    import torchlens as tl
    from torchlens import testing

    torch.set_num_threads(1)  # forked children then need no thread pool of torch's
    model = testing.build("gpt2", "sdpa")
    ids = {"old": testing.token_ids(length=6, seed=0), "new": testing.token_ids(length=6, seed=1)}
    traces = {
        "old": tl.trace(model, ids["old"], use_cache=False),
        "new": tl.trace(model, ids["new"], use_cache=False, save=new_save),
    }
    truth = True
    for name, trace in traces.items():
        trace.check()
        seen = testing.hooked_outputs(model, trace.blocks, ids[name], use_cache=False)
        truth &= len(seen) == 2 and all(
            torch.equal(trace.modules[a].facets["resid_post"], seen[a]) for a in trace.blocks
        )
    return model, ids, traces, truth


def _save(trace, d):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace.save(d)


def _same(a, b) -> bool:
    """Whether trace `a` holds exactly what `b` holds: every op (metadata and output bits),
    every facet site, and the output."""
    import torch

    if [
        (o.name, o.module, o.call, o.inputs, tuple(map(tuple, o.shapes)), o.dtypes) for o in a.ops
    ] != [
        (o.name, o.module, o.call, o.inputs, tuple(map(tuple, o.shapes)), o.dtypes) for o in b.ops
    ]:
        return False
    for x, y in zip(a.ops, b.ops):
        for s, t in zip(x.tensors, y.tensors):
            if (s is None) != (t is None) or (s is not None and not torch.equal(s, t)):
                return False
    if list(a.modules) != list(b.modules):
        return False
    for addr in a.modules:
        for ca, cb in zip(a.modules[addr].calls, b.modules[addr].calls, strict=True):
            sa, sb = ca.facets.sites, cb.facets.sites
            if list(sa) != list(sb):
                return False
            for n in sa:
                s, t = sa[n].tensor, sb[n].tensor
                if (s is None) != (t is None) or (s is not None and not torch.equal(s, t)):
                    return False
    return torch.equal(a.output["logits"], b.output["logits"])


def _which(d, traces) -> str:
    import torchlens as tl

    try:
        loaded = tl.load(d)
    except tl.TraceFileError as exc:
        return f"refused: {exc}"
    except Exception as exc:
        return f"raw {type(exc).__name__}: {exc}"
    hits = [name for name, t in traces.items() if _same(loaded, t)]
    return hits[0] if len(hits) == 1 else "mix"


class _Calls:
    """Wraps the file-system calls of `_STEPS` (and `open`): counts them, and kills this process
    with SIGKILL just before call number `kill_at`."""

    def __init__(self, kill_at=None):
        self.kill_at, self.names = kill_at, []

    def install(self):
        for name in _STEPS:
            setattr(os, name, self._wrap(getattr(os, name), f"os.{name}"))
        builtins.open = self._wrap(builtins.open, "open")

    def _wrap(self, fn, name):
        def call(*args, **kwargs):
            if len(self.names) == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            self.names.append(name)
            return fn(*args, **kwargs)

        return call


def _fork(body):
    """Run `body()` in a forked child; returns its wait status."""
    pid = os.fork()
    if pid == 0:
        try:
            body()
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


def kill(d, rounds, seed):
    _, _, traces, truth = _build()
    old, new = traces["old"], traces["new"]
    log = os.path.join(os.path.dirname(d), "steps.json")

    def count():
        calls = _Calls()
        calls.install()
        try:
            _save(new, d)
        finally:
            names = list(calls.names)  # before the log's own open and write are counted
            with open(log, "w") as f:
                json.dump(names, f)

    _save(old, d)
    _fork(count)
    with open(log) as f:
        names = json.load(f)
    writes = [i for i, n in enumerate(names) if n == "os.write"]
    points = sorted(
        {i for i, n in enumerate(names) if n != "os.write"} | set(writes[::10]) | set(writes[-2:])
    )
    steps = []
    for k in points:
        _save(old, d)
        status = _fork(lambda k=k: (_Calls(k).install(), _save(new, d)))
        steps.append(
            {
                "step": k,
                "call": names[k],
                "killed": os.WIFSIGNALED(status),
                "loaded": _which(d, traces),
            }
        )
    _save(old, d)  # the save runs to its end: new
    _fork(lambda: _save(new, d))
    steps.append(
        {
            "step": len(names),
            "call": "(none: the save finished)",
            "killed": False,
            "loaded": _which(d, traces),
        }
    )

    rng = random.Random(seed)
    t0 = time.perf_counter()
    _save(new, d)
    one = time.perf_counter() - t0
    randoms = []
    for _ in range(rounds):
        _save(old, d)

        def loop():
            while True:
                _save(new, d)
                _save(old, d)

        pid = os.fork()
        if pid == 0:
            try:
                loop()
            finally:
                os._exit(0)
        delay = rng.uniform(0, 4 * one)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        randoms.append({"delay": delay, "loaded": _which(d, traces)})
    _save(old, d)  # a save that finishes removes what the killed ones left
    return {
        "ground_truth": truth,
        "calls": len(names),
        "steps": steps,
        "random": randoms,
        "one_save_s": one,
        "files_after_a_finished_save": _files(d),
        "loaded_then": _which(d, traces),
    }


def _attempt(fn):
    """(error class name, message, errno of its cause) of what `fn()` raised, or None."""
    try:
        fn()
    except Exception as exc:
        cause = exc.__cause__
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "torchlens": type(exc).__module__.startswith("torchlens"),
            "errno": getattr(cause, "errno", None),
        }
    return None


def _files(d):
    return sorted(os.listdir(d))


def _store_clean(model, ids, d, attempt):
    """After a store= trace failed: what is left in its directory, whether any hook or torch
    function mode outlived it, and whether a plain trace still serves the hooks' values."""
    import torch

    import torchlens as tl
    from torchlens import testing

    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    trace = tl.trace(model, ids, use_cache=False)
    seen = testing.hooked_outputs(model, trace.blocks, ids, use_cache=False)
    ok = all(torch.equal(trace.modules[a].facets["resid_post"], seen[a]) for a in trace.blocks)
    files = _files(d) if os.path.isdir(d) else []
    return {
        "attempt": attempt,
        "files_after": files,
        "hooks_left": hooks,
        "modes_left": torch._C._len_torch_function_stack(),
        "plain_trace_ok": ok,
    }


def fsize(d):
    import torchlens as tl

    model, ids, traces, truth = _build(
        new_save=["resid_post"]
    )  # new: small tensor file, full trace.json
    full_new = tl.trace(model, ids["new"], use_cache=False)
    full_new.check()
    traces_full = {"old": traces["old"], "new": full_new}
    probe = d + "-probe"
    _save(traces["new"], probe)
    sizes = {f.split(".")[0]: os.path.getsize(os.path.join(probe, f)) for f in os.listdir(probe)}
    shutil.rmtree(probe)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    report = {"ground_truth": truth, "sizes": sizes, "cases": {}}
    for case, new, limit in (
        ("tensor file", full_new, 20_000),
        ("trace.json", traces["new"], (sizes["tensors"] + sizes["trace"]) // 2),
    ):
        where = os.path.join(d, case.replace(" ", "-"))
        _save(traces["old"], where)
        before = _files(where)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            attempt = _attempt(lambda: _save(new, where))
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        report["cases"][case] = {
            "limit": limit,
            "attempt": attempt,
            "files_before": before,
            "files_after": _files(where),
            "loaded": _which(where, traces_full),
        }
    store = os.path.join(d, "store")
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
    try:
        attempt = _attempt(lambda: tl.trace(model, ids["old"], use_cache=False, store=store))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    report["store"] = _store_clean(model, ids["old"], store, attempt)
    return report


def _mount(where, size_kib):
    os.makedirs(where, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", where], check=True)


def ns(d):
    import torchlens as tl

    model, ids, traces, truth = _build()
    probe = d + "-probe"
    os.makedirs(probe)
    sizes = {}
    for name, trace in traces.items():
        _save(trace, os.path.join(probe, name))
        sizes[name] = {
            f.split(".")[0]: -(-os.path.getsize(os.path.join(probe, name, f)) // 4096) * 4
            for f in os.listdir(os.path.join(probe, name))
        }  # KiB, in whole pages
    shutil.rmtree(probe)
    old_kib = sum(sizes["old"].values())
    report = {"ground_truth": truth, "sizes_kib": sizes, "cases": {}}
    for case, room in (
        ("tensor file", sizes["new"]["tensors"] // 2),
        ("trace.json", sizes["new"]["tensors"] + sizes["new"]["trace"] // 2),
    ):
        where = os.path.join(d, case.replace(" ", "-"))
        _mount(where, old_kib + room)
        _save(traces["old"], where)
        before = _files(where)
        attempt = _attempt(lambda: _save(traces["new"], where))
        report["cases"][case] = {
            "attempt": attempt,
            "files_before": before,
            "files_after": _files(where),
            "loaded": _which(where, traces),
        }
    ro = os.path.join(d, "read-only")
    _mount(ro, 4 * old_kib)
    _save(traces["old"], ro)
    subprocess.run(["mount", "-o", "remount,ro", ro], check=True)
    ran = []
    handle = model.register_forward_pre_hook(lambda m, a: ran.append(1))
    report["read-only"] = {
        "save": _attempt(lambda: _save(traces["new"], ro)),
        "loaded": _which(ro, traces),
        "store": _attempt(lambda: tl.trace(model, ids["old"], use_cache=False, store=ro)),
        "store_below": _attempt(
            lambda: tl.trace(model, ids["old"], use_cache=False, store=os.path.join(ro, "sub"))
        ),
    }
    handle.remove()
    report["read-only"]["forwards_run"] = len(ran)
    full = os.path.join(d, "store-full")
    _mount(full, 64)
    report["store-full"] = _store_clean(
        model,
        ids["old"],
        full,
        _attempt(lambda: tl.trace(model, ids["old"], use_cache=False, store=full)),
    )
    return report


if __name__ == "__main__":
    mode, where = sys.argv[1], sys.argv[2]
    if mode == "kill":
        out = kill(where, int(sys.argv[3]), int(sys.argv[4]))
    elif mode == "fsize":
        out = fsize(where)
    elif mode == "ns":
        out = ns(where)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(out))

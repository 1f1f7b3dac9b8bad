"""Faults in saving, loading and storing: a save stopped at any point, a disk that is full or
read-only, and trace files whose tensors are not the ones their trace.json was saved with.

A saved directory must always load as the old trace or the new one, exactly, never a mix; a
trace whose parts do not belong together is refused with `TraceFileError`; a write the disk
refuses raises a TorchLens error with the OS error as its cause and leaves what was there.
Ground truth for values: the traces' own tensors, checked against plain forward hooks on the
model, and the values of the traces that were saved, compared bit for bit after loading. The
processes that are killed, and the writes the kernel refuses (`RLIMIT_FSIZE`, a full or
read-only tmpfs), run in `persist_faults_child.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import resource
import shutil
import struct
import subprocess
import sys
import threading

import pytest
import torch

import torchlens as tl
from torchlens import testing as _models
from torchlens._persist import schema, tensor_files

IDS = _models.token_ids(length=6)
OTHER = _models.token_ids(length=6, seed=1)
ROOT = pathlib.Path(__file__).resolve().parents[1]
CHILD = ROOT / "tests" / "persist_faults_child.py"


def _child(*args, prefix=(), timeout=600):
    """Run the child script; its JSON report."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]))
    out = subprocess.run(
        [*prefix, sys.executable, str(CHILD), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _save(trace, path):
    return trace.save(path)


@pytest.fixture(scope="module")
def traces():
    model = _models.build("gpt2", "sdpa")
    a, b = (
        tl.trace(model, IDS, use_cache=False),
        tl.trace(model, OTHER, use_cache=False),
    )  # no KV cache to leave out
    for ids, t in ((IDS, a), (OTHER, b)):
        seen = _models.hooked_outputs(model, t.blocks, ids, use_cache=False)
        for addr in t.blocks:
            assert torch.equal(t.modules[addr].facets["resid_post"], seen[addr])
    return a, b


def _equal(loaded, trace) -> bool:
    ops = all(
        all(
            (x is None) == (y is None) and (x is None or torch.equal(x, y))
            for x, y in zip(o.tensors, p.tensors)
        )
        for o, p in zip(loaded.ops, trace.ops)
    )
    facets = all(
        torch.equal(loaded.modules[a].facets["resid_post"], trace.modules[a].facets["resid_post"])
        for a in trace.blocks
    )
    return len(loaded.ops) == len(trace.ops) and ops and facets


# -- the trace file's parts ----------------------------------------------------------------------


def _doc(path):
    return json.loads((path / "trace.json").read_text())


def _edit(path, fn):
    doc = _doc(path)
    fn(doc)
    (path / "trace.json").write_text(json.dumps(doc))


def _tensor_path(path):
    (entry,) = _doc(path)["tensor_files"]
    return path / (entry if isinstance(entry, str) else entry["name"])


def _header(path):
    data = _tensor_path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _rewrite(path, fn):
    """Rewrite the tensor file's safetensors header with `fn(header)`, the data unchanged."""
    header, data = _header(path)
    fn(header)
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    _tensor_path(path).write_bytes(struct.pack("<Q", len(text)) + text + data)


def _forge(path, table=None):
    """Make trace.json agree with the tensor file as it is now, as a forger would: its size, and
    each tensor's digest (and, with `table`, dtype and shape) as the file's header says. What
    is checked next is what the file holds against the records."""
    header, data = _header(path)
    size = _tensor_path(path).stat().st_size

    def fix(doc):
        if isinstance(doc["tensor_files"][0], str):  # format 1 names only the file
            return
        doc["tensor_files"][0]["bytes"] = size
        for key, e in header.items():
            if key != "__metadata__":
                begin, end = e["data_offsets"]
                doc["tensors"][key]["sha256"] = hashlib.sha256(data[begin:end]).hexdigest()
                if table:
                    doc["tensors"][key].update(table(key, e))

    _edit(path, fix)


def _pick(path, where):
    """The key of a tensor whose shape `where(shape, dtype)` accepts, per the file's header."""
    header, _ = _header(path)
    return next(
        k for k, e in header.items() if k != "__metadata__" and where(e["shape"], e["dtype"])
    )


# -- a save stopped part way ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def kills(tmp_path_factory):
    return _child("kill", tmp_path_factory.mktemp("kill") / "t", 12, 0)


def test_a_save_killed_before_any_step_loads_as_the_old_trace_or_the_new_one(kills):
    """SIGKILL just before each file-system call of a save of `new` over `old` (every call but
    most tensor-byte writes): each directory loads as `old` or `new` bit for bit, the switch is
    one step (old before it, new from it on), and a finished save leaves no leftover."""
    assert kills["ground_truth"]
    steps = kills["steps"]
    assert len(steps) >= 20 and all(s["killed"] for s in steps[:-1]) and not steps[-1]["killed"]
    loaded = [s["loaded"] for s in steps]
    assert set(loaded) <= {"old", "new"}, [s for s in steps if s["loaded"] not in ("old", "new")]
    switch = loaded.index("new")
    assert loaded == ["old"] * switch + ["new"] * (len(loaded) - switch)
    assert 0 < switch < len(loaded) - 1  # killed before the switch, and after it
    files = kills["files_after_a_finished_save"]
    assert kills["loaded_then"] == "old" and len(files) == 2 and "trace.json" in files, files


def test_a_save_killed_at_random_times_loads_as_the_old_trace_or_the_new_one(kills):
    """SIGKILL from another process at random times while saves of `new` and `old` follow each
    other: whatever the kill interrupted, the directory loads as one of them exactly."""
    assert kills["random"] and all(r["loaded"] in ("old", "new") for r in kills["random"]), kills[
        "random"
    ]


# -- writes the disk refuses ---------------------------------------------------------------------


def _refused_write_kept_the_old(case, errno_):
    attempt = case["attempt"]
    assert attempt and attempt["error"] == "TraceFileError" and attempt["errno"] == errno_, attempt
    assert "is unchanged" in attempt["message"]
    assert case["loaded"] == "old" and case["files_after"] == case["files_before"], case


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="no RLIMIT_FSIZE here")
def test_a_write_refused_mid_file_leaves_the_old_trace_and_raises_trace_file_error(tmp_path):
    """The kernel refuses writes past a file size limit (EFBIG), inside the tensor file and inside
    trace.json: `TraceFileError` with the OS error as its cause, the old trace loads unchanged,
    no partial file is left. A store= capture refused that way raises `StoreSpecError`, removes
    the files it wrote and leaves no hook behind."""
    report = _child("fsize", tmp_path / "f")
    assert report["ground_truth"]
    for case in report["cases"].values():
        _refused_write_kept_the_old(case, 27)
    store = report["store"]
    assert store["attempt"]["error"] == "StoreSpecError" and store["attempt"]["errno"] == 27, store
    assert store["files_after"] == [] and store["hooks_left"] == 0 and store["modes_left"] == 0
    assert store["plain_trace_ok"]


def _namespace_works(tmp_path) -> bool:
    """Whether this machine lets a process mount a tmpfs in a user and mount namespace of its own."""
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    try:
        return (
            subprocess.run(
                ["unshare", "-rm", "mount", "-t", "tmpfs", "tmpfs", str(probe)],
                capture_output=True,
                timeout=60,
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_a_full_or_read_only_disk_leaves_the_old_trace(tmp_path):
    """Real file systems, in a namespace of the child's own: tmpfs that fill up (ENOSPC) inside
    the tensor file and inside trace.json, and one remounted read-only (EROFS) under a saved
    trace: `TraceFileError`, old trace unchanged; `store=` there is refused before the forward,
    and a store that fills up raises `StoreSpecError` and leaves nothing."""
    if not _namespace_works(tmp_path):
        pytest.skip("this machine does not let a process mount a tmpfs in its own namespace")
    report = _child("ns", tmp_path / "n", prefix=["unshare", "-rm"])
    assert report["ground_truth"]
    for case in report["cases"].values():
        _refused_write_kept_the_old(case, 28)
    ro = report["read-only"]
    assert (
        ro["save"]["error"] == "TraceFileError"
        and ro["save"]["errno"] == 30
        and "read-only" in ro["save"]["message"]
    )
    assert ro["loaded"] == "old"
    for store in (ro["store"], ro["store_below"]):
        assert store["error"] == "StoreSpecError" and "not writable" in store["message"], store
    assert ro["forwards_run"] == 0
    full = report["store-full"]
    assert full["attempt"]["error"] == "StoreSpecError" and full["attempt"]["errno"] == 28
    assert (
        full["files_after"] == []
        and full["hooks_left"] == 0
        and full["modes_left"] == 0
        and full["plain_trace_ok"]
    )


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0,
    reason="root writes into a directory whatever its mode says",
)
def test_a_read_only_directory_is_refused_for_save_and_store(tmp_path, traces):
    a, b = traces
    _save(a, tmp_path / "t")
    os.chmod(tmp_path / "t", 0o500)
    try:
        with pytest.raises(tl.TraceFileError, match="may not write") as info:
            _save(b, tmp_path / "t")
        assert isinstance(info.value.__cause__, PermissionError)
        assert _equal(tl.load(tmp_path / "t"), a)
        with pytest.raises(tl.StoreSpecError, match="not writable"):
            tl.trace(_models.build("gpt2", "sdpa"), IDS, store=tmp_path / "t")
    finally:
        os.chmod(tmp_path / "t", 0o700)


@pytest.mark.parametrize("code", [30, 13], ids=["EROFS", "EACCES"])
def test_a_refused_write_is_refused_for_save_and_store_also_as_root(
    tmp_path, traces, monkeypatch, code
):
    """The kernel's refusal, simulated where root would ignore a mode: every file `os.open`
    would create in the directory fails with EROFS or EACCES, and `os.access` says it is not
    writable. Save raises `TraceFileError` (cause: the OSError) leaving the old trace loadable
    and the directory as it was; a store there is refused before the forward."""
    a, b = traces
    d = tmp_path / "t"
    _save(a, d)
    before = sorted(os.listdir(d))
    real_open, real_access = os.open, os.access

    def refusing_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and os.path.dirname(os.path.abspath(os.fspath(path))) == str(d):
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(
        os,
        "access",
        lambda p, mode, *a, **k: False if os.fspath(p) == str(d) else real_access(p, mode, *a, **k),
    )
    words = "read-only" if code == 30 else "may not write"
    with pytest.raises(tl.TraceFileError, match=words) as info:
        _save(b, d)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == code
    model = _models.build("gpt2", "sdpa")
    ran = []
    handle = model.register_forward_pre_hook(lambda m, args: ran.append(1))
    try:
        with pytest.raises(tl.StoreSpecError, match="not writable"):
            tl.trace(model, IDS, store=d)
    finally:
        handle.remove()
    assert not ran  # refused before the forward
    monkeypatch.setattr(os, "open", real_open)
    monkeypatch.setattr(os, "access", real_access)
    assert sorted(os.listdir(d)) == before
    assert _equal(tl.load(d), a)


def test_a_disk_full_at_any_write_leaves_the_old_trace(tmp_path, traces, monkeypatch):
    """`os.write` fails with ENOSPC at the first, a middle, or the last write of a save (the
    tensor file's header, tensor bytes, trace.json): `TraceFileError` whose cause is the
    OSError, the old trace loads bit for bit and the directory holds what it held."""
    a, b = traces
    _save(a, tmp_path / "t")
    before = sorted(os.listdir(tmp_path / "t"))
    real = os.write
    count = []

    def counting(fd, data):
        count.append(1)
        return real(fd, data)

    monkeypatch.setattr(os, "write", counting)
    _save(b, tmp_path / "scratch")
    monkeypatch.setattr(os, "write", real)
    writes = len(count)
    assert writes > 10
    for fail_at in sorted({0, 1, writes // 2, writes - 2, writes - 1}):
        seen = []

        def full(fd, data, fail_at=fail_at, seen=seen):
            seen.append(1)
            if len(seen) > fail_at:
                raise OSError(28, "No space left on device")
            return real(fd, data)

        monkeypatch.setattr(os, "write", full)
        try:
            with pytest.raises(
                tl.TraceFileError, match="No space left on device .ENOSPC.*is unchanged"
            ) as info:
                _save(b, tmp_path / "t")
        finally:
            monkeypatch.setattr(os, "write", real)
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == 28
        assert sorted(os.listdir(tmp_path / "t")) == before, fail_at
        assert _equal(tl.load(tmp_path / "t"), a)


def test_a_path_under_a_file_is_refused_by_save_and_store(tmp_path, traces):
    a, _ = traces
    (tmp_path / "file").write_text("x")
    with pytest.raises(tl.TraceFileError, match="is a file, so the directory"):
        _save(a, tmp_path / "file" / "t")
    model = _models.build("gpt2", "sdpa")
    ran = []
    handle = model.register_forward_pre_hook(lambda m, args: ran.append(1))
    try:
        with pytest.raises(tl.StoreSpecError, match="is a file, so no directory"):
            tl.trace(model, IDS, store=tmp_path / "file" / "store")
    finally:
        handle.remove()
    assert not ran  # refused before the forward


# -- parts that do not belong together -----------------------------------------------------------


def test_the_old_json_with_another_saves_tensor_file_is_refused(tmp_path, traces):
    """The mix a torn save of format 1 left: trace.json of one trace, the tensor file of another
    with the same shapes. It loaded, serving token ids and logits in the wrong places."""
    a, b = traces
    _save(a, tmp_path / "a")
    _save(b, tmp_path / "b")
    shutil.copyfile(_tensor_path(tmp_path / "b"), _tensor_path(tmp_path / "a"))
    with pytest.raises(tl.TraceFileError, match="not from one save"):
        tl.load(tmp_path / "a")
    _forge(tmp_path / "a")  # even with the size and every digest made to agree: another save's file
    if "tensors" in _doc(tmp_path / "a"):
        with pytest.raises(tl.TraceFileError, match="written by the save"):
            tl.load(tmp_path / "a")


def test_a_tensor_files_header_that_disagrees_with_trace_json_is_refused(tmp_path, traces):
    """A header shape [1,6] changed to [6,1], or F32 changed to I32: refused as it is, refused
    when trace.json's digests are made to agree, and refused when trace.json's tensor table is
    changed to match too (the op or facet record says otherwise)."""
    a, _ = traces
    for change in ("shape", "dtype"):
        d = tmp_path / change
        _save(a, d)
        if change == "shape":
            key = _pick(d, lambda s, dt: len(s) == 2 and s[0] != s[1])
            new = lambda e: {"shape": e["shape"][::-1]}
        else:
            key = _pick(d, lambda s, dt: dt == "F32" and len(s) == 3)
            new = lambda e: {"dtype": "I32"}
        _rewrite(d, lambda h: h[key].update(new(h[key])))
        with pytest.raises(tl.TraceFileError):
            tl.load(d)
        _forge(d)
        with pytest.raises(tl.TraceFileError, match=rf"holds tensor '{key}' as"):
            tl.load(d)

        def table(k, e):  # trace.json's table says what the header says
            return (
                {
                    "shape": e["shape"],
                    "dtype": str(tensor_files.TORCH_DTYPES[e["dtype"]]).removeprefix("torch."),
                }
                if k == key
                else {}
            )

        _forge(d, table)
        with pytest.raises(
            tl.TraceFileError, match="is recorded as .* but the tensor trace.json gives it"
        ):
            tl.load(d)


def test_swapped_offsets_of_two_same_shape_tensors_are_refused(tmp_path, traces):
    a, _ = traces
    d = tmp_path / "t"
    _save(a, d)
    header, _ = _header(d)
    by_shape = {}
    for k, e in header.items():
        if k != "__metadata__":
            by_shape.setdefault((tuple(e["shape"]), e["dtype"]), []).append(k)
    x, y = next(ks for ks in by_shape.values() if len(ks) >= 2)[:2]

    def swap(h):
        h[x]["data_offsets"], h[y]["data_offsets"] = h[y]["data_offsets"], h[x]["data_offsets"]

    _rewrite(d, swap)
    with pytest.raises(tl.TraceFileError, match=f"tensor '({x}|{y})'.*SHA-256|not from one save"):
        tl.load(d)


def test_absurd_shapes_are_refused_before_anything_is_allocated(tmp_path, traces):
    a, _ = traces
    d = tmp_path / "t"
    _save(a, d)
    original = (d / "trace.json").read_text()
    # a saved facet's shape in trace.json: 10**12 x 10**12 elements, more than any tensor holds
    block = a.blocks[0]

    def huge(doc):
        site = next(
            o
            for o in doc["objects"]
            if o["class"] == "FacetSite"
            and o["fields"]["name"] == "resid_post"
            and isinstance(o["fields"]["tensor"], dict)
            and "tensor" in o["fields"]["tensor"]
        )
        site["fields"]["shape"] = {"tuple": [10**12, 10**12]}

    _edit(d, huge)
    with pytest.raises(tl.TraceFileError, match="shape"):
        tl.load(d)
    # a header and table agreeing on 4 GiB for a tensor the file holds 768 bytes of
    (d / "trace.json").write_text(original)
    key = _pick(d, lambda s, dt: s == [1, 6, 32] and dt == "F32")
    _rewrite(d, lambda h: h[key].update(shape=[1024, 1024, 1024]))
    _forge(d, lambda k, e: {"shape": e["shape"]} if k == key else {})
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(tl.TraceFileError, match="does not fill bytes"):
        tl.load(d)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    assert grown_kib < 1 << 20, grown_kib  # no 4 GiB allocation was made
    assert block  # the trace had blocks to pick a facet from


def test_json_nested_200000_deep_is_refused_with_trace_file_error(tmp_path, traces):
    a, _ = traces
    d = tmp_path / "t"
    _save(a, d)
    (d / "trace.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(tl.TraceFileError, match="nests its values too deeply"):
        tl.load(d)
    _save(a, d)
    text = (d / "trace.json").read_text()
    doc = json.loads(text)
    root = doc["objects"][doc["root"]]["fields"]
    root["output"] = "PLACEHOLDER"
    (d / "trace.json").write_text(
        json.dumps(doc).replace('"PLACEHOLDER"', "[" * 200_000 + "]" * 200_000)
    )
    with pytest.raises(tl.TraceFileError, match="too deeply"):
        tl.load(d)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("modules", 5, "modules = 5 .type int.; a Trace's modules must be a ModuleMap record"),
        ("blocks", {"tuple": ["x"]}, "blocks must be a list"),
        ("ops", [{"obj": 0}], "ops must be a list of .an OpRecord record."),
    ],
)
def test_a_record_field_of_the_wrong_type_is_refused_on_load(tmp_path, traces, field, value, words):
    """Before: `modules: 5` loaded, and the first use raised a raw TypeError."""
    a, _ = traces
    d = tmp_path / "t"
    _save(a, d)
    _edit(d, lambda doc: doc["objects"][doc["root"]]["fields"].update({field: value}))
    with pytest.raises(tl.TraceFileError, match=words):
        tl.load(d)


@pytest.mark.parametrize("field", ["check", "summary", "pending", "__class__", "saved_with"])
def test_a_field_a_record_does_not_store_is_refused(tmp_path, traces, field):
    """Before: a `check` field loaded and shadowed `Trace.check`."""
    a, _ = traces
    d = tmp_path / "t"
    _save(a, d)
    _edit(d, lambda doc: doc["objects"][doc["root"]]["fields"].update({field: 1}))
    with pytest.raises(tl.TraceFileError, match=rf"not stored: \['{field}'\], refused"):
        tl.load(d)


def test_an_op_index_out_of_range_is_refused(tmp_path, traces):
    a, _ = traces
    d = tmp_path / "t"
    _save(a, d)

    def far(doc):
        op = next(
            o
            for o in doc["objects"]
            if o["class"] == "OpRecord"
            and o["fields"]["inputs"]["tuple"]
            and isinstance(o["fields"]["inputs"]["tuple"][0], dict)
            and "ref" in o["fields"]["inputs"]["tuple"][0]
        )
        op["fields"]["inputs"]["tuple"][0]["ref"] = [10**6, 0]

    _edit(d, far)
    with pytest.raises(tl.TraceFileError, match="names op 1000000"):
        tl.load(d)


def test_a_format_1_trace_gets_the_version_error(tmp_path, traces):
    a, _ = traces
    d = tmp_path / "t"
    _save(a, d)
    _edit(d, lambda doc: doc.update(format_version=1, tensor_files=["tensors.safetensors"]))
    with pytest.raises(
        tl.TraceFileError, match="format version 1; this TorchLens reads version 2.*save it again"
    ):
        tl.load(d)


# -- what a save leaves ---------------------------------------------------------------------------


def test_a_save_removes_the_old_trace_and_leftovers_and_nothing_else(tmp_path, traces):
    a, b = traces
    d = tmp_path / "t"
    _save(a, d)
    old = _tensor_path(d).name
    (d / "notes.txt").write_text("mine")
    (d / "tensors-00000.safetensors").write_text("a store= file, not a save's")
    leftovers = [
        "tensors.0123456789abcdef.safetensors",
        "trace.json.0123456789abcdef.part",
        "tensors.safetensors",
        "trace.json.tmp",
    ]
    for name in leftovers:
        (d / name).write_text("left by a save that was stopped")
    _save(b, d)
    new = _tensor_path(d).name
    assert new != old and new.startswith("tensors.")
    assert sorted(os.listdir(d)) == sorted(
        ["trace.json", new, "notes.txt", "tensors-00000.safetensors"]
    )
    assert _equal(tl.load(d), b)


def test_the_tensor_file_is_safetensors_and_holds_the_table(tmp_path, traces):
    safetensors = pytest.importorskip("safetensors.torch")
    a, _ = traces
    d = tmp_path / "t"
    _save(a, d)
    theirs = safetensors.load_file(_tensor_path(d))
    doc = _doc(d)
    assert set(theirs) == set(doc["tensors"])
    for key, e in doc["tensors"].items():
        t = theirs[key]
        assert list(t.shape) == e["shape"] and str(t.dtype) == f"torch.{e['dtype']}"
        assert (
            hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            == e["sha256"]
        )


def test_saves_and_loads_in_threads_see_whole_traces(tmp_path, traces):
    """Two threads save two traces over each other while a third loads: every load is one of the
    two exactly (the directory lock keeps a load from meeting a save's clean-up)."""
    a, b = traces
    d = tmp_path / "t"
    _save(a, d)
    errors, loads = [], []

    def saver(t):
        try:
            for _ in range(8):
                _save(t, d)
        except Exception as exc:
            errors.append(exc)

    def loader():
        try:
            for _ in range(12):
                got = tl.load(d)
                loads.append("a" if _equal(got, a) else "b" if _equal(got, b) else "mix")
        except Exception as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=saver, args=(a,)),
        threading.Thread(target=saver, args=(b,)),
        threading.Thread(target=loader),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert loads and set(loads) <= {"a", "b"}, loads
    assert len(os.listdir(d)) == 2


# -- the record table ----------------------------------------------------------------------------


def test_the_stored_fields_are_the_record_classes_fields():
    """`_persist.schema.FIELDS` names exactly each record's fields (a dataclass's fields, a class's
    slots or `_PERSISTED`, the attributes `Trace.__init__` sets), and no
    stored field is a method or a property without a setter."""
    classes = schema.record_classes()
    assert set(schema.FIELDS) == set(classes)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    trace = tl.trace(model, torch.ones(1, 2))
    trace.output
    for name, cls in classes.items():
        fields = set(schema.FIELDS[name])
        if dataclasses.is_dataclass(cls):
            want = {f.name for f in dataclasses.fields(cls)}
        elif hasattr(cls, "_PERSISTED"):
            want = set(cls._PERSISTED)
        elif getattr(cls, "__slots__", None):
            want = set(cls.__slots__)
        else:  # Trace: the attributes its __init__ sets, under their stored names
            stored = {a: f for f, a in getattr(cls, "_persist_renames", {}).items()}
            want = {stored.get(a, a) for a in vars(trace)}
        assert fields == want, name
        for f in fields:
            attr = getattr(cls, getattr(cls, "_persist_renames", {}).get(f, f), None)
            assert not callable(attr) or isinstance(attr, property) and attr.fset is not None, (
                name,
                f,
            )

"""`torch.compile`d code under a trace: run it eagerly, or refuse a trace with a hole in it."""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any

from torch import nn

from torchlens._core.errors import CaptureError

if TYPE_CHECKING:
    from torchlens._capture.recorder import Recorder

__all__ = ["CompiledRunsEagerly", "check_compiled", "compiled_module_class"]


class CompiledRunsEagerly:
    """While at least one trace runs, `torch.compile`d code runs its eager Python instead.

    A compiled module or function would otherwise run a graph that TorchLens's hooks and torch
    function mode cannot see into (or fail to compile with them, under `fullgraph=True`).

    The stance cannot be scoped to the tracing thread: torch (checked on 2.13) keeps it in one
    module global (`torch._dynamo.eval_frame._stance`, swapped by `set_stance`) that every
    compiled call reads on entry, from any thread, and a compiled function sets its own frame
    callback, so no thread-local disabling reaches inside it. The consequence, which
    `tests/test_reliability.py` checks: while any trace runs, compiled code called from *other*
    threads runs its eager Python too (same values, no compiled graph, not recorded in the
    trace); when the last trace ends, also by raising, the stance that was set before is back
    and compiled code runs compiled again, without recompiling.

    So the first trace to start sets `force_eager` and the last to finish restores whatever
    stance was set before; a counter under a lock keeps concurrent and nested traces from
    restoring it early. Without `torch.compiler.set_stance` (torch < 2.6) this does nothing, and
    `check_compiled` reports a compiled module whose ops the trace missed.
    """

    _lock = threading.Lock()
    _depth = 0
    _token: Any = None

    def __enter__(self) -> CompiledRunsEagerly:
        self.active = False
        dynamo = sys.modules.get("torch._dynamo")  # never imported: nothing can be compiled
        set_stance = getattr(dynamo, "set_stance", None)
        if set_stance is None:
            return self
        cls = type(self)
        with cls._lock:
            if cls._depth == 0:
                try:
                    cls._token = set_stance("force_eager")  # remembers the stance it replaces
                except RuntimeError:  # trace() called inside a compiled region
                    return self
            cls._depth += 1
            self.active = True
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not self.active:
            return
        cls = type(self)
        with cls._lock:
            cls._depth -= 1
            if cls._depth == 0:
                token, cls._token = cls._token, None
                token.__exit__(None, None, None)  # back to the stance before the first trace


def compiled_module_class() -> type | None:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def _is_compiled(module: nn.Module) -> bool:
    """A `torch.compile(module)` wrapper, or a module compiled in place with `module.compile()`."""
    wrapper = compiled_module_class()
    return (wrapper is not None and isinstance(module, wrapper)) or getattr(
        module, "_compiled_call_impl", None
    ) is not None


def check_compiled(rec: Recorder, modules: dict[str, nn.Module]) -> None:
    """Refuse a trace in which a compiled module produced a tensor while no op of it was seen."""
    for call in rec.calls:
        if (
            call.first_op == call.end_op
            and call.output_ref is None
            and call._out is not None
            and _is_compiled(modules[call.address])
        ):
            raise CaptureError(
                f"module {call.address or '<root>'!r} is compiled with torch.compile and its compiled code "
                "ran without TorchLens seeing a single op of it, so the trace would have a hole there. "
                "TorchLens runs compiled code eagerly during a trace with torch.compiler.set_stance"
                "('force_eager') where torch has it (2.6 and later), which did not happen here. Trace the "
                "eager module instead: replace a torch.compile(module) wrapper by its `_orig_mod` "
                "(model.sub = model.sub._orig_mod), undo module.compile() with "
                "module._compiled_call_impl = None, or call trace() under "
                "torch.compiler.set_stance('force_eager')."
            )

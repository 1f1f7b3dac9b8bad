"""Python's cyclic garbage collector, paused while a trace records and assembles.

A trace makes many small objects that Python's cyclic collector tracks (op records, module
calls, weak references, tuples of references). While they are being made the collector runs
every 700 new objects; each pass moves the objects alive at that moment one generation older,
and every object that reaches the oldest generation brings the next *full* pass closer: a pass
over every tracked object of the process (about 360,000 once transformers is imported, some
0.15 s on this project's CPU machine). Most of what a trace makes while it runs is gone by the
time it returns, so those passes are spent on objects that would have been freed anyway.

`paused()` turns the collector off for the call and restores it in a `finally`, as the standard
library's `timeit` does for its timings. Nothing is lost: reference counting still frees every
object that is not part of a cycle at once, and a cycle made meanwhile (by the model's own code
or by TorchLens) is found by the first pass after the call, which the objects made during it
trigger. Measured on every family of `torchlens.testing` (both grad modes, `save="all"`), a
forward and its trace leave no cycle that holds a tensor, so pausing holds no activation memory
longer than the call.

The pause is shared by every trace of the process: the first one in takes the collector's state
and turns it off, the last one out restores that state (a trace inside a traced forward, traces
in several threads). A collector the caller turned off stays off.
"""

from __future__ import annotations

import gc
import threading
from types import TracebackType

__all__ = ["paused"]

_LOCK = threading.Lock()
#: how many traces are inside `paused` now
_DEPTH = 0
#: whether the collector was on when the first of them came in
_WAS_ENABLED = False


class _Paused:
    """The context manager `paused` returns (it holds no state: the state is the module's)."""

    __slots__ = ()

    def __enter__(self) -> None:
        global _DEPTH, _WAS_ENABLED
        with _LOCK:
            if _DEPTH == 0:
                _WAS_ENABLED = gc.isenabled()
                gc.disable()
            _DEPTH += 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        global _DEPTH
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0 and _WAS_ENABLED:
                gc.enable()


_PAUSED = _Paused()


def paused() -> _Paused:
    """A context manager: the cyclic garbage collector is off inside it, and as it was before once
    the last of the nested or concurrent `paused` blocks exits (even by an exception).

    Examples:
        >>> import gc
        >>> with paused():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    return _PAUSED

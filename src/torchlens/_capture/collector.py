"""Python's cyclic garbage collector, paused while a trace records and assembles.

A trace makes many small objects that Python's cyclic collector tracks (op records, module
calls, weak references, tuples of references). While they are being made the collector runs
every 700 new objects; each pass moves the objects alive at that moment one generation older,
and every object that reaches the oldest generation brings the next *full* pass closer: a pass
over every tracked object of the process (about 360,000 in this project's benchmark process,
with torch, transformers and a model loaded; some 0.15 s on its CPU machine). Most of what a
trace makes while it runs is gone by the time it returns, so those passes are spent on objects
that would have been freed anyway.

`paused()` turns the collector off for the call and restores it in a `finally`, as the standard
library's `timeit` does for its timings. Reference counting still frees at once every object no
reference cycle holds; what a cycle made meanwhile holds (by the model's own code or by
TorchLens) is freed by the first collection after the call, which the objects made during it
bring on. Measured on the families of `torchlens.testing` (both grad modes, `save="all"`) and a
`generate` of GPT-2 and Llama, a forward and its trace leave no cycle that holds a tensor, so
there pausing holds no activation memory longer than the call.

The pause is shared by every trace of the process, as the collector's one switch is: the first
trace in takes the collector's state and turns it off, and the last one out sets that state
again, on or off (a trace inside a traced forward, traces in several threads). So a collector
that was off when the first running trace began is off again after the last; one turned off by
other code while traces run (another thread, the forward itself) is set back to the state the
first trace took. Each thread's traces are counted apart: a process forked while traces run in
other threads gets the state back in the child, where those threads do not exist.
"""

from __future__ import annotations

import gc
import os
import threading
from types import TracebackType

__all__ = ["paused"]

_LOCK = threading.Lock()
#: thread id -> how many traces of that thread are inside `paused` now
_DEPTHS: dict[int, int] = {}
#: whether the collector was on when the first of the running traces came in
_WAS_ENABLED = False


def _set(enabled: bool) -> None:
    if enabled:
        gc.enable()
    else:
        gc.disable()


class _Paused:
    """The context manager `paused` returns (it holds no state: the state is the module's)."""

    __slots__ = ()

    def __enter__(self) -> None:
        global _WAS_ENABLED
        me = threading.get_ident()
        with _LOCK:
            if not _DEPTHS:
                _WAS_ENABLED = gc.isenabled()
            _DEPTHS[me] = _DEPTHS.get(me, 0) + 1
            gc.disable()  # also where the forward of an outer trace turned it on

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        me = threading.get_ident()
        with _LOCK:
            n = _DEPTHS.get(me, 0) - 1
            if n > 0:
                _DEPTHS[me] = n
            else:
                _DEPTHS.pop(me, None)
            if not _DEPTHS:
                _set(_WAS_ENABLED)


def _after_fork_in_child() -> None:
    """In a process forked while traces ran: only the forking thread goes on, so only its own
    traces will exit; with none, the collector gets the state the first trace took."""
    global _LOCK
    _LOCK = threading.Lock()  # another thread may have held it at the fork
    me = threading.get_ident()
    for tid in [t for t in _DEPTHS if t != me]:
        del _DEPTHS[tid]
    if not _DEPTHS:
        _set(_WAS_ENABLED)


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_after_fork_in_child)

_PAUSED = _Paused()


def paused() -> _Paused:
    """A context manager: the cyclic garbage collector is off inside it, and set back to the state
    the first of the running `paused` blocks found once the last of them exits (even by an
    exception).

    Examples:
        >>> import gc
        >>> with paused():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    return _PAUSED

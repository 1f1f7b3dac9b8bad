"""The errors `Trace.draw` raises."""

from __future__ import annotations

from torchlens._core.errors import TorchLensError

__all__ = ["DrawSpecError", "DrawingTooLarge", "LayoutEngineMissing"]


class DrawSpecError(TorchLensError, ValueError):
    """An argument of [`Trace.draw`][torchlens.Trace.draw] is not accepted; the message says what is."""


class DrawingTooLarge(DrawSpecError):
    """The drawing asked for has more nodes than `max_nodes`; the message gives smaller ones.

    Raised before the layout starts, so a call that would take minutes fails at once.
    """


class LayoutEngineMissing(TorchLensError, ImportError):
    """pygraphviz (Graphviz in a wheel, the layout engine) is not installed."""

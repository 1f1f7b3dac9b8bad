"""How a drawing looks: font sizes, character widths, colours and the status styles, and the
small text formatters every part of the drawing shares."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


# -- drawing constants -------------------------------------------------------------------------

FONT = "DejaVu Sans Mono, Menlo, Consolas, Liberation Mono, monospace"
FS = 12  # op names, box titles
FS_SMALL = 11  # shapes, marks, notes: never below 11 px at 100% zoom
CW = 0.62  # character width per px of font size, a little over what monospace fonts use
LH = 15  # line height of 12 px text
LH_SMALL = 14
PAD_X = 7
PAD_Y = 5
MARGIN = 14
NOTE_CHARS = 96  # wrap width of the notes under the graph
BOX_LABEL_CHARS = 58  # wrap width of a box's reason line

#: Status -> (strong colour, pale fill, word shown in the label). Okabe-Ito hues, which stay apart
#: under the common colour-vision deficiencies; the word carries the status too.
STATUS_STYLE = {
    "real": ("#0072b2", "#e3f0fa", "real"),
    "reconstructed_read_only": ("#009e73", "#dff5ee", "read-only"),
    "needs_capture": ("#e69f00", "#fdf1d8", "needs capture"),
    "refused": ("#d55e00", "#fbe6d9", "refused"),
    "structurally_absent": ("#6e7781", "#eef0f2", "absent"),
    "ambiguous": ("#cc79a7", "#f8e8f1", "ambiguous"),
}

COLORS = {
    "bg": "#ffffff",
    "ink": "#1f2328",
    "muted": "#57606a",
    "line": "#8c959f",
    "edge": "#57606a",
    "op": "#f6f8fa",
    "input": "#e7f0fb",
    "input_line": "#0072b2",
    "param": "#fff8e5",
    "param_line": "#b08800",
    "module": "#eef1f8",
    "module_line": "#57606a",
    "inplace_line": "#d55e00",
    "loop": "#0072b2",
    "stub": "#ffffff",
    "box_line": "#a5adb6",
    "group_line": "#0072b2",
}
BOX_FILLS = ("#fbfbfd", "#f3f5f9")


def ranges(ints: list[int]) -> str:
    """`[0, 1, 2, 5, 7, 8]` -> `'0–2, 5, 7–8'`."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive integers
    for i in ints:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}–{b}" if a != b else f"{a}" for a, b in runs)


def fmt_shape(shape) -> str:
    return "×".join(map(str, shape)) if len(shape) else "scalar"


def fmt_dtype(d) -> str:
    return str(d).replace("torch.", "")


def wrap(text: str, width: int) -> list[str]:
    lines: list[str] = []
    for word in text.split():
        while len(word) > width:  # a long address: cut it (rare)
            if lines and not lines[-1]:
                lines.pop()
            lines.append(word[:width])
            word = word[width:]
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines or [""]


def relative(address: str, parent: str) -> str:
    if parent and address.startswith(parent + "."):
        return address[len(parent) + 1 :]
    return address or "<root>"

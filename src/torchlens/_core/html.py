"""Small HTML tables for the notebook reprs (`_repr_html_`) of traces and reports.

Notebook front ends right-align table cells by default and some drop `<style>` elements, so
every cell carries its own inline style. Callers pass cell contents already escaped (with
`esc` or `code`); captions and notes are plain text and escaped here.
"""

from __future__ import annotations

import html

_CELL = "text-align:left;vertical-align:top;padding:2px 8px"


def esc(value: object) -> str:
    """`value` as HTML text."""
    return html.escape(str(value), quote=True)


def code(value: object, style: str = "", title: str = "") -> str:
    """`value` in a `<code>` element, with an optional inline style and tooltip."""
    attrs = (f' style="{esc(style)}"' if style else "") + (
        f' title="{esc(title)}"' if title else ""
    )
    return f"<code{attrs}>{esc(value)}</code>"


def nowrap(html_text: str) -> str:
    """HTML that must not break across lines (a shape, an address)."""
    return f'<span style="white-space:nowrap">{html_text}</span>'


def table(
    head: list[str], rows: list[list[str]], caption: str = "", note: str = "", footer: str = ""
) -> str:
    """An HTML table: `head` is plain text, `rows` are cells of HTML, `note` a last full-width row,
    `footer` HTML in a full-width footer cell (`<tfoot>`)."""
    parts = ['<table class="tl-repr">']
    if caption:
        parts.append(
            f'<caption style="text-align:left;caption-side:top;padding:2px 8px">{esc(caption)}</caption>'
        )
    parts.append(
        "<thead><tr>"
        + "".join(f'<th style="{_CELL};white-space:nowrap">{esc(h)}</th>' for h in head)
        + "</tr></thead>"
    )
    parts.append("<tbody>")
    for row in rows:
        parts.append("<tr>" + "".join(f'<td style="{_CELL}">{cell}</td>' for cell in row) + "</tr>")
    if note:
        parts.append(
            f'<tr><td colspan="{len(head)}" style="{_CELL};color:#57606a">{esc(note)}</td></tr>'
        )
    parts.append("</tbody>")
    if footer:
        parts.append(
            f'<tfoot><tr><td colspan="{len(head)}" style="{_CELL}">{footer}</td></tr></tfoot>'
        )
    parts.append("</table>")
    return "".join(parts)

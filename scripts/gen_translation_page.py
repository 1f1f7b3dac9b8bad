"""Generate the translation page (docs/aliases/translation.md) from the naming tables.

For every family of `torchlens.testing.FAMILIES` the script builds the family's small model
(`torchlens.testing.build`: two layers, seeded weights, eager attention), traces it with
`save="all"` and runs its checks, then resolves every name of every naming generation on the
trace (`torchlens.mechinterp._translate.names_by_site`, through the one resolver, as
`mi.translate(..., family=...)` does). One row per site the names reach: its module and facet,
its status, and each generation's names for it, so a row is a translation. For GPT-2, Llama
and Qwen3 a last column gives the vLLM hook that reads the site, from the table of
docs/guides/serving-engines.md (the recipe that page runs), matched by its "3.x" names.

The page has a hand-written part (kept as is) and a generated part between two marker comments.

Usage:
    python scripts/gen_translation_page.py          # rewrite the page
    python scripts/gen_translation_page.py --check  # exit 1 if the committed page is stale

The page says which transformers and torch versions it was made with (a model's code, and so a
status, can change with them); `tests/test_translation_page.py` runs the check and compares those
versions with constraints.txt.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from markdown.extensions.toc import slugify

import torchlens as tl
import torchlens.mechinterp as mi
from torchlens import testing
from torchlens._core.facet_spec import SPECS
from torchlens.mechinterp._translate import names_by_site

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _outputs import main as run
from _outputs import splice

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "aliases" / "translation.md"
SERVING = ROOT / "docs" / "guides" / "serving-engines.md"
BEGIN = (
    "<!-- BEGIN GENERATED: scripts/gen_translation_page.py; edit the tables in "
    "src/torchlens/_naming/tables -->"
)
END = "<!-- END GENERATED -->"
GENERATIONS = tuple(mi.GENERATIONS)
#: family -> the word of the serving page's column header for its vLLM model.
VLLM_FAMILIES = {"gpt2": "GPT-2", "llama": "Llama", "qwen3": "Qwen3"}
#: The families' titles, as the other pages write them.
TITLES = {name: f.title for name, f in testing.FAMILIES.items()}


@dataclass
class Site:
    address: str  # with `{L}` for block 0's part of the address, `<root>` for the root module
    facet: str
    order: tuple
    status: set
    names: dict  # generation -> list of names (patterns with {L})


def serving_hooks(text: str) -> tuple[dict[str, dict[str, str]], list[str]]:
    """From the serving page's site table: {column word: {3.x name with {L}: what the hook reads}}, and the names.

    The table is the one whose first header cell says `TorchLens name ("3.x")`; each of its rows starts with the
    3.x names (in backticks) the hook in the other cells reads.
    """
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith("| TorchLens name")), None)
    if start is None:
        raise SystemExit(f"{SERVING}: no table whose first header cell is 'TorchLens name'")
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    out: dict[str, dict[str, str]] = {cell: {} for cell in header[1:]}
    names = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", cells[0].split("(")[0]):
            name = name.replace("{i}", "{L}")
            names.append(name)
            for column, cell in zip(header[1:], cells[1:]):
                out[column][name] = cell.replace("{i}", "{L}")
    return out, names


def _template(address: str, block0: str | None) -> str:
    if block0 is not None and (address == block0 or address.startswith(block0 + ".")):
        return block0[: -len("0")] + "{L}" + address[len(block0) :]
    return address or "<root>"


#: Facets in the order of the facet specification, a module's input first and its output last.
_ORDER = (
    ["input"] + [spec.name for spec in SPECS if spec.name not in ("input", "output")] + ["output"]
)


def _rank(facet: str) -> int:
    return _ORDER.index(facet) if facet in _ORDER else len(_ORDER)


def family_sites(family: str) -> tuple[tl.Trace, list[Site], dict[str, list[str]]]:
    """The family's sites at layer 0 and the global ones, with every generation's names; and the names with no site."""
    args, kwargs = testing.inputs(family)
    trace = tl.trace(testing.build(family), *args, save="all", **kwargs)
    trace.check()
    block0 = trace.blocks[0] if trace.blocks else None
    sites: dict[tuple, Site] = {}
    placed: dict[str, set[str]] = {g: set() for g in GENERATIONS}
    for generation in GENERATIONS:
        for (address, call, facet), resolutions in names_by_site(trace, generation).items():
            for r in resolutions:
                if r.layer not in (None, 0):
                    placed[generation].add(r.pattern)
                    continue
                key = (_template(address, block0), facet)
                if key not in sites:
                    record = trace.modules[address].calls[call or 0]
                    # a refused facet has no site: it is placed with its module's output
                    site = record.facets.sites.get(facet)
                    # forward order: an op's output where it was made; a derived facet with its module's output
                    where = (
                        site.op
                        if site is not None and site.kind == "real" and site.op is not None
                        else record.end_op - 1
                    )
                    sites[key] = Site(
                        key[0],
                        facet,
                        (where, record.first_op, _rank(facet)),
                        set(),
                        {g: [] for g in GENERATIONS},
                    )
                    sites[key].status.add(
                        mi.resolve_alias(trace, r.query, generation=generation).status
                    )
                name = r.pattern if r.layer is not None else r.query
                if name not in sites[key].names[generation]:
                    sites[key].names[generation].append(name)
                placed[generation].add(r.pattern)
    table_kind = trace.structure.kind
    unplaced = {}
    for generation in GENERATIONS:
        table = dict(mi.GENERATIONS[generation].by_kind).get(table_kind, mi.GENERATIONS[generation])
        unplaced[generation] = [
            row.name for row in table.rows if row.name not in placed[generation]
        ]
    return trace, sorted(sites.values(), key=lambda s: (s.order, s.facet)), unplaced


def _code(names: list[str]) -> str:
    return "<br>".join(f"`{n}`" for n in names) if names else "—"


def _status(words: set) -> str:
    return " ".join(f'<span class="tl-status tl-status--{w}">{w}</span>' for w in sorted(words))


def family_section(family: str, vllm: dict[str, dict[str, str]]) -> list[str]:
    trace, sites, unplaced = family_sites(family)
    spec = testing.FAMILIES[family]
    title = TITLES.get(family, family)
    legacy_only = all(set(s.names["4.x"]) <= set(s.names["3.x"]) for s in sites)
    column = next((c for c in vllm if VLLM_FAMILIES.get(family, "\0") in c), None)
    block = trace.blocks[0][:-1] + "{L}" if trace.blocks else "(none)"
    tl_headers = ["site", "2.x", "3.x, besides the 4.x names" if legacy_only else "3.x", "4.x"]
    other_headers = ["site", "status", "nnterp", "interp-engine"] + (
        ["vLLM hook"] if column else []
    )
    lines = [
        f"## {title}",
        "",
        f'`testing.build("{family}")`: `{spec.model}`, {len(trace.blocks)} layers; block `{{L}}` is '
        f"`{block}`, and a site inside it is written from it (`{{L}}.mlp` is `{block}.mlp`). "
        f"{len(sites)} sites have a name in some generation: the first table gives TransformerLens's "
        f"names, the second each site's status and the other libraries' names for it."
        + (
            f" The vLLM column is the hook of the [serving-engines recipe](../guides/serving-engines.md) "
            f"for vLLM's {VLLM_FAMILIES[family]} model (module names inside `{block}` are relative to it)."
            if column
            else ""
        ),
        "",
    ]
    tl_rows, other_rows = [], []
    for s in sites:
        legacy = (
            [n for n in s.names["3.x"] if n not in s.names["4.x"]]
            if legacy_only
            else s.names["3.x"]
        )
        address = (
            "{L}" + s.address[len(block) :]
            if trace.blocks and (s.address == block or s.address.startswith(block + "."))
            else s.address
        )
        site = f"`{address}`<br>`{s.facet}`"
        tl_rows.append([site, _code(s.names["2.x"]), _code(legacy), _code(s.names["4.x"])])
        cells = [site, _status(s.status), _code(s.names["nnterp"]), _code(s.names["interp-engine"])]
        if column:
            hooks = list(
                dict.fromkeys(vllm[column][n] for n in s.names["3.x"] if n in vllm[column])
            )
            cells.append("<br>".join(hooks) if hooks else "—")
        other_rows.append(cells)
    # the tl-translation class sets the tables a size smaller (docs/stylesheets/extra.css)
    for headers, rows in ((tl_headers, tl_rows), (other_headers, other_rows)):
        lines += ['<div class="tl-translation" markdown>', ""]
        lines += ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |" for cells in rows]
        lines += ["", "</div>", ""]
    lines += [
        f"Names with no site on {title} (each generation's own table, listed [here](index.md), gives each one's reason):",
        "",
    ]
    for generation in GENERATIONS:
        names = unplaced[generation]
        lines.append(
            f"- {generation}: " + (", ".join(f"`{n}`" for n in names) if names else "none")
        )
    return lines + [""]


def generated_section(families=None) -> str:
    vllm, _ = serving_hooks(SERVING.read_text(encoding="utf-8"))
    families = list(families or testing.FAMILIES)
    lines = [
        BEGIN,
        "",
        f"The tables were made with transformers {transformers.__version__} and torch "
        f"{torch.__version__}. A model's code can change between transformers versions, and with it "
        "what TorchLens finds: with another version a site's status can differ from the one given here.",
        "",
        "Families: "
        + ", ".join(f"[{TITLES.get(f, f)}](#{slugify(TITLES.get(f, f), '-')})" for f in families)
        + ".",
        "",
    ]
    for family in families:
        lines += family_section(family, vllm)
    return "\n".join(lines + [END])


def render(families=None) -> str:
    text = PAGE.read_text(encoding="utf-8")
    return splice(PAGE, text, BEGIN, END, generated_section(families))


def main(argv: list[str] | None = None) -> int:
    return run(
        __doc__, lambda: {PAGE: render()}, ROOT, "python scripts/gen_translation_page.py", argv
    )


if __name__ == "__main__":
    sys.exit(main())

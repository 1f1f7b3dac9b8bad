"""Generate the translation page (docs/aliases/translation.md) from the naming tables.

For every family of `torchlens.testing.FAMILIES` the script builds the family's small model
(`torchlens.testing.build`: two layers, seeded weights, eager attention), traces it with
`save="all"` and runs its checks, then resolves every name of every naming generation on the
trace (`torchlens.mechinterp._translate.names_by_site`, through the one resolver, as
`mi.translate(..., family=...)` does). One row per site the names reach: its module, call and
facet, its status (`resolve_alias`'s, at layers 0 and 1), and each generation's names for it, so a
row is a translation. For GPT-2, Llama and Qwen3 a last column gives the vLLM hook that reads the
site, from the table of docs/guides/serving-engines.md (the recipe that page runs), matched by its
"3.x" names.

The page has a hand-written part (kept as is) and a generated part between two marker comments.

Usage:
    python scripts/gen_translation_page.py          # rewrite the page
    python scripts/gen_translation_page.py --check  # exit 1 if the committed page is stale

A per-layer name's row is where it resolves at layer 0, written for layer `{L}` from where it
resolves at layer 1: the part of the module address that is `0` and `1` becomes `{L}` (in every
stack of layers, not only the one `trace.blocks` lists), and where both layers are calls of one
module (weights shared across layers, as ALBERT's) the row gives the call, `{L}`. A model with
several stacks and none feeding a language-model head (CLIP) has no block `{L}`: its per-layer
names resolve `ambiguous`, and the page lists them so.

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
    address: str  # with `{L}` where layer L's address differs from layer 0's, `<root>` for the root
    call: str | None  # which call of the module: `{L}` where layer L is call L of one module
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


def _template(at0: tuple[str, int | None], at1: tuple[str, int | None]) -> tuple[str, str | None]:
    """Layer L's module address and call, from where a name resolves at layers 0 and 1.

    `at0` and `at1` are `(module address, call)`. Where the two addresses differ in one part, `0`
    against `1` (`transformer.h.0.attn`, `transformer.h.1.attn`), that part is written `{L}`; where
    they are one address and the calls are 0 and 1 (one module run once per layer), the call is
    `{L}`.

    Raises:
        ValueError: the two sites differ in some other way.
    """
    (a0, c0), (a1, c1) = at0, at1
    p0, p1 = a0.split("."), a1.split(".")
    differ = [i for i, (x, y) in enumerate(zip(p0, p1)) if x != y]
    if (
        len(p0) == len(p1)
        and c0 == c1
        and len(differ) == 1
        and (p0[differ[0]], p1[differ[0]]) == ("0", "1")
    ):
        p0[differ[0]] = "{L}"
        return ".".join(p0), None if c0 is None else str(c0)
    if a0 == a1 and (c0, c1) == (0, 1):
        return a0, "{L}"
    raise ValueError(f"layer 0 reads {a0} (call {c0}), layer 1 reads {a1} (call {c1})")


#: Facets in the order of the facet specification, a module's input first and its output last.
_ORDER = (
    ["input"] + [spec.name for spec in SPECS if spec.name not in ("input", "output")] + ["output"]
)


def _rank(facet: str) -> int:
    return _ORDER.index(facet) if facet in _ORDER else len(_ORDER)


def family_sites(family: str) -> tuple[tl.Trace, list[Site], dict[str, list[tuple[str, str]]]]:
    """The family's sites, per layer and global, with every generation's names; and the names with no site.

    A per-layer name's site is where it resolves at layer 0, its address and call written for
    layer `{L}` from where it resolves at layer 1 (`_template`); its status is `resolve_alias`'s
    at both layers. The names with no site are grouped by generation and by the status
    `resolve_alias` gives them at layer 0 (`structurally_absent`, or `ambiguous` where the model has
    several stacks of layers and none is the language model's).
    """
    args, kwargs = testing.inputs(family)
    trace = tl.trace(testing.build(family), *args, save="all", **kwargs)
    trace.check()
    sites: dict[tuple, Site] = {}
    placed: dict[str, set[str]] = {g: set() for g in GENERATIONS}
    for generation in GENERATIONS:
        found = [r for rs in names_by_site(trace, generation).values() for r in rs]
        at_layer = {(r.pattern, r.layer): r for r in found}
        for r in found:
            placed[generation].add(r.pattern)
            if r.layer not in (None, 0):
                continue
            here = (r.module_address, r.call)
            if r.layer is None:
                address, call = (
                    r.module_address or "<root>",
                    None if r.call is None else str(r.call),
                )
                queries = [r.query]
            else:
                if (r.pattern, 1) not in at_layer:
                    raise SystemExit(
                        f"{family}: {r.pattern} reads a site at layer 0 but none at layer 1"
                    )
                r1 = at_layer[(r.pattern, 1)]
                try:
                    address, call = _template(here, (r1.module_address, r1.call))
                except ValueError as e:
                    raise SystemExit(f"{family}: {r.pattern}: {e}") from None
                queries = [r.query, r1.query]
            key = (address, call, r.facet)
            if key not in sites:
                record = trace.modules[r.module_address].calls[r.call or 0]
                # a refused facet has no site: it is placed with its module's output
                site = record.facets.sites.get(r.facet)
                # forward order: an op's output where it was made; a derived facet with its module's output
                where = (
                    site.op
                    if site is not None and site.kind == "real" and site.op is not None
                    else record.end_op - 1
                )
                sites[key] = Site(
                    address,
                    call,
                    r.facet,
                    (where, record.first_op, _rank(r.facet)),
                    set(),
                    {g: [] for g in GENERATIONS},
                )
            sites[key].status.update(
                mi.resolve_alias(trace, q, generation=generation).status for q in queries
            )
            name = r.pattern if r.layer is not None else r.query
            if name not in sites[key].names[generation]:
                sites[key].names[generation].append(name)
    table_kind = trace.structure.kind
    unplaced: dict[str, list[tuple[str, str]]] = {}
    for generation in GENERATIONS:
        table = dict(mi.GENERATIONS[generation].by_kind).get(table_kind, mi.GENERATIONS[generation])
        unplaced[generation] = [
            (
                row.name,
                mi.resolve_alias(trace, row.name.replace("{L}", "0"), generation=generation).status,
            )
            for row in table.rows
            if row.name not in placed[generation]
        ]
    return trace, sorted(sites.values(), key=lambda s: (s.order, s.facet)), unplaced


def _code(names: list[str]) -> str:
    return "<br>".join(f"`{n}`" for n in names) if names else "—"


def _status(words: set) -> str:
    return " ".join(f'<span class="tl-status tl-status--{w}">{w}</span>' for w in sorted(words))


def _stacks(trace: tl.Trace) -> list[tuple[str, str | None, list[str]]]:
    """Each stack of layers the trace found: layer `{L}`'s address and call, and its layers' addresses."""
    out = []
    for stack in trace.structure.stacks.values():
        # a call index counts only where one module runs several layers (as `resolve_alias`'s `call`)
        calls = [(layer.call.address, layer.call.index) for layer in stack.layers]
        if len({address for address, _ in calls}) == len(calls):
            calls = [(address, None) for address, _ in calls]
        address, call = _template(calls[0], calls[1]) if len(calls) > 1 else (calls[0][0], None)
        out.append((address, call, [a for a, _ in calls]))
    return out


def _shown(address: str, call: str | None) -> str:
    return address if call is None else f"{address}` call `{call}"


def _intro(
    family: str, trace: tl.Trace, n_sites: int, column: str | None
) -> tuple[str, str | None]:
    """The section's first paragraph, and the shorthand's prefix (block `{L}`'s address) or None."""
    spec = testing.FAMILIES[family]
    stacks = _stacks(trace)
    head = f'`testing.build("{family}")`: `{spec.model}`, '
    tail = (
        f"{n_sites} sites have a name in some generation: the first table gives TransformerLens's "
        f"names, the second each site's status and the other libraries' names for it."
    )
    listed = " and ".join(f"`{_shown(a, c)}` ({len(b)} layers)" for a, c, b in stacks)
    if not trace.blocks:
        return (
            head
            + f"{len(stacks)} stacks of layers, {listed}. None feeds a language-model head, so "
            f"`trace.blocks` is empty, and the per-layer names that resolve `ambiguous` (listed below "
            f"the tables) could each mean a layer of {'either' if len(stacks) == 2 else 'any'} stack. "
            + tail,
            None,
        )
    ((address, call, _),) = [s for s in stacks if s[2] == list(trace.blocks)]
    if len(stacks) > 1:
        lm_stack = trace.structure.stacks.get(trace.structure.lm_stack or "")
        if lm_stack is None or [layer.call.address for layer in lm_stack.layers] != list(
            trace.blocks
        ):
            raise SystemExit(f"{family}: trace.blocks is not the stack that feeds the LM head")
        head += (
            f"{len(stacks)} stacks of layers, {listed}; `{_shown(address, call)}` is the stack that "
            f"feeds the language-model head (`trace.blocks`), and the sites of the other are written "
            f"in full. "
        )
    else:
        head += f"{len(trace.blocks)} layers"
    vllm = (
        f" The vLLM column is the hook of the [serving-engines recipe](../guides/serving-engines.md) "
        f"for vLLM's {VLLM_FAMILIES[family]} model (module names inside `{address}` are relative to it)."
        if column
        else ""
    )
    if call is not None:
        return (
            head
            + f", all run by one module: layer `{{L}}` is call `{{L}}` of `{address}` (the layers "
            f"share its weights), so a site inside a layer is written as its module's full address "
            f"and the call (`trace.modules[address].calls[L]`). {tail}{vllm}",
            None,
        )
    return (
        head
        + ("; b" if len(stacks) == 1 else "B")
        + f"lock `{{L}}` is `{address}`, and a site inside "
        f"it is written from it (`{{L}}.mlp` is `{address}.mlp`). {tail}{vllm}",
        address,
    )


def family_section(family: str, vllm: dict[str, dict[str, str]]) -> list[str]:
    trace, sites, unplaced = family_sites(family)
    title = TITLES.get(family, family)
    legacy_only = all(set(s.names["4.x"]) <= set(s.names["3.x"]) for s in sites)
    column = next((c for c in vllm if VLLM_FAMILIES.get(family, "\0") in c), None)
    intro, block = _intro(family, trace, len(sites), column)
    tl_headers = ["site", "2.x", "3.x, besides the 4.x names" if legacy_only else "3.x", "4.x"]
    other_headers = ["site", "status", "nnterp", "interp-engine"] + (
        ["vLLM hook"] if column else []
    )
    lines = [f"## {title}", "", intro, ""]
    tl_rows, other_rows = [], []
    for s in sites:
        legacy = (
            [n for n in s.names["3.x"] if n not in s.names["4.x"]]
            if legacy_only
            else s.names["3.x"]
        )
        address = (
            "{L}" + s.address[len(block) :]
            if block is not None and (s.address == block or s.address.startswith(block + "."))
            else s.address
        )
        site = f"`{address}`<br>`{s.facet}`" + (
            f"<br>call `{s.call}`" if s.call is not None else ""
        )
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
    ambiguous = {g: [n for n, status in unplaced[g] if status == "ambiguous"] for g in GENERATIONS}
    if any(ambiguous.values()):
        lines += [
            f"Names that resolve `ambiguous` on {title} (layer `{{L}}` could be a layer of any of its stacks):",
            "",
        ]
        lines += [
            f"- {g}: " + ", ".join(f"`{n}`" for n in names)
            for g, names in ambiguous.items()
            if names
        ]
        lines.append("")
    lines += [
        f"Names with no site on {title} (each generation's own table, listed [here](index.md), gives each one's reason):",
        "",
    ]
    for generation in GENERATIONS:
        names = [n for n, status in unplaced[generation] if status != "ambiguous"]
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

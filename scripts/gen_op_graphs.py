"""Generate the op-graph drawings of the site: docs/assets/op-graphs/<slug>.svg and their page.

For each family of `torchlens.testing.FAMILIES` with an `op_graph` (GPT-2, Llama and T5, an
encoder-decoder) this script builds a small random-init model (`torchlens.testing.build`, with
the row's `op_graph.settings`), traces it once with `save="all"` and calls
[`Trace.draw`][torchlens.Trace.draw] three ways:

* **rolled**: the whole model, each stack's layers with one recorded op sequence drawn once
  (`×N`), modules two levels down folded into one node each;
* **block**: the first layer of the language-model stack with every op (`focus=` that block);
* **names**: the second layer, one level of module boxes, with TransformerLens 2.x, 4.x and nnterp
  names highlighted together (`highlight={generation: names}`).

Nothing here lays anything out or positions a label: the SVGs are what `Trace.draw` returns.
The output is deterministic (fixed seeds, Graphviz's deterministic layout, no timestamps).

The page docs/guides/op-graph.md has a hand-written part (kept as is) and a generated part
between two marker comments: one section per family with the three drawings, the call that
made each and what each shows, then block 0 of every other `diagram` family.

Usage:
    python scripts/gen_op_graphs.py          # write the SVGs and the page's generated part
    python scripts/gen_op_graphs.py --check  # exit 1 if a committed SVG or the page is stale

`tests/test_op_graphs.py` runs the check.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torchlens as tl
from torchlens import testing

sys.path.insert(
    0, str(Path(__file__).resolve().parent)
)  # this script's siblings, also when a test loads it by path
from _outputs import main as run
from _outputs import splice

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "assets" / "op-graphs"
PAGE = ROOT / "docs" / "guides" / "op-graph.md"
BEGIN = "<!-- BEGIN GENERATED: scripts/gen_op_graphs.py; do not edit by hand -->"
END = "<!-- END GENERATED -->"
N_TOKENS = 4
#: The widest a drawing may be: the page shows it at its own size (12 px and 11 px text) in a
#: window 1280 px wide; wider, the browser would shrink its text below 11 px.
MAX_WIDTH = 1200


#: The names the "names" drawings highlight in layer 1 of a decoder-only model: where each
#: library reads (TransformerLens 2.x and 4.x, nnterp).
DECODER_NAMES = {
    "2.x": [
        f"blocks.1.{n}"
        for n in (
            "hook_resid_pre",
            "attn.hook_pattern",
            "attn.hook_z",
            "hook_attn_out",
            "hook_resid_mid",
            "hook_mlp_in",
            "mlp.hook_post",
            "hook_mlp_out",
            "hook_resid_post",
        )
    ],
    "4.x": [
        f"blocks.1.{n}"
        for n in (
            "hook_in",
            "attn.hook_pattern",
            "attn.hook_out",
            "ln2.hook_in",
            "mlp.hook_in",
            "mlp.hook_out",
            "hook_out",
        )
    ],
    "nnterp": [
        f"{n}[1]"
        for n in (
            "layers_input",
            "attention_probabilities",
            "attentions_output",
            "mlps_input",
            "mlps_output",
            "layers_output",
        )
    ],
}
#: The same for layer 1 of an encoder-decoder's decoder: the generations spell the stack and the
#: two attentions their own way; nnterp names decoder-only models (listed under the drawing).
SEQ2SEQ_NAMES = {
    "2.x": [
        f"decoder.1.{n}"
        for n in (
            "hook_resid_pre",
            "attn.hook_pattern",
            "hook_attn_out",
            "hook_resid_mid",
            "cross_attn.hook_pattern",
            "hook_cross_attn_out",
            "hook_mlp_in",
            "mlp.hook_post",
            "hook_resid_post",
        )
    ],
    "4.x": [
        f"decoder_blocks.1.{n}"
        for n in (
            "hook_in",
            "self_attn.hook_pattern",
            "self_attn.hook_out",
            "cross_attn.hook_pattern",
            "cross_attn.hook_out",
            "mlp.hook_in",
            "hook_out",
        )
    ],
    "nnterp": ["layers_input[1]", "layers_output[1]"],
}


#: file slug -> the family drawn in full (its `op_graph`)
FAMILIES: dict[str, testing.Family] = {
    f.slug: f for f in testing.FAMILIES.values() if f.op_graph is not None
}


def model_and_inputs(family: testing.Family) -> tuple:
    """The model an op-graph section draws, and its positional and keyword inputs."""
    model = testing.build(family.name, "eager", **family.op_graph.settings)
    ids = testing.token_ids(length=N_TOKENS)
    if family.structure.inputs == "seq2seq":
        return model, (), {"input_ids": ids, "decoder_input_ids": ids[:, :3]}
    return model, (ids,), {}


#: drawing kind -> (what it shows, the options of Trace.draw, given the trace)
KINDS = {
    "rolled": "the whole model, rolled: each stack's layers with one recorded op sequence drawn once",
    "block": "one block unrolled: every op of one layer, its parameters, and the ops just outside it",
    "names": "the second layer with TransformerLens 2.x, 4.x and nnterp names marked on the ops they read",
}


def options(kind: str, trace: tl.Trace, family: testing.Family) -> dict:
    """The keyword arguments of `trace.draw` for one kind of drawing."""
    if kind == "rolled":
        return {"rolled": True, "depth": 2}
    if kind == "block":
        return {"focus": family.op_graph.block}
    seq2seq = trace.structure.kind == "encoder-decoder"
    return {
        "focus": trace.blocks[1],
        "depth": 1,
        "highlight": SEQ2SEQ_NAMES if seq2seq else DECODER_NAMES,
    }


def call_text(kind: str, trace: tl.Trace, family: testing.Family) -> str:
    """`trace.draw(...)` as the page shows it."""
    opts = options(kind, trace, family)
    if kind == "names":
        return (
            f"trace.draw(focus={opts['focus']!r}, depth=1, highlight=names)` with `names = "
            f"{'SEQ2SEQ_NAMES' if opts['highlight'] is SEQ2SEQ_NAMES else 'DECODER_NAMES'}"
        )
    return "trace.draw(" + ", ".join(f"{k}={v!r}" for k, v in opts.items()) + ")"


def trace_of(slug: str) -> tl.Trace:
    model, args, kwargs = model_and_inputs(FAMILIES[slug])
    return tl.trace(model, *args, save="all", **kwargs)


def others() -> dict[str, testing.Family]:
    """The block-diagram families this page has no section for, by slug. Each gets its block 0
    unrolled, so every block diagram links to an op graph."""
    return {f.slug: f for f in testing.FAMILIES.values() if f.diagram and f.slug not in FAMILIES}


def page_section(made: dict[str, tuple[tl.Trace, dict]], more: dict[str, tuple]) -> str:
    lines = [BEGIN, ""]
    for slug, (trace, ds) in made.items():
        family = FAMILIES[slug]
        lines += [
            f"## {family.title}",
            "",
            f'{family.op_graph.what}; traced with `save="all"` on {N_TOKENS} tokens '
            f"({len(trace.ops)} ops; {trace.structure.describe()}).",
            "",
        ]
        for kind, d in ds.items():
            counts = d.counts
            facts = [f"{counts.get('op', 0)} ops drawn"]
            if counts.get("module"):
                facts.append(f"{counts['module']} modules folded")
            if counts.get("param"):
                facts.append(f"{counts['param']} parameters")
            apart = [g for g in d.groups if g[2]]
            rolled = [g for g in d.groups if len(g[1]) > 1]
            if rolled:
                facts.append(
                    "rolled: "
                    + "; ".join(
                        f"`{g[0]}` layers {', '.join(map(str, g[1]))} drawn once" for g in rolled
                    )
                )
            for g in apart:
                facts.append(f"`{g[0]}` layer {', '.join(map(str, g[1]))} drawn apart: {g[2]}")
            marks = d.count('class="mark"')
            if marks:
                facts.append(f"{marks} names marked")
            if d.unplaced:
                facts.append(
                    f"{len(d.unplaced)} listed under the drawing with the reason they have no mark"
                )
            title = f"{family.title}, {kind}: {KINDS[kind]}"
            lines += [
                f"### {family.title}: {kind} {{#{slug}-{kind}}}",
                "",
                f"{KINDS[kind][0].upper()}{KINDS[kind][1:]}: `{call_text(kind, trace, family)}`. {'; '.join(facts)}.",
                "",
                '<div class="tl-opgraph" markdown>',
                "",
                f"![{title}](../assets/op-graphs/{slug}-{kind}.svg)",
                "",
                "</div>",
                "",
            ]
    if more:
        lines += [
            "## Block 0 of the other families",
            "",
            "The other families of the [block diagrams](diagrams.md), each built with "
            "`testing.build(family, 'eager')` and drawn with `trace.draw(focus=trace.blocks[0])`, or with "
            "`depth=` where every op would not fit the page's column.",
            "",
        ]
        for slug, (trace, d, depth) in more.items():
            title = others()[slug].title
            call = f"focus={trace.blocks[0]!r}" + (f", depth={depth}" if depth is not None else "")
            lines += [
                f"### {title}: block {{#{slug}-block}}",
                "",
                f"`{trace.model_class}`, `trace.draw({call})`: {d.counts.get('op', 0)} ops drawn"
                + (
                    f"; {d.counts['module']} modules folded (every op would be wider than the column)"
                    if d.counts.get("module")
                    else ""
                )
                + f"; {d.counts.get('param', 0)} parameters.",
                "",
                '<div class="tl-opgraph" markdown>',
                "",
                f"![{title}, block 0 unrolled: every op of {trace.blocks[0]}](../assets/op-graphs/{slug}-block.svg)",
                "",
                "</div>",
                "",
            ]
    lines.append(END)
    return "\n".join(lines)


def render_page(section: str) -> str:
    text = (
        PAGE.read_text(encoding="utf-8") if PAGE.exists() else f"# The op graph\n\n{BEGIN}\n{END}\n"
    )
    return splice(PAGE, text, BEGIN, END, section)


def outputs() -> dict[Path, str]:
    """Every file this script writes, with its content: the SVGs, then the page."""
    made = {}
    out: dict[Path, str] = {}
    for slug in FAMILIES:
        trace = trace_of(slug)
        ds = {}
        for kind in KINDS:
            d = trace.draw(**options(kind, trace, FAMILIES[slug]))
            width = float(d.split('width="', 1)[1].split('"', 1)[0])
            if width > MAX_WIDTH:
                raise SystemExit(
                    f"{slug}-{kind}: the drawing is {width:g} px wide, over {MAX_WIDTH} px"
                )
            ds[kind] = d
            out[OUT / f"{slug}-{kind}.svg"] = str(d)
        made[slug] = (trace, ds)
    more = {}
    for slug, family in others().items():
        trace = tl.trace(
            testing.build(family.name, "eager"), testing.token_ids(length=N_TOKENS), save="all"
        )
        for depth in (None, 2, 1):  # every op, or as many levels of module boxes as fit the column
            d = trace.draw(focus=trace.blocks[0], depth=depth)
            if float(d.split('width="', 1)[1].split('"', 1)[0]) <= MAX_WIDTH:
                break
        else:
            raise SystemExit(
                f"{slug}-block: the drawing is wider than {MAX_WIDTH} px even at depth=1"
            )
        out[OUT / f"{slug}-block.svg"] = str(d)
        more[slug] = (trace, d, depth)
    out[PAGE] = render_page(page_section(made, more))
    return out


def main(argv: list[str] | None = None) -> int:
    return run(__doc__, outputs, ROOT, "python scripts/gen_op_graphs.py", argv)


if __name__ == "__main__":
    sys.exit(main())

"""What a model family row is (`Family`, with its `Structure`, `Stack` and `OpGraph`) and the rules
the rows obey, checked by `check_families` when the registry is built."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

#: Attention implementations a family can run with.
IMPLEMENTATIONS = ("eager", "sdpa")
#: Model kinds, as `trace.structure.kind` names them.
KINDS = ("decoder-only", "encoder-only", "encoder-decoder", "multi-tower")
#: What a family's forward takes: token ids; ids and decoder ids; pixels; ids and pixels (two
#: towers); ids with image tokens and pixels (LLaVA).
INPUTS = ("text", "seq2seq", "image", "text+image", "llava")


@dataclass(frozen=True)
class Stack:
    """One stack of repeated layers, as TorchLens must find it (addresses relative to a layer).

    Attributes:
        attention: the self-attention, or None where the layer has none (Mamba).
        cross: the cross-attention (an encoder-decoder's decoder), or None.
        mlp: the MLP, or None where no module holds it (BERT, OPT: the linear layers sit in the
            layer itself).
        qkv: the q, k and v projections under the attention, where each is a module of its own.
        qkv_served: False where TorchLens is known not to find q, k, v (then checked only if served).
        fused: (the fused q/k/v projection under the attention, its layout, its key/value
            groups); the layouts are those of the transformers source: `"queries_then_k_v"`,
            `"grouped"`, `"per_head_qkv"`.
        not_served: of q, k, v: known not to be found (checked if they ever are).
        n: the number of layers.
    """

    attention: str | None = "self_attn"
    cross: str | None = None
    mlp: str | None = "mlp"
    qkv: tuple[str, str, str] | None = None
    qkv_served: bool = True
    fused: tuple[str, str, int] | None = None
    not_served: tuple[str, ...] = ()
    n: int = 2


@dataclass(frozen=True)
class Structure:
    """What TorchLens must find in a family's model, read off the transformers source by hand.

    The model zoo (`tests/fixtures/zoo.py`, `docs/guides/coverage.md`) traces the model and
    compares the trace's structure with this, and the values with plain hooks on these modules
    and with the model's own outputs named here.

    Attributes:
        kind: one of `KINDS`.
        stacks: stack address -> [`Stack`][torchlens.testing.Stack], in the order they run.
        lm_stack: the stack feeding the language-model head, or None.
        final_norm: the norm after the last layer, before the unembedding, or None.
        unembed: the unembedding, or None (a classifier head).
        embed: the token embedding, or None.
        inputs: what the forward takes, one of `INPUTS`.
        hidden: stack -> the attribute of the model's output (dotted) that holds its
            `output_hidden_states`.
        attentions: stack -> the attribute that holds its `output_attentions`.
        cross_attentions: stack -> the attribute that holds its cross-attention weights.
        pad: a decoder-only language model: run on a left-padded batch with an attention mask.
        hidden_is_output: `output_hidden_states[i]` is layer i's output (Mamba), not its input.
        note: one line on what is special about the family, for the coverage page.
    """

    kind: str
    stacks: Mapping[str, Stack]
    lm_stack: str | None
    final_norm: str | None
    unembed: str | None
    embed: str | None
    inputs: str = "text"
    hidden: Mapping[str, str] = field(default_factory=dict)
    attentions: Mapping[str, str] = field(default_factory=dict)
    cross_attentions: Mapping[str, str] = field(default_factory=dict)
    pad: bool = False
    hidden_is_output: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        for name in ("stacks", "hidden", "attentions", "cross_attentions"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))


@dataclass(frozen=True)
class OpGraph:
    """How the op-graph page (`scripts/gen_op_graphs.py`) draws a family in full.

    Attributes:
        what: one line on the model, for the page.
        block: the layer the "block" drawing unrolls.
        settings: config settings of the drawn model that replace the family's.
    """

    what: str
    block: str
    settings: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))


@dataclass(frozen=True)
class Family:
    """One model family [`build`][torchlens.testing.build] can make, and where the repository uses it.

    Attributes:
        name: the key of `FAMILIES` (`"llama"`).
        title: how pages name it (`"Llama"`).
        config: the name of the `transformers` config class (`"LlamaConfig"`).
        model: the name of the `transformers` model class (`"LlamaForCausalLM"`).
        settings: the config's keyword arguments.
        attn_implementations: the attention implementations `transformers` runs this family with.
        why: why the family has only the implementations it has (empty when it has both).
        slug: the name of its files on the site (the block diagram, the op graphs); when not
            given, `name` with `-` for `_`.
        suite: the tests that run over every family run this one (`SUITE`): a causal language
            model of token ids.
        structure: what TorchLens must find in it; the model zoo checks every family that has one.
        diagram: the block-diagram page draws it (`scripts/gen_diagrams.py`).
        op_graph: the op-graph page draws it in full (`scripts/gen_op_graphs.py`); every
            `diagram` family gets its block 0 drawn there too.
        engines: the peer engines read it (`tests/fixtures/engine_runs.py`, the Verified page).
    """

    name: str
    title: str
    config: str
    model: str
    settings: Mapping[str, Any]
    attn_implementations: tuple[str, ...] = IMPLEMENTATIONS
    why: str = ""
    slug: str = ""
    suite: bool = False
    structure: Structure | None = None
    diagram: bool = False
    op_graph: OpGraph | None = None
    engines: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", MappingProxyType(dict(self.settings)))
        object.__setattr__(self, "slug", self.slug or self.name.replace("_", "-"))

    def make_config(self, **settings: Any) -> Any:
        """The family's `transformers` config, with `settings` replacing or adding to its own."""
        import transformers

        return getattr(transformers, self.config)(**copy.deepcopy({**self.settings, **settings}))

    def model_class(self) -> type:
        """The family's `transformers` model class."""
        import transformers

        return getattr(transformers, self.model)


def check_families(rows: Iterable[Family]) -> Mapping[str, Family]:
    """Check the rows against each other and themselves; return them by name.

    Raises:
        ValueError: naming the first row that breaks a rule: a name, title or slug given twice
            or malformed; an attention implementation not in `IMPLEMENTATIONS`, or a family with
            only some and no `why`; a structure whose stacks, inputs or output attributes do not
            fit together; a `suite`, `diagram`, `op_graph` or `engines` family its page or test
            cannot use.
    """
    out: dict[str, Family] = {}
    titles: set[str] = set()
    slugs: set[str] = set()
    for f in rows:
        problems = _row_problems(f)
        for what, value, seen in (
            ("name", f.name, out),
            ("title", f.title, titles),
            ("slug", f.slug, slugs),
        ):
            if value in seen:
                problems.append(f"its {what} {value!r} is another family's")
        if problems:
            raise ValueError(f"test family {f.name!r}: " + "; ".join(problems))
        out[f.name] = f
        titles.add(f.title)
        slugs.add(f.slug)
    return MappingProxyType(out)


def _row_problems(f: Family) -> list[str]:
    problems = []
    if not re.fullmatch(r"[a-z][a-z0-9_]*", f.name) or not re.fullmatch(r"[a-z][a-z0-9-]*", f.slug):
        problems.append("name is lowercase letters, digits and `_`; slug the same with `-`")
    if not f.config.endswith("Config") or not f.title:
        problems.append("config names a transformers config class, and the title is not empty")
    if not f.attn_implementations or set(f.attn_implementations) - set(IMPLEMENTATIONS):
        problems.append(
            f"attn_implementations {f.attn_implementations} are not some of {IMPLEMENTATIONS}"
        )
    if bool(f.why) == (set(f.attn_implementations) == set(IMPLEMENTATIONS)):
        problems.append(
            "why says why the family runs only some attention implementations, and only then"
        )
    s = f.structure
    if s is not None:
        problems += _structure_problems(s)
    language_model = (
        s is not None
        and s.kind == "decoder-only"
        and s.inputs == "text"
        and bool(s.embed and s.unembed)
    )
    if (f.diagram or f.engines) and not language_model:
        problems.append(
            "diagram and engines need a structure: a decoder-only language model of token ids"
        )
    if f.op_graph is not None and (
        s is None
        or s.inputs not in ("text", "seq2seq")
        or not any(f.op_graph.block.startswith(f"{stack}.") for stack in s.stacks)
    ):
        problems.append(
            "op_graph needs a structure of token ids (or seq2seq), and its block in one of the stacks"
        )
    return problems


def _structure_problems(s: Structure) -> list[str]:
    problems = []
    if s.kind not in KINDS or s.inputs not in INPUTS:
        problems.append(
            f"structure kind {s.kind!r} / inputs {s.inputs!r}: kinds are {KINDS}, inputs {INPUTS}"
        )
    if not s.stacks or (s.lm_stack is not None and s.lm_stack not in s.stacks):
        problems.append(f"lm_stack {s.lm_stack!r} is not one of its stacks {list(s.stacks)}")
    for what in ("hidden", "attentions", "cross_attentions"):
        if set(getattr(s, what)) - set(s.stacks):
            problems.append(f"{what} names a stack the structure does not have")
    if {n for n, st in s.stacks.items() if st.cross} != set(s.cross_attentions):
        problems.append("cross_attentions are given for exactly the stacks with a cross-attention")
    if s.pad and (s.kind != "decoder-only" or s.inputs != "text"):
        problems.append("pad is for decoder-only language models of token ids")
    return problems

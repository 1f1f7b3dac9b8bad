"""The facet specification: one row per facet TorchLens can produce, and what is derived from them.

Each `FacetSpec` row says which roles report the facet, its
layout (named axes, which one is the heads axis and whether those are key/value heads), how
TorchLens finds its tensor, which hooks or retained calls capture needs to serve it, why it
can be missing on a module of its role, whether an edit can replace it and what to edit when
it cannot. Everything else that knows about facets reads these rows:

- `FACETS` (role -> facet -> prose) and `ALL_FACETS`, the vocabulary `save=` and the naming
  tables are checked against (`torchlens._naming.tables` validates every row at import);
- the layout sets `compare` and its diagnosis use (`PER_HEAD`, `TOKEN_MAJOR`, `HEAD_MAJOR`,
  `KV_HEADS`, `KERNEL_REBUILT`);
- the reason the resolver gives for a facet a module lacks (`absent_reason`);
- the facet tables of `docs/guides/facets.md` (written by `scripts/gen_facet_page.py`).

The rows are checked when this module is imported: a duplicate name, an unknown role or axis,
a heads axis that does not name a heads axis of the layout, an `"io"` facet without the hook
that serves it, or an editability rule without its remedy raises `FacetSpecError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchlens._core.errors import TorchLensError, did_you_mean
from torchlens._core.roles import ROLES

__all__ = [
    "FacetSpec",
    "FacetSpecError",
    "SPECS",
    "BY_NAME",
    "FACETS",
    "ALL_FACETS",
    "EVERY_MODULE",
    "SOURCES",
    "AXES",
    "PER_HEAD",
    "TOKEN_MAJOR",
    "HEAD_MAJOR",
    "KV_HEADS",
    "KERNEL_REBUILT",
    "NORM_FACETS",
    "HOOK_SIDES",
    "REMEDIES",
    "check_rows",
    "DEFAULT_ABSENT",
    "spec",
    "absent_reason",
    "tokens_flattened",
]

#: The pseudo-role of the facets every module call has (`input`, `output`).
EVERY_MODULE = "any"

#: How TorchLens finds a facet's tensor:
#: - `"io"`: a module call's input or output as its forward hooks see it (see `FacetSpec.hooks`);
#: - `"op"`: the output of one op the model ran inside the module (or a view of it);
#: - `"computed"`: computed from recorded tensors and the module's weights, then checked;
#: - `"reconstructed"`: rebuilt from a fused kernel's recorded inputs and checked against its output.
SOURCES = ("io", "op", "computed", "reconstructed")

#: The axis names a layout may use. `"1"` is a kept axis of size one (a norm's statistics).
AXES = frozenset(
    {
        "batch",
        "pos",
        "query",
        "key",
        "heads",
        "kv_heads",
        "d_head",
        "d_model",
        "d_mlp",
        "vocab",
        "1",
    }
)

#: What the resolver says about a facet missing on a module when its row gives no reason.
DEFAULT_ABSENT = "the module does not compute it"


class FacetSpecError(TorchLensError, ValueError):
    """A row of the facet specification contradicts itself or the role vocabulary (raised at import)."""


@dataclass(frozen=True)
class FacetSpec:
    """One facet: who reports it, its layout, how TorchLens finds it, and what can be done with it.

    Attributes:
        name: the facet name (`trace.modules[address].facets[name]`).
        roles: the roles whose calls report it (`torchlens._core.roles.ROLES`), or `("any",)` for the
            facets of every module call.
        axes: the layout, one name per axis (`("batch", "pos", "heads", "d_head")`); `()` for
            `input`/`output`, whose layout is the module's own.
        heads_axis: the index in `axes` of the heads axis, or None for a facet without one.
        kv_heads: whether that axis counts key/value heads (fewer than the query heads under
            grouped-query attention).
        source: how TorchLens finds the tensor, one of `SOURCES`.
        fused: how it is found where the module runs the computation as one fused op (a fused
            attention kernel such as `scaled_dot_product_attention`, a fused `layer_norm`), when
            that differs from `source`; None otherwise. (`nn.MultiheadAttention` is rebuilt
            whole: there every attention facet is `"reconstructed"`, whatever its row says.)
        hooks: for an `"io"` facet, the `(role, side)` pairs whose forward hook sees the tensor:
            `side` is `"in"` (the call's input) or `"out"` (its output), and `role` is the
            reporting module's own role, or another module's (`final_norm_input` is the final
            norm's input, `logits` the unembedding's output, or the root's output where the model
            maps the unembedding's output elementwise). Capture needs only those tensors, no op
            outputs. Empty for every other source.
        absent: why a module of the facet's role can lack it (`""`: it has it whenever its role's
            facets are found at all); the resolver's `structurally_absent` reason.
        remedy: for a facet that is not always an op output, what to edit instead (empty for
            the facets an edit can always replace).
        found_in: roles whose calls run ops the facet may be found from beyond what `source`
            says: a sublayer's `contribution` is an op of its block; an embedding's `indices`
            (an `"io"` facet) are an op of its own where it computes them from its input (a
            learned positional embedding's positions). Capture keeps their op outputs too.
        prose: what the tensor is, in one or two sentences (Markdown: code in backticks).
    """

    name: str
    roles: tuple[str, ...]
    axes: tuple[str, ...]
    heads_axis: int | None
    kv_heads: bool
    source: str
    prose: str
    fused: str | None = None
    hooks: tuple[tuple[str, str], ...] = ()
    absent: str = ""
    remedy: str = ""
    found_in: tuple[str, ...] = ()

    @property
    def layout(self) -> str:
        """The layout as the docs write it: `"[batch, pos, heads, d_head]"` (`""` for input/output)."""
        return f"[{', '.join(self.axes)}]" if self.axes else ""

    @property
    def editable(self) -> bool:
        """Whether an `edit=` can always replace it: it is a hook's tensor or one op's output,
        however the module runs. A facet with a `fused` way of being found is editable only
        where it is found by `source` (see `remedy`)."""
        return self.source in ("io", "op") and self.fused in (None, "io", "op")

    @property
    def token_major(self) -> bool:
        """Per-head with the position axis before the heads axis (`[batch, pos, heads, d_head]`)."""
        return self.heads_axis is not None and "pos" in self.axes[: self.heads_axis]

    @property
    def head_major(self) -> bool:
        """Per-head with the heads axis before the position (or query) axis (`[batch, heads, pos, d_head]`)."""
        return self.heads_axis is not None and not self.token_major

    @property
    def per_head_width(self) -> bool:
        """Per-head with a width as its last axis (`d_head`, or `d_model` for `result`): the
        `[..., heads, width]` tail that engines often flatten into one axis."""
        return self.heads_axis is not None and self.axes[-1] in ("d_head", "d_model")

    @property
    def retain(self) -> tuple[str, ...]:
        """The roles whose calls capture must keep the op outputs of to serve the facet: for an
        `"io"` facet only its `found_in` (its `hooks` serve it otherwise), the reporting roles
        and `found_in` for every other one."""
        return self.found_in if self.source == "io" else self.roles + self.found_in


_ROPE = "nothing transforms the {what} between the projection and the kernel (no RoPE)"
_NOT_GATED = "the MLP is not gated (one input projection, no linear branch)"
_EAGER = (
    'trace a copy of the model loaded with attn_implementation="eager", where the {what} the '
    "softmax's {side} (a real op)"
)
_NORM_IO = "edit the norm's 'input' or 'output'"

#: Every facet, by role in the order a forward computes them (the order facet maps list them in).
SPECS: tuple[FacetSpec, ...] = (
    FacetSpec(
        name="input",
        roles=(EVERY_MODULE,),
        axes=(),
        heads_axis=None,
        kv_heads=False,
        source="io",
        prose="the module's first positional argument, or its first tensor keyword argument when called with "
        "keywords only (Llama's attention)",
        hooks=((EVERY_MODULE, "in"),),
    ),
    FacetSpec(
        name="output",
        roles=(EVERY_MODULE,),
        axes=(),
        heads_axis=None,
        kv_heads=False,
        source="io",
        prose="the module's output tensor, or else the first tensor in its output, depth first: element 0 of a "
        "tuple, the first tensor value of a dict or `ModelOutput`, inside nested tuples, lists and dicts",
        hooks=((EVERY_MODULE, "out"),),
    ),
    FacetSpec(
        name="resid_pre",
        roles=("block",),
        axes=("batch", "pos", "d_model"),
        heads_axis=None,
        kv_heads=False,
        source="io",
        prose="the residual stream entering the block (the block's input)",
        hooks=(("block", "in"),),
    ),
    FacetSpec(
        name="resid_mid",
        roles=("block",),
        axes=("batch", "pos", "d_model"),
        heads_axis=None,
        kv_heads=False,
        source="op",
        prose="the residual stream after the attention's add, before the MLP: the add that takes the "
        "attention's contribution and feeds the MLP",
        absent="no residual add lies between its attention and its MLP in the block itself (they read the "
        "same residual in parallel, the block holds no MLP module, or a sublayer wrapper adds the residual)",
    ),
    FacetSpec(
        name="resid_post",
        roles=("block",),
        axes=("batch", "pos", "d_model"),
        heads_axis=None,
        kv_heads=False,
        source="io",
        prose="the residual stream leaving the block (the block's output)",
        hooks=(("block", "out"),),
    ),
    FacetSpec(
        name="q",
        roles=("attention",),
        axes=("batch", "pos", "heads", "d_head"),
        heads_axis=2,
        kv_heads=False,
        source="op",
        prose="the query projection viewed per head, before the transpose, before any QK-norm and before RoPE",
    ),
    FacetSpec(
        name="k",
        roles=("attention",),
        axes=("batch", "pos", "kv_heads", "d_head"),
        heads_axis=2,
        kv_heads=True,
        source="op",
        prose="the key projection viewed per head, before RoPE; under grouped-query attention it keeps the "
        "model's kv-head count",
    ),
    FacetSpec(
        name="v",
        roles=("attention",),
        axes=("batch", "pos", "kv_heads", "d_head"),
        heads_axis=2,
        kv_heads=True,
        source="op",
        prose="the value projection viewed per head; under grouped-query attention it keeps the model's "
        "kv-head count",
    ),
    FacetSpec(
        name="rot_q",
        roles=("attention",),
        axes=("batch", "pos", "heads", "d_head"),
        heads_axis=2,
        kv_heads=False,
        source="op",
        prose="the queries as the attention kernel receives them (after RoPE and any QK-norm), moved back to "
        "token-major; only where something transforms them between projection and kernel",
        absent=_ROPE.format(what="queries"),
    ),
    FacetSpec(
        name="rot_k",
        roles=("attention",),
        axes=("batch", "pos", "kv_heads", "d_head"),
        heads_axis=2,
        kv_heads=True,
        source="op",
        prose="the keys of the forward's own positions as the attention kernel receives them (after RoPE "
        "and any QK-norm), token-major, kv heads, read before a KV cache joins them to the cached keys (which "
        "are earlier forwards' rot_k); only where something transforms them between projection and kernel",
        absent=_ROPE.format(what="keys"),
    ),
    FacetSpec(
        name="scores",
        roles=("attention",),
        axes=("batch", "heads", "query", "key"),
        heads_axis=1,
        kv_heads=False,
        source="op",
        prose="the tensor entering softmax: scaled, softcapped and masked exactly as the model does it; masked "
        "entries hold the model's fill (Hugging Face: the dtype's minimum, not `-inf`)",
        fused="reconstructed",
        absent="no softmax or fused attention kernel ran inside it",
        remedy=_EAGER.format(what="scores are", side="input"),
    ),
    FacetSpec(
        name="pattern",
        roles=("attention",),
        axes=("batch", "heads", "query", "key"),
        heads_axis=1,
        kv_heads=False,
        source="op",
        prose="the softmax output, in the model's dtype",
        fused="reconstructed",
        absent="no softmax or fused attention kernel ran inside it",
        remedy=_EAGER.format(what="pattern is", side="output"),
    ),
    FacetSpec(
        name="z",
        roles=("attention",),
        axes=("batch", "heads", "pos", "d_head"),
        heads_axis=1,
        kv_heads=False,
        source="op",
        prose="`pattern @ v`, head-major as the kernel returns it (TransformerLens's `hook_z` is token-major: "
        "`z.transpose(1, 2)`)",
    ),
    FacetSpec(
        name="result",
        roles=("attention",),
        axes=("batch", "pos", "heads", "d_model"),
        heads_axis=2,
        kv_heads=False,
        source="computed",
        prose="each head's contribution through the output projection, bias excluded; summed over heads plus "
        "the bias it is the projection's output",
        remedy="edit 'z' instead: a head's result is its slice of z times its rows of W_O, so zeroing z[:, h] "
        "removes head h's contribution",
    ),
    FacetSpec(
        name="pre",
        roles=("mlp",),
        axes=("batch", "pos", "d_mlp"),
        heads_axis=None,
        kv_heads=False,
        source="op",
        prose="the activation's input (GPT-2 `c_fc`, Llama `gate_proj` output)",
    ),
    FacetSpec(
        name="pre_linear",
        roles=("mlp",),
        axes=("batch", "pos", "d_mlp"),
        heads_axis=None,
        kv_heads=False,
        source="op",
        prose="a gated MLP's linear branch (Llama `up_proj` output)",
        absent=_NOT_GATED,
    ),
    FacetSpec(
        name="act",
        roles=("mlp",),
        axes=("batch", "pos", "d_mlp"),
        heads_axis=None,
        kv_heads=False,
        source="op",
        prose="the activation's output, `act(pre)`: an activation module's output or an activation op's "
        "(relu, gelu, silu, ...), served only where its input is the up projection's output; where a "
        "scale or an in-place write comes between it and the down projection it is refused",
    ),
    FacetSpec(
        name="gated_out",
        roles=("mlp",),
        axes=("batch", "pos", "d_mlp"),
        heads_axis=None,
        kv_heads=False,
        source="op",
        prose="`act(pre) * pre_linear`, served only where `act` itself is the product's operand (no dropout "
        "or cast between them)",
        absent="the MLP is not gated",
    ),
    FacetSpec(
        name="post",
        roles=("mlp",),
        axes=("batch", "pos", "d_mlp"),
        heads_axis=None,
        kv_heads=False,
        source="op",
        prose="the down projection's input: `act` on a plain MLP, `gated_out` on a gated one, after any dropout, "
        "cast or norm the model applies in between (T5's dropout, Kosmos-2's and BitNet's norms), so in "
        "training mode it holds the dropped-out tensor",
    ),
    FacetSpec(
        name="contribution",
        roles=("attention", "mlp", "norm"),
        found_in=("block",),
        axes=("batch", "pos", "d_model"),
        heads_axis=None,
        kv_heads=False,
        source="op",
        absent="the block adds the sublayer's output to the residual stream as it is (then that "
        "output is the contribution), or not through one add",
        prose="what the block's residual add takes from the sublayer (or from the norm applied to "
        "its output), where the model changes that output on the way: times a constant (Granite's "
        "`residual_multiplier`, MiniCPM3's depth scale) or reshaped (Llama-4); checked to be the "
        "output times one constant",
    ),
    FacetSpec(
        name="down_out",
        roles=("mlp",),
        axes=("batch", "pos", "d_model"),
        heads_axis=None,
        kv_heads=False,
        source="op",
        prose="the down projection's output, before any dropout",
    ),
    FacetSpec(
        name="normalized",
        roles=("norm",),
        axes=("batch", "pos", "d_model"),
        heads_axis=None,
        kv_heads=False,
        source="op",
        prose="the input centred (LayerNorm) and divided by its RMS or standard deviation over the norm's "
        "normalized shape (per group for GroupNorm), before the gain and bias; served only where "
        "`normalized * gain + bias` equals the norm's output",
        fused="computed",
        remedy="edit the norm's 'output' (or its 'input')",
    ),
    FacetSpec(
        name="inv_rms",
        roles=("norm",),
        axes=("batch", "pos", "1"),
        heads_axis=None,
        kv_heads=False,
        source="op",
        prose="`1/sqrt(mean(x²)+eps)` of an RMSNorm",
        fused="computed",
        absent="the norm is not an RMSNorm (a LayerNorm has inv_std, a GroupNorm neither)",
        remedy=_NORM_IO,
    ),
    FacetSpec(
        name="inv_std",
        roles=("norm",),
        axes=("batch", "pos", "1"),
        heads_axis=None,
        kv_heads=False,
        source="op",
        prose="`1/sqrt(var(x)+eps)` of a LayerNorm",
        fused="computed",
        absent="the norm is not a LayerNorm (an RMSNorm has inv_rms, a GroupNorm neither)",
        remedy=_NORM_IO,
    ),
    FacetSpec(
        name="scale",
        roles=("norm",),
        axes=("batch", "pos", "1"),
        heads_axis=None,
        kv_heads=False,
        source="computed",
        prose="the divisor `sqrt(mean(x²)+eps)` or `sqrt(var(x)+eps)`: `1/inv_rms` or `1/inv_std` "
        "(TransformerLens's `hook_scale`)",
        absent="the norm is a GroupNorm (its statistics are per group, not per position)",
        remedy=_NORM_IO,
    ),
    FacetSpec(
        name="indices",
        roles=("embedding",),
        axes=("batch", "pos"),
        heads_axis=None,
        kv_heads=False,
        source="io",
        prose="the index tensor the embedding's lookup reads: the token ids entering it, or the "
        "positions a learned positional embedding computes from its input (BART's)",
        hooks=(("embedding", "in"),),
        found_in=("embedding",),
    ),
    FacetSpec(
        name="lookup",
        roles=("embedding",),
        axes=("batch", "pos", "d_model"),
        heads_axis=None,
        kv_heads=False,
        source="op",
        prose="the rows looked up, before anything the module does after the lookup (Gemma multiplies them by "
        "`sqrt(d_model)`); elsewhere it equals the output",
        absent="no embedding lookup op ran inside it",
    ),
    FacetSpec(
        name="final_norm_input",
        roles=("root",),
        axes=("batch", "pos", "d_model"),
        heads_axis=None,
        kv_heads=False,
        source="io",
        prose="the input of the final norm (the last norm before the unembedding): on a pre-norm decoder the "
        "last block's output; where a head transforms that first (BERT's prediction head: dense, "
        "activation, then the norm), the transformed tensor",
        hooks=(("norm", "in"),),
        absent="no norm runs between the last block and the unembedding",
    ),
    FacetSpec(
        name="logits",
        roles=("root",),
        axes=("batch", "pos", "vocab"),
        heads_axis=None,
        kv_heads=False,
        source="io",
        prose="the model's logits: the unembedding's output, or the root's output when it is computed from it "
        "elementwise with the same shape (Gemma-2's final softcap)",
        hooks=(("unembed", "out"), ("root", "out")),
        absent="the model has no unembedding (lm_head) module",
    ),
)


def check_rows(specs: tuple[FacetSpec, ...]) -> None:
    """Raise `FacetSpecError` for the first row that contradicts itself or the vocabularies."""
    seen: set[str] = set()
    known_roles = set(ROLES) | {EVERY_MODULE}
    for f in specs:
        where = f"facet spec row {f.name!r}"
        if f.name in seen:
            raise FacetSpecError(f"{where}: the name appears twice; each facet has one row.")
        seen.add(f.name)
        bad = [r for r in f.roles if r not in known_roles]
        if not f.roles or bad:
            raise FacetSpecError(
                f"{where}: roles {bad or list(f.roles)} unknown; roles are {sorted(known_roles)}."
            )
        bad = [a for a in f.axes if a not in AXES]
        if bad:
            raise FacetSpecError(f"{where}: axes {bad} unknown; axes are {sorted(AXES)}.")
        heads = [i for i, a in enumerate(f.axes) if a in ("heads", "kv_heads")]
        if f.heads_axis is None:
            if heads or f.kv_heads:
                raise FacetSpecError(
                    f"{where}: layout {f.layout} has a heads axis at {heads} (kv_heads="
                    f"{f.kv_heads}) but heads_axis is None."
                )
        else:
            want = "kv_heads" if f.kv_heads else "heads"
            if (
                not 0 <= f.heads_axis < len(f.axes)
                or f.axes[f.heads_axis] != want
                or len(heads) != 1
            ):
                raise FacetSpecError(
                    f"{where}: heads_axis={f.heads_axis} must index the one {want!r} axis of "
                    f"{f.layout} (kv_heads={f.kv_heads})."
                )
        for kind in (f.source, f.fused):
            if kind is not None and kind not in SOURCES:
                raise FacetSpecError(
                    f"{where}: {kind!r} is not a source; sources are {list(SOURCES)}."
                )
        if (f.source == "io") != bool(f.hooks):
            raise FacetSpecError(
                f"{where}: an 'io' facet names the hooks that see it, and only an 'io' facet "
                f"does (source={f.source!r}, hooks={f.hooks})."
            )
        for role, side in f.hooks:
            if role not in known_roles or side not in ("in", "out"):
                raise FacetSpecError(
                    f"{where}: hook {(role, side)} must be (a role, 'in' or 'out')."
                )
        if f.editable == bool(f.remedy):
            raise FacetSpecError(
                f"{where}: a facet an edit cannot always replace needs a remedy, and only such a "
                f"facet has one (editable={f.editable}, remedy={f.remedy!r})."
            )
        if not f.prose:
            raise FacetSpecError(f"{where}: the prose is empty.")


check_rows(SPECS)

#: The rows by facet name.
BY_NAME: dict[str, FacetSpec] = {f.name: f for f in SPECS}

#: Every facet name TorchLens can produce, by role, with its layout and prose. This is the
#: vocabulary `save=` selections and the naming tables are checked against.
FACETS: dict[str, dict[str, str]] = {}
for _f in SPECS:
    for _role in _f.roles:
        FACETS.setdefault(_role, {})[_f.name] = f"{_f.layout} {_f.prose}".strip()
del _f, _role

ALL_FACETS: frozenset[str] = frozenset(BY_NAME)

#: Facets with a `[..., heads, width]` tail that engines often flatten (`compare` accepts it).
PER_HEAD: frozenset[str] = frozenset(f.name for f in SPECS if f.per_head_width)
#: Per-head facets TorchLens keeps token-major (`[batch, pos, heads, ...]`) and head-major.
TOKEN_MAJOR: frozenset[str] = frozenset(f.name for f in SPECS if f.token_major)
HEAD_MAJOR: frozenset[str] = frozenset(f.name for f in SPECS if f.head_major)
#: Facets whose heads are key/value heads (an engine may hand them repeated to the query heads).
KV_HEADS: frozenset[str] = frozenset(f.name for f in SPECS if f.kv_heads)
#: Facets TorchLens rebuilds from a fused attention kernel's inputs when no softmax op ran.
KERNEL_REBUILT: frozenset[str] = frozenset(f.name for f in SPECS if f.fused == "reconstructed")
#: A norm's own facets (`normalized`, `scale`, ...): an engine may hand them copied per head.
NORM_FACETS: frozenset[str] = frozenset(f.name for f in SPECS if f.roles == ("norm",))
#: Facets an edit replaces in the reporting module's own hooks: facet -> `"in"` (its forward
#: pre-hook) or `"out"` (its forward hook).
HOOK_SIDES: dict[str, str] = {
    f.name: f.hooks[0][1] for f in SPECS if len(f.hooks) == 1 and (f.hooks[0][0] in f.roles)
}

#: What to edit instead of a facet an edit cannot always replace: facet -> remedy.
REMEDIES: dict[str, str] = {f.name: f.remedy for f in SPECS if f.remedy}


def spec(name: str) -> FacetSpec:
    """The row of facet `name`.

    Raises:
        FacetSpecError: `name` is no facet; the message lists close matches.
    """
    try:
        return BY_NAME[name]
    except KeyError:
        hint = did_you_mean(name, BY_NAME)
        raise FacetSpecError(
            f"{name!r} is not a facet.{hint} Facets: {', '.join(sorted(BY_NAME))}."
        ) from None


def absent_reason(name: str) -> str:
    """Why a module of the facet's role can lack facet `name`, for a `structurally_absent` status.

    Raises:
        FacetSpecError: `name` is no facet.
    """
    return spec(name).absent or DEFAULT_ABSENT


def tokens_flattened(flat: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether a tensor of shape `flat` is one of `shape` (`[batch, pos, width]`) with batch and
    positions flattened into one axis, as OPT runs its MLP: `[batch * pos, width]`."""
    return len(flat) == 2 and len(shape) == 3 and tuple(flat) == (shape[0] * shape[1], shape[2])

"""`Trace`: one captured forward pass, and how it is read (`trace[name]`, `check`, `summary`,
the notebook table) and saved."""

from __future__ import annotations

import copy
import numbers
import os
import pickle
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from torchlens import _draw, _persist
from torchlens._core import html
from torchlens._core.errors import (
    LookupFailed,
    RoleSpecError,
    TorchLensError,
    did_you_mean,
)
from torchlens._core.persisted import persisted
from torchlens._core.records import ModuleMap, OpRecord
from torchlens._core.roles import ROLES
from torchlens._drawing.errors import DrawingTooLarge, LayoutEngineMissing
from torchlens._naming.resolver import resolve_alias
from torchlens._naming.results import AliasError

if TYPE_CHECKING:
    from torchlens._analysis.selection import SaveSpec
    from torchlens._analysis.structure import Structure

__all__ = ["Trace"]


@persisted
class Trace:
    """One captured forward pass.

    Attributes:
        ops: every executed torch operation, in order ([`OpRecord`][torchlens.OpRecord]).
        modules: module records by address ([`ModuleMap`][torchlens.ModuleMap]); `""` is the
            root.
        output: what the model returned.
        blocks: the block address of each layer of the language-model stack, in run order (a block
            run several times appears once per call); a layer index is a position in this list.
        model_class: the root module's class name.
        save_spec: the normalized `save=` selection the trace was taken with.
        structure: the model's stacks, layers and sublayers as TorchLens found them
            (`structure.stacks`, `structure.kind`: a [`Structure`][torchlens.Structure]).
        edits: for a trace taken with `edit=`, one record per key: the site, the calls edited, how
            the edit was placed and how often it ran; empty otherwise (not kept by `save`/`load`).
    """

    def __init__(
        self,
        ops: list[OpRecord],
        modules: ModuleMap,
        output: Any,
        blocks: list[str],
        model_class: str,
        save: SaveSpec,
        structure: Structure | None = None,
    ):
        self.ops: list[OpRecord] = ops
        self.modules: ModuleMap = modules
        self._output = output
        self.blocks: list[str] = blocks
        self.model_class: str = model_class
        self.save_spec = save
        self.structure = structure
        self.edits: tuple = ()

    #: The `_capture.snapshot.Guarded` groups of the trace's tensors on memory only the output
    #: shares, copied on the first read of `output` (`_capture.output_copies`); None when there
    #: are none left.
    _output_guards: list | None = None
    #: Stored field -> attribute: a saved trace's `output` is loaded into `_output` (no guard).
    _persist_renames = {"output": "_output"}

    @property
    def output(self) -> Any:
        """What the model returned.

        Where nothing but the trace held the output when `trace` returned, the trace's own tensors
        on its memory (the logits op, the `logits` facet) still share it, and the first read of
        `output` (or of one of those tensors) copies them first; otherwise they were copied when
        `trace` returned. Either way, a write into the output never changes what the trace serves.
        """
        self._release_output()
        return self._output

    @output.setter
    def output(self, value: Any) -> None:
        self._release_output()  # the guarded tensors copied before the output they share goes
        self._output = value

    def _release_output(self) -> None:
        """Copy the trace's tensors on memory only the output shares (`_output_guards`), once."""
        guards = self._output_guards
        if guards is not None:
            for group in guards:  # under the groups' lock: another thread reading waits for it
                group.resolve()
            self.__dict__.pop("_output_guards", None)

    def __getstate__(self) -> dict[str, Any]:
        """For pickling and copying: the output's memory copied first (`output`), no guard kept."""
        self._release_output()  # which takes `_output_guards` out of the instance's dict
        return dict(self.__dict__)

    def __deepcopy__(self, memo: dict[int, Any]) -> Trace:
        """`copy.deepcopy(trace)`: every record copied, as for any object. The model's output is
        deep-copied too where torch allows; where it does not (with autograd on, `output` holds
        tensors autograd computed, which torch refuses to deep-copy) it is copied as pickle copies
        it: the same values, as tensors without autograd history."""
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        output = self.output
        if id(output) not in memo:
            try:
                memo[id(output)] = copy.deepcopy(output, memo)
            except RuntimeError:  # "Only Tensors created explicitly by the user ... deepcopy"
                memo[id(output)] = pickle.loads(pickle.dumps(output))
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def save(self, path: str | os.PathLike, model: torch.nn.Module | None = None) -> list[str]:
        """Write this trace to the directory `path`, for [`torchlens.load`][torchlens.load].

        Tensors go to a safetensors file, everything else (module tree, op records, facets,
        dtypes, versions) to `trace.json`; nothing is pickled.

        Args:
            path: a directory (created if missing; a trace already there is replaced).
            model: optionally the traced model, to record its class and (Hugging Face) config.

        Returns:
            What could not be stored portably (a `save=` predicate, a KV-cache object in the
            output); also issued as one warning. Empty when everything was stored.

        Raises:
            TraceFileError: `path` is an existing file.
        """
        return _persist.save(self, path, model)

    def draw(
        self,
        path: str | os.PathLike | None = None,
        *,
        rolled: bool = True,
        depth: int | None = None,
        focus: str | None = None,
        highlight: str | Sequence[str] | Mapping[str, Sequence[str]] | None = None,
        generation: str | None = None,
        max_nodes: int | None = _draw.MAX_NODES,
    ) -> _draw.Drawing:
        """The op graph as SVG text (shown as the picture in a notebook), written to `path` if given.

        Every op is a node (index, name, output shape, dtype where it changes), with the model inputs,
        the parameters where they enter and the output; arrows are the recorded data flow; module calls
        are nested boxes. It reads only the records, so a loaded or `save="none"` trace draws too.
        See the [op graph guide](../guides/op-graph.md).

        Args:
            path: where to write the drawing: a `.svg`, `.png` or `.pdf` file (PNG and PDF are
                rendered by Graphviz), or None.
            rolled: each stack's layers with one recorded op sequence drawn once, `×N`; a differing
                layer, or a second call of one block, drawn apart with the reason. False draws
                every op.
            depth: levels of module boxes; deeper modules are one node each; `0`: no boxes;
                None: every level.
            focus: a module address or a hook name: that module's ops and the edges into and out
                of it.
            highlight: hook names (with `generation=`), a dict generation -> names, or `"facets"`:
                each marked on the op whose output it reads, with its status.
            generation: the naming generation of `highlight` and `focus` names.
            max_nodes: past this many nodes and boxes the call refuses before the layout and says
                how to narrow the drawing; None: no limit.

        Returns:
            A [`Drawing`][torchlens.Drawing]: the SVG as a `str`, with `counts`, `unplaced` (names with no
            mark, and why) and `groups` (each rolled stack's groups of layers, and why a group is apart).

        Raises:
            DrawSpecError: an option is not accepted (the message says what is); `DrawingTooLarge`
                (a subclass) when the drawing has more than `max_nodes` nodes.
            LookupFailed: a `highlight=` or `focus=` name that no naming table knows, with close matches.
            LayoutEngineMissing: pygraphviz is not installed (`pip install -e '.[draw]'` in the checkout).
        """
        return _draw.draw(
            self,
            path,
            rolled=rolled,
            depth=depth,
            focus=focus,
            highlight=highlight,
            generation=generation,
            max_nodes=max_nodes,
        )

    def __getitem__(self, name: str) -> torch.Tensor:
        """The tensor at a site: `trace["address:facet"]`, or any name another library uses.

        `trace["transformer.h.1:resid_post"]` is `trace.modules["transformer.h.1"].facets["resid_post"]`
        (write the root as `"<root>:logits"`). A name without a colon is resolved with
        [`resolve_alias`][torchlens.mechinterp.resolve_alias] in every naming generation, so
        `trace["blocks.1.hook_resid_post"]` and `trace["layers_output[1]"]` read the same tensor.

        Raises:
            LookupFailed: the lookup's own error: no such module, facet or name
                (`ModuleNotFoundInTrace`, `FacetNotFound`, `UnknownAlias`, ...), a facet `save=`
                did not keep (`FacetNotSaved`), or a name with no site in this trace (`AliasError`).
        """
        return self._read(name, "trace[...]", "; the ops are trace.ops[i]", grad=False)

    def grad(self, name: str) -> torch.Tensor:
        """The gradient counterpart of `trace[name]`: d loss / d the tensor at that site, in a
        trace taken with `grads=`.

        The name is read as `trace[name]` reads it: `"address:facet"` is
        `trace.modules[address].grads[facet]`, and any other library's name is resolved with
        [`resolve_alias`][torchlens.mechinterp.resolve_alias] (its `.grad`).

        Raises:
            LookupFailed: what `trace[name]` raises for the name, and `NoGradients` (the trace
                was taken without `grads=`), `GradNotFound` (the site's gradient is not served;
                the reason says why) or `GradNotSaved` (`save=` did not keep the site).
        """
        return self._read(name, "trace.grad(...)", "", grad=True)

    def _read(self, name: Any, call: str, hint: str, *, grad: bool) -> torch.Tensor:
        """The value (or, with `grad`, the gradient) at a name's site: `"address:facet"` read
        from the module's facets (gradients), any other name resolved in every generation."""
        if not isinstance(name, str):
            raise LookupFailed(
                f"{call} takes a name (a str): 'address:facet' or another library's hook name, "
                f"not {type(name).__name__} {name!r}{hint}."
            )
        if ":" in name:
            address, facet = name.rsplit(":", 1)
            record = self.modules[address.strip()]
            return (record.grads if grad else record.facets)[facet.strip()]
        resolved = self._resolved(name)  # the call the name's layer ran
        return resolved.grad if grad else resolved.tensor

    def _resolved(self, name: str) -> Any:
        """`resolve_alias(self, name)`, raising `AliasError` where the name reads no site."""
        r = resolve_alias(self, name)
        if (
            r.module_address is None
            or r.facet is None
            or r.status in ("structurally_absent", "ambiguous")
        ):
            remedy = f" {r.remedy[0].upper()}{r.remedy[1:]}." if r.remedy else ""
            raise AliasError(
                f"{name!r} has no site to read in this trace ({r.status}): {r.reason}{remedy}"
            )
        return r

    def check(self) -> dict[tuple[str, int, str], str]:
        """Run every pending check of the trace now, rather than on first read.

        Derived facets (rebuilt attention patterns, per-head results, norm statistics) and the
        expensive checks of real ones (`z`, `resid_mid`) run lazily; see
        [`FacetSite`][torchlens.FacetSite]. So do the derived gradients of a trace taken with
        `grads=`. After `check()` no site is pending, values and gradients alike, every
        `check_error` is set, and each `FacetMap.refused` is final. `Trace.save` runs it.

        Returns:
            Every facet the trace does not serve because its check failed or could not run, as
            `(module address, call index, facet) -> reason`, and every gradient refused so, as
            `(module address, call index, "<facet> (gradient)") -> reason`; empty when every
            check held.
        """
        refused = {}
        for rec in self.modules.values():
            for call in rec.calls:
                if call.facets is not None:
                    for facet, why in call.facets.check().items():
                        refused[(call.address, call.index, facet)] = why
                if call.grads is not None:
                    waiting = set(
                        call.grads.pending
                    )  # a gradient refused at trace time is not a check's
                    for facet, why in call.grads.check().items():
                        if facet in waiting:
                            refused[(call.address, call.index, f"{facet} (gradient)")] = why
        return refused

    @property
    def pending(self) -> int:
        """How many facet sites, and gradient sites of a `grads=` trace, still wait for their
        check (computes nothing)."""
        return sum(
            len(m.pending)
            for rec in self.modules.values()
            for c in rec.calls
            for m in (c.facets, c.grads)
            if m is not None
        )

    def by_role(self, role: str) -> list[str]:
        """Addresses of the modules with `role` that ran, in the order they first ran.

        Raises:
            RoleSpecError: `role` is not one of `"root"`, `"block"`, `"attention"`, `"mlp"`,
                `"norm"`, `"embedding"`, `"unembed"`, `"other"` (with the close matches).
        """
        if role not in ROLES:
            hint = did_you_mean(str(role).lower(), ROLES)
            raise RoleSpecError(
                f"by_role({role!r}): not a role.{hint} Roles: {', '.join(repr(r) for r in ROLES)}."
            )
        recs = [r for r in self.modules.values() if r.role == role and r.calls]
        return [r.address for r in sorted(recs, key=lambda r: r.calls[0].first_op)]

    def __repr__(self) -> str:
        # every tensor the trace holds once: op outputs, and facets that are none of them (a
        # `save=` list keeps a block's output as its facet alone; a pending facet counts, as it
        # is served on read); computing nothing, no guarded copy made
        held = {id(t) for op in self.ops for t in op._tensors if t is not None}
        saved = len(held)
        for rec in self.modules.values():
            for call in rec.calls:
                for site in call.facets._sites.values() if call.facets is not None else ():
                    if site._pending is not None or (
                        site._value is not None and id(site._value) not in held
                    ):
                        saved += 1
                        if site._value is not None:
                            held.add(id(site._value))
        return (
            f"Trace({self.model_class}: {len(self.ops)} ops, {len(self.modules)} modules, "
            f"{len(self.blocks)} blocks, {saved} tensors saved)"
        )

    def summary(self, max_rows: int | None = None) -> str:
        """A plain-text table of the modules that ran: address, role, calls, facets with shapes.

        It computes nothing: the last line counts the facets whose check is still pending (they
        are computed and checked on first read, or by `check()`).
        """
        if max_rows is not None and (
            isinstance(max_rows, bool) or not isinstance(max_rows, numbers.Integral) or max_rows < 1
        ):
            raise TorchLensError(
                f"summary(max_rows={max_rows!r}): pass a whole number of rows, 1 or more, or None "
                "for every module."
            )
        rows = [("module", "role", "calls", "facets")]
        for rec in self.modules.values():
            if not rec.calls:
                continue
            fac = rec.calls[0].facets
            facets = ", ".join(
                f"{n}{list(s.shape)}" + ("" if s.saved else "*")
                for n, s in (fac.sites.items() if fac is not None else [])
            )
            rows.append((rec.address or "<root>", rec.role, str(len(rec.calls)), facets))
        if max_rows is not None:
            rows = rows[: int(max_rows) + 1]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = ["  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
        pending = self.pending
        lines.append(
            "(* = exists but not saved"
            + (
                f"; {pending} facets are checked on first read or by trace.check())"
                if pending
                else ")"
            )
        )
        return "\n".join(lines)

    def _repr_html_(self, max_rows: int = 60) -> str:
        """The modules that ran as an HTML table (what `summary()` prints), for notebooks.

        Facets are listed with their shapes; a facet this trace did not save is grey and starred,
        and a computed or reconstructed (read-only) facet is in italics; a facet's tooltip says
        when its check is pending. Past `max_rows` modules the table says how many it left out.
        It runs no check. Under the table, folded, is the rolled op graph (`draw()`), when it has at
        most `REPR_DRAWING_NODES` nodes and boxes; otherwise a line says how to draw it.
        """
        ran = [rec for rec in self.modules.values() if rec.calls]
        rows = []
        for rec in ran[:max_rows]:
            facets = rec.calls[0].facets
            cells = []
            for name, site in facets.sites.items() if facets is not None else []:
                style = (
                    "white-space:nowrap;"
                    + ("" if site.saved else "color:#8c959f;")
                    + ("font-style:italic;" if site.read_only else "")
                )
                note = (
                    site.kind
                    + ("" if site.saved else ", not saved")
                    + ("" if site.checked else ", check pending (runs on first read)")
                    + (f": {site.note}" if site.note else "")
                )
                cells.append(
                    html.code(
                        f"{name}{list(site.shape)}" + ("" if site.saved else "*"), style, note
                    )
                )
            depth = rec.address.count(".") + 1 if rec.address else 0
            address = html.code(
                rec.address or "<root>", f"margin-left:{depth * 0.8:.1f}em" if depth else ""
            )
            rows.append([address, html.esc(rec.role), html.esc(len(rec.calls)), " ".join(cells)])
        notes = []
        if len(ran) > max_rows:
            notes.append(f"{len(ran) - max_rows} more modules ran; trace.summary() lists them all.")
        if any(
            not s.saved
            for rec in ran
            for c in rec.calls[:1]
            if c.facets is not None
            for s in c.facets.sites.values()
        ):
            notes.append("* exists but not saved.")
        notes.append("Italic: computed or reconstructed, read-only.")
        pending = self.pending
        if pending:
            notes.append(f"{pending} facets are checked on first read (or by trace.check()).")
        return html.table(
            ["module", "role", "calls", "facets"],
            rows,
            caption=repr(self),
            note=" ".join(notes),
            footer=self._html_drawing(),
        )

    #: The most nodes the notebook view of a trace lays out for its folded op graph.
    REPR_DRAWING_NODES = 400

    def _html_drawing(self) -> str:
        """The rolled op graph, folded under the notebook table, or why it is not there."""
        try:
            svg = self.draw(max_nodes=self.REPR_DRAWING_NODES)
        except DrawingTooLarge:
            why = (
                f"its rolled op graph has more than {self.REPR_DRAWING_NODES} nodes; draw it with "
                f"trace.draw(focus=..., depth=...)"
            )
        except LayoutEngineMissing as exc:
            why = f"no op graph: {exc}"
        else:
            return f"<details><summary>op graph (rolled; trace.draw())</summary>{svg}</details>"
        return f"<small>{html.esc(why)}</small>"

"""What `trace_generate` returns: the `GenerationTrace` of a generation and each step's `StepInfo`.

`GenerationTrace.check_decode` holds the decode steps against full forwards; the check itself is
`torchlens._generation.decode.check_decode`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from torchlens._generation.decode import check_decode, weights_now
from torchlens._generation.decode_report import DecodeReport
from torchlens._trace import Trace

__all__ = ["GenerationTrace", "StepInfo"]


@dataclass
class StepInfo:
    """What one forward call of a generation received, as `generate` passed it.

    Attributes:
        index: the step (0 is the prefill, `i` the `i`-th decode forward).
        kind: `"prefill"` or `"decode"`.
        kept: whether the step's trace keeps tensors (`steps=`); otherwise records only.
        input_ids: the token ids the step ran on, `[batch, new]` (an encoder-decoder model's
            `decoder_input_ids`).
        attention_mask: the attention mask as passed, `[batch, past + new]`, or None.
        position_ids: the position ids as passed, or None when `generate` passed none.
        cache_position: the `cache_position` as passed, or None.
        past_length: the cache's length before the step (0 for the prefill).
        cache: the class name of the cache object the step received, or None.
    """

    index: int
    kind: str
    kept: bool
    input_ids: Tensor | None
    attention_mask: Tensor | None
    position_ids: Tensor | None
    cache_position: Tensor | None
    past_length: int
    cache: str | None

    @property
    def new_tokens(self) -> int:
        """How many positions the step computed (the prompt's length at the prefill, else 1)."""
        return 0 if self.input_ids is None else int(self.input_ids.shape[-1])


@dataclass
class GenerationTrace:
    """One run of a model's `generate`, every forward call traced.

    Attributes:
        steps: one [`Trace`][torchlens.Trace] per forward call, in order: `steps[0]` the
            prefill, `steps[i]` the `i`-th decode forward. Each is a full trace of that call
            (modules, facets, statuses, `save=`/`store=` rules); its positions are the tokens the
            call computed (one per row at a decode step), and an attention pattern's keys are
            every position the call attended to, the cached ones included
            (`[batch, heads, new, past + new]` with a dynamic cache).
        info: one [`StepInfo`][torchlens.StepInfo] per step: what `generate` passed it.
        output: what `model.generate` returned (a tensor, or a `ModelOutput` with
            `return_dict_in_generate=True`).
        sequences: the generated sequences, prompt included: what `model.generate` returns for
            the same arguments and seed.
        prompt: the prompt `input_ids` as given.
        encoder_decoder: the model is an encoder-decoder (T5, BART): `steps[0]` holds the encoder's
            one call (its stack) and the decoder's first forward; every later step is a decoder
            forward, whose cross-attention reads the encoder's output from the cache.
        edits: the `edit=` as given, by step: step -> the keys applied there.
        model: the model that generated (held for `check_decode`).
    """

    steps: list[Trace]
    info: list[StepInfo]
    output: Any
    sequences: Tensor
    prompt: Tensor | None
    encoder_decoder: bool = False
    edits: dict[int, tuple] = field(default_factory=dict)
    model: nn.Module | None = field(default=None, repr=False)
    _call: dict = field(default_factory=dict, repr=False)
    #: each parameter of `model` as `generate` left it: (name, tensor, version), for
    #: `check_decode` to refuse a model whose weights were written since (`decode.weights_now`)
    _weights: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.model is not None and not self._weights:
            self._weights = weights_now(self.model)

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self) -> str:
        kept = sum(i.kept for i in self.info)
        return (
            f"GenerationTrace({type(self.model).__name__ if self.model is not None else '?'}: "
            f"{len(self.steps)} steps (prefill + {len(self.steps) - 1} decode), {kept} keep tensors, "
            f"sequences {list(self.sequences.shape)})"
        )

    def check_decode(
        self,
        steps: int | range | Sequence[int] | None = None,
        *,
        tolerance: str | None = "auto",
        atol: float | None = None,
        rtol: float | None = None,
        explain: bool = True,
    ) -> DecodeReport:
        """Rerun each decode step as a full forward without the cache and compare every saved site.

        For decode step `i`, the model is run once more on
        every token fed so far (the prompt and the tokens fed at steps `1..i`), with the step's
        attention mask, the position ids that mask implies (`cumsum - 1`, as `generate` derives
        them) and `use_cache=False`; each site the step saved is compared with the rerun's site at
        the step's new positions (an attention pattern over the keys the step attended to).

        Args:
            steps: which decode steps to check (an int, a list or range of ints; default: every
                decode step that kept tensors). Step 0, the prefill, may be named too.
            tolerance: `"auto"` (default): each site's tolerance is set from its dtype as
                `compare(tolerance="auto")` sets it, from a float64 rerun of a copy of the model:
                `|decode - full| <= 4 (max|full - full64| + eps |full|)`. None: `atol`/`rtol`.
            atol: absolute tolerance when `tolerance=None` (default 1e-5).
            rtol: relative tolerance when `tolerance=None` (default 1e-4).
            explain: for a step that differs, say where and why (the first site that differs and
                what the step's tensor equals instead: shifted positions, keys attended that the
                full forward masks, the new key missing from the cache read).

        Returns:
            A [`DecodeReport`][torchlens.DecodeReport]: one row per (step, site) compared, and per
            step its verdict and explanation.
        """
        return check_decode(self, steps, tolerance=tolerance, atol=atol, rtol=rtol, explain=explain)

"""Inputs that fit the test models: seeded token ids, a family's forward arguments, and a
tokenizer made in memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchlens.testing._rows import FAMILIES, VOCAB

if TYPE_CHECKING:  # transformers stays an optional import of the library
    from transformers import PreTrainedTokenizerFast


def token_ids(batch: int = 1, length: int = 7, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    """Seeded random token ids, shape `[batch, length]`, drawn from `range(vocab)`.

    Examples:
        >>> from torchlens import testing
        >>> testing.token_ids(2, 3).shape
        torch.Size([2, 3])
        >>> bool((testing.token_ids(seed=4) == testing.token_ids(seed=4)).all())
        True
    """
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen)


def inputs(family: str, batch: int = 1, length: int = 5, seed: int = 0) -> tuple[tuple, dict]:
    """Seeded `(args, kwargs)` for the forward of [`build(family)`][torchlens.testing.build].

    What the forward takes is the family's `Structure.inputs`: token ids (`"text"`, and any
    family without a structure); ids and `length - 1` decoder ids (`"seq2seq"`); a 16x16 image
    (`"image"`); ids and an image (`"text+image"`); ids whose positions 1 to 4 are image tokens,
    one per 8x8 patch, and an image (`"llava"`, so `length` must be at least 5).

    Args:
        family: a key of `FAMILIES`.
        batch: the batch size.
        length: the number of token ids.
        seed: the seed of the ids and the pixels.

    Returns:
        The positional and keyword arguments: `model(*args, **kwargs)`.

    Raises:
        KeyError: `family` is not a key of `FAMILIES` (the message lists them).
        ValueError: `length` is too short for the family's inputs.

    Examples:
        >>> from torchlens import testing
        >>> args, kwargs = testing.inputs("t5", length=4)
        >>> args[0].shape, kwargs["decoder_input_ids"].shape
        (torch.Size([1, 4]), torch.Size([1, 3]))
        >>> testing.inputs("vit")[0][0].shape
        torch.Size([1, 3, 16, 16])
    """
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; families: {', '.join(FAMILIES)}")
    structure = FAMILIES[family].structure
    kind = structure.inputs if structure is not None else "text"
    ids = token_ids(batch, length, seed)
    pixels = torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(seed))
    if kind == "image":
        return (pixels,), {}
    if kind == "text+image":
        return (), {"input_ids": ids, "pixel_values": pixels}
    if kind == "llava":
        if length < 5:
            raise ValueError(f"{family} takes 4 image tokens after the first; length must be >= 5")
        ids = ids.masked_fill(ids == VOCAB - 1, 0)
        ids[:, 1:5] = FAMILIES[family].settings["image_token_index"]
        return (), {"input_ids": ids, "pixel_values": pixels}
    if kind == "seq2seq":
        if length < 2:
            raise ValueError(f"{family} takes decoder ids of length - 1; length must be >= 2")
        return (ids,), {"decoder_input_ids": ids[:, : length - 1]}
    return (ids,), {}


def tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """A word-level fast tokenizer made in memory: nothing is downloaded.

    Ids 0-3 are `<unk>`, `<bos>`, `<eos>` and `<pad>`; the words `t4` ... `t{vocab-1}` are ids 4 to
    `vocab - 1`, split on whitespace. Engines that insist on a tokenizer (nnterp) accept it.

    Returns:
        The tokenizer, a `transformers.PreTrainedTokenizerFast`.

    Examples:
        >>> from torchlens import testing
        >>> testing.tokenizer()("t5 t9 t63")["input_ids"]
        [5, 9, 63]
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {
        "<unk>": 0,
        "<bos>": 1,
        "<eos>": 2,
        "<pad>": 3,
        **{f"t{i}": i for i in range(4, vocab)},
    }
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
    )

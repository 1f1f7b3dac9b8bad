"""Write the stored references the engine tests beside this file compare against.

A reference is a TorchLens trace of the small model an engine test runs, saved with `Trace.save`:
every tensor of one eager forward, with the model's class and config. Run this once where
TorchLens is installed, commit `references/`, and run it again only when the model changes; the
tests then need neither the eager model's forward nor TorchLens's peer engines to know what each
hook should read.

    python make_references.py              # writes references/<name>/ beside this file
    python make_references.py OTHER_DIR    # or into OTHER_DIR/<name>/
"""

from __future__ import annotations

import sys
from pathlib import Path

import torchlens as tl
from torchlens import testing

#: name -> (family of torchlens.testing, config settings over the family's). vLLM's CPU attention
#: takes heads of 64, hence the wider model for it.
MODELS = {
    "llama": ("llama", {}),
    "llama-vllm": ("llama", dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                 intermediate_size=256, vocab_size=128, max_position_embeddings=64)),
}
TOKENS = 7  #: the prompt: testing.token_ids(length=TOKENS) within the model's vocabulary


def prompt(name: str):
    family, settings = MODELS[name]
    return testing.token_ids(length=TOKENS, vocab=settings.get("vocab_size", testing.VOCAB))


def make(directory: Path) -> list[Path]:
    written = []
    for name, (family, settings) in MODELS.items():
        model = testing.build(family, **settings)
        # use_cache=False: no KV-cache object in the output, which a stored trace cannot hold
        tl.trace(model, prompt(name), save="all", use_cache=False).save(directory / name, model=model)
        written.append(directory / name)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("references")
    for path in make(target):
        print(path)

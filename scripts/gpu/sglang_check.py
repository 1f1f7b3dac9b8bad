"""SGLang against TorchLens on a tiny Llama: which tensor are SGLang's returned hidden states?

NOT EXECUTED by this project's test suite: it needs a CUDA GPU and SGLang (`pip install sglang`,
plus TorchLens and transformers). Run it unchanged on such a machine:

    python scripts/gpu/sglang_check.py

It starts SGLang's offline Engine on the tiny checkpoint with `enable_return_hidden_states=True`,
generates one token from a 7-token prompt in bfloat16, and compares the prompt's hidden states
with TorchLens's trace of the same weights at the two candidate sites, the final norm's input
(`ln_final.hook_in`) and its output (`unembed.hook_in`), with atol = rtol = 0.05 (bfloat16 against
float32). Exit status 0 when exactly one candidate matches, which names the site; 1 otherwise.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

if importlib.util.find_spec("sglang") is None:
    raise SystemExit("This check needs SGLang and a CUDA GPU (pip install sglang).")

import sglang as sgl
import torch
from _tiny import PROMPT, tiny_llama

import torchlens as tl
import torchlens.mechinterp as mi


def main() -> int:
    model, directory = tiny_llama()
    trace = tl.trace(model, torch.tensor([PROMPT]), save="all")
    engine = sgl.Engine(
        model_path=directory,
        dtype="bfloat16",
        skip_tokenizer_init=True,  # token ids in
        disable_cuda_graph=True,
        disable_radix_cache=True,  # SGLang's prefix cache: every prompt position is computed
        enable_return_hidden_states=True,
    )
    try:
        outputs = engine.generate(
            input_ids=[PROMPT],
            sampling_params={"max_new_tokens": 1, "temperature": 0},
            return_hidden_states=True,
        )
    finally:
        engine.shutdown()
    hidden = torch.as_tensor(outputs[0]["meta_info"]["hidden_states"][0]).float()[: len(PROMPT)]
    matches = []
    for name in ("ln_final.hook_in", "unembed.hook_in"):
        report = mi.compare(trace, {name: hidden}, generation="4.x", atol=0.05, rtol=0.05)
        print(report)
        if report.ok:
            matches.append(name)
    print(
        "SGLang's hidden states are", matches[0] if len(matches) == 1 else f"ambiguous: {matches}"
    )
    return 0 if len(matches) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""TensorRT-LLM against TorchLens on a tiny Llama: the prompt's logits.

NOT EXECUTED by this project's test suite: it needs a CUDA GPU and TensorRT-LLM
(`pip install tensorrt_llm`, plus TorchLens and transformers). Run it unchanged on such a machine:

    python scripts/gpu/tensorrt_llm_check.py

TensorRT-LLM compiles or captures the model, so there are no module hooks to register; what its
LLM API returns are logits. With `return_context_logits=True` in its SamplingParams, the output
holds the logits of every prompt position, which this script compares with TorchLens's
`unembed.hook_out` (a 4.x name) for the same weights: float32 first (atol = rtol = 1e-3), then
bfloat16 (atol = rtol = 0.05). Exit status 0 when both pass.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

if importlib.util.find_spec("tensorrt_llm") is None:
    raise SystemExit("This check needs TensorRT-LLM and a CUDA GPU (pip install tensorrt_llm).")

import torch
from _tiny import PROMPT, tiny_llama
from tensorrt_llm import LLM, SamplingParams

import torchlens as tl
import torchlens.mechinterp as mi


def main() -> int:
    model, directory = tiny_llama()
    trace = tl.trace(model, torch.tensor([PROMPT]), save="all")
    ok = True
    for dtype, tol in (("float32", 1e-3), ("bfloat16", 0.05)):
        llm = LLM(model=directory, dtype=dtype, skip_tokenizer_init=True)
        try:
            params = SamplingParams(max_tokens=1, temperature=0.0, return_context_logits=True)
            output = llm.generate([PROMPT], params)[0]
        finally:
            llm.shutdown()
        logits = torch.as_tensor(output.context_logits).float().cpu()[: len(PROMPT)]
        report = mi.compare(
            trace, {"unembed.hook_out": logits}, generation="4.x", atol=tol, rtol=tol
        )
        print(dtype, report, sep="\n")
        ok = ok and report.ok
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

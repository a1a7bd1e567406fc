#!/usr/bin/env python3
"""Loads a GGUF file `kiln export gguf` wrote in llama.cpp (the llama-cpp-python package
from PyPI, which builds it) and compares its logits with the expected ones of the model
it came from (tests/reference/hf/<name>/expected.safetensors, transformers' float32
logits, which kiln's match within 1e-6):

    kiln import hf tests/reference/hf/llama /tmp/run
    kiln export gguf /tmp/run /tmp/m.gguf [--dtype f16|bf16|q8_0]
    TORCH2/bin/python tests/reference/check_gguf.py /tmp/m.gguf tests/reference/hf/llama

Prints the largest logit difference over both rows and whether every position's argmax
(the greedy token) is the same; exits 1 when the argmaxes differ. Run by hand: CI does
not build llama.cpp (tests/test_hf.c reads the file back with a reader of its own).
"""
import sys

import numpy as np
from safetensors.numpy import load_file
from llama_cpp import Llama


def main():
    gguf, src = sys.argv[1], sys.argv[2]
    exp = load_file(f"{src}/expected.safetensors")
    idx, want = exp["idx"], exp["logits"]
    worst, same = 0.0, True
    for row in range(idx.shape[0]):
        # an f32 KV cache (type 0), so that only the weights' type differs from kiln
        llm = Llama(model_path=gguf, n_ctx=64, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
        ids = [int(t) for t in idx[row]]
        llm.eval(ids)
        got = np.array(llm.scores[: len(ids)], dtype=np.float32)
        worst = max(worst, float(np.abs(got - want[row]).max()))
        same &= bool((got.argmax(-1) == want[row].argmax(-1)).all())
        del llm
    print(f"{gguf}: logits max |llama.cpp - transformers| = {worst:.3g}, greedy tokens {'the same' if same else 'DIFFER'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

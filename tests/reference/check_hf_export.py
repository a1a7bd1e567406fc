#!/usr/bin/env python3
"""Loads a folder `kiln export hf` wrote with transformers and compares its logits with
the expected ones of the model it came from (tests/reference/hf/<name>/expected.safetensors):

    kiln import hf tests/reference/hf/llama /tmp/run && kiln export hf /tmp/run /tmp/out
    TORCH2/bin/python tests/reference/check_hf_export.py /tmp/out tests/reference/hf/llama

Prints the largest difference and exits 1 above 1e-5 (float32 weights) or 0.05 (16-bit).
Needs torch and transformers from PyPI; run by hand (CI has no torch: tests/test_hf.c
checks the round trip through kiln's own loader instead).
"""
import json
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main():
    out, src = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    exp = load_file(f"{src}/expected.safetensors")
    with torch.no_grad():
        logits = model(exp["idx"]).logits.float()
    d = (logits - exp["logits"]).abs().max().item()
    with open(f"{out}/config.json") as f:
        dt = json.load(f).get("torch_dtype", "float32")
    tol = 1e-5 if dt == "float32" else 0.05
    print(f"{out}: {type(model).__name__}, {dt} weights, logits max |d| = {d:.3g} (tolerance {tol})")
    return 0 if d <= tol else 1


if __name__ == "__main__":
    sys.exit(main())

"""Writes tests/reference/golden_flex.safetensors: PyTorch 2.x's flex_attention on fixed
inputs, forward and log-sum-exp, for kiln's presets and two user-written modifiers
(tests/test_flex.c compares kiln with it). Run with a PyTorch 2.x from PyPI:
    python tests/reference/flex_ref.py tests/reference/golden_flex.safetensors
Inputs are made here from a fixed seed and saved beside the outputs."""
import sys
import torch
from torch.nn.attention.flex_attention import flex_attention, create_block_mask
from safetensors.torch import save_file

torch.manual_seed(20261206)
B, H, HKV, T, D = 2, 4, 2, 32, 8
q = torch.randn(B, H, T, D)
k = torch.randn(B, HKV, T, D)
v = torch.randn(B, HKV, T, D)
doc_ids = torch.tensor([[0] * 7 + [1] * 12 + [2] * 13, [0] * 20 + [1] * 3 + [4] * 9], dtype=torch.int64)
slopes = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)], dtype=torch.float32)
prefix_rows = torch.tensor([3, 11], dtype=torch.int64)


def causal(b, h, qi, ki):
    return qi >= ki


cases = {
    "causal": (None, causal),
    "window8": (None, lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 8)),
    "prefix5": (None, lambda b, h, qi, ki: (ki < 5) | (qi >= ki)),
    "doc_causal": (None, lambda b, h, qi, ki: (doc_ids[b, qi] == doc_ids[b, ki]) & (qi >= ki)),
    "alibi_causal": (lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi), causal),
    "softcap5_causal": (lambda s, b, h, qi, ki: 5.0 * torch.tanh(s / 5.0), causal),
    "user": (lambda s, b, h, qi, ki: s * 0.5 + (qi - ki) * 0.01,
             lambda b, h, qi, ki: (qi - ki < 5) & (ki <= qi + 2)),
    "rows": (None, lambda b, h, qi, ki: (ki < prefix_rows[b]) | (ki <= qi)),
}
out = {"q": q, "k": k, "v": v, "doc_ids": doc_ids, "slopes": slopes, "prefix_rows": prefix_rows}
for name, (score_mod, mask_mod) in cases.items():
    bm = create_block_mask(mask_mod, B, H, T, T, device="cpu", BLOCK_SIZE=8)
    y, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=True, return_lse=True)
    out[name + ".out"] = y.contiguous()
    out[name + ".lse"] = lse.contiguous()
save_file(out, sys.argv[1], metadata={"torch": torch.__version__})
print("wrote", sys.argv[1], "with torch", torch.__version__)

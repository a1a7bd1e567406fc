"""PyTorch 2.x's compiled flex_attention on the CPU, forward, for bench/flex.sh: for each
T, causal and a sliding window of T/8, B 1, 8 heads of 64, f32, at the given thread
count; median ms over ROUNDS calls after warm-up (compilation, then 200 ms of calls, as
bench_flex). Prints one JSON line per T.
    python bench/flex_torch.py --T 512,1024,2048,4096 --threads 2 --rounds 5"""
import argparse
import json
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

ap = argparse.ArgumentParser()
ap.add_argument("--T", default="512,1024,2048,4096")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--B", type=int, default=1)
ap.add_argument("--H", type=int, default=8)
ap.add_argument("--D", type=int, default=64)
args = ap.parse_args()
torch.set_num_threads(args.threads)
compiled = torch.compile(flex_attention)


def median_ms(fn, rounds, warm_s=0.2):
    """Median ms of ROUNDS calls after at least two calls and warm_s seconds of warm-up
    (the same as bench_flex's --warm-ms: an idle vCPU comes back slowly)."""
    end = time.perf_counter() + warm_s
    n = 0
    while n < 2 or time.perf_counter() < end:
        fn()
        n += 1
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


with torch.no_grad():
    for T in (int(t) for t in args.T.split(",")):
        torch.manual_seed(1)
        q, k, v = (torch.randn(args.B, args.H, T, args.D) for _ in range(3))
        W = T // 8
        masks = {
            "causal": lambda b, h, qi, ki: qi >= ki,
            "window_T8": lambda b, h, qi, ki: (qi >= ki) & (qi - ki < W),
        }
        row = {"bench": "flex_torch", "torch": torch.__version__, "T": T, "threads": args.threads}
        for name, mask in masks.items():
            bm = create_block_mask(mask, None, None, T, T, device="cpu")
            row[name + "_ms"] = round(median_ms(lambda: compiled(q, k, v, block_mask=bm), args.rounds), 3)
        print(json.dumps(row), flush=True)

#!/usr/bin/python3
"""PyTorch side of the training-step benchmark: config S (GPT-2 style, V=256, T=128, C=256,
4 layers, 4 heads, B=16, AdamW lr 3e-4), forward + backward + gradient clipping at norm 1
+ step on random byte batches, as bench/train_step.c does.

    /usr/bin/python3 tests/reference/train_step_torch.py --threads 2 [--steps 20] [--warmup 3]
    TORCH2/bin/python tests/reference/train_step_torch.py --threads 2 --compile
    TORCH2/bin/python tests/reference/train_step_torch.py --threads 2 --precision bf16

Prints one JSON line: median tokens/s over the timed steps, per-step times, peak RSS.
Uses the model of gpt_ref.py (plain PyTorch, manual attention), eager mode; --compile
runs the whole step through torch.compile (PyTorch 2.x, inductor on the cpu), and
reports the first step's time (the compile) apart.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_ref  # noqa: E402


def config_s():
    return gpt_ref.gpt2_config(n_layer=4, n_head=4, n_kv_head=4, n_embd=256, block_size=128, vocab_size=256)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--clip", type=float, default=1.0, help="max gradient norm; 0 = no clipping")
    ap.add_argument("--compile", action="store_true", help="torch.compile the step (PyTorch 2.x, inductor)")
    ap.add_argument("--model", choices=["gpt2", "llama"], default="gpt2",
                    help="config S GPT-2 style, or LLaMA style (RMSNorm, RoPE, SwiGLU)")
    ap.add_argument("--experts", type=int, default=0, help="llama: every block a mixture of experts (moe_ref.py: a "
                    "loop over the experts, the common PyTorch implementation)")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--shared", type=int, default=0)
    ap.add_argument("--expert-ffn", type=int, default=0)
    ap.add_argument("--precision", choices=["f32", "bf16", "f16"], default="f32",
                    help="bf16/f16: forward under torch.autocast('cpu'); f16 with torch.amp.GradScaler")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    cfg = config_s()
    if a.model == "llama":
        cfg = gpt_ref.llama_config(n_layer=4, n_head=4, n_kv_head=2, n_embd=256, block_size=128, vocab_size=256)
    B, T = a.batch, cfg["block_size"]
    moe = None
    if a.experts:
        import moe_ref
        cfg = moe_ref.moe_config(n_layer=4, n_embd=256, block_size=128, vocab_size=256, n_head=4, n_kv_head=2,
                                 n_routed_experts=a.experts, moe_top_k=a.top_k, n_shared_experts=a.shared,
                                 moe_ffn=a.expert_ffn, n_dense_layers=0, moe_bias_speed=0.001)
        model = moe = moe_ref.MoEGPT(cfg)
    else:
        model = gpt_ref.GPT(cfg)
    opt = gpt_ref.make_optimizer(model, 3e-4, (0.9, 0.95), 1e-8, 0.1)
    g = torch.Generator().manual_seed(a.seed)

    amp = {"bf16": torch.bfloat16, "f16": torch.float16}.get(a.precision)
    scaler = torch.amp.GradScaler("cpu") if a.precision == "f16" else None

    def train_step(idx, tgt):
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
            loss = model(idx, tgt)[1]
        if scaler:  # unscale before clipping, as the GradScaler docs do it
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        if a.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if moe:
            for mb in moe.moe_blocks():
                mb.update_bias()
        opt.zero_grad(set_to_none=True)
        return loss

    run = torch.compile(train_step) if a.compile else train_step

    def step():
        # random bytes; targets are the next byte, as a byte-level LM would see them
        buf = torch.randint(0, 256, (B, T + 1), generator=g, dtype=torch.int64)
        idx, tgt = buf[:, :-1], buf[:, 1:]
        t0 = time.perf_counter()
        loss = run(idx, tgt)
        return time.perf_counter() - t0, loss.item()

    t_first = time.perf_counter()
    first_dt, _ = step()
    first_s = time.perf_counter() - t_first
    for _ in range(a.warmup - 1):
        step()
    times, losses = [], []
    for _ in range(a.steps):
        dt, l = step()
        times.append(dt)
        losses.append(l)
    med = statistics.median(times)
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({
        "impl": "torch-compile" if a.compile else "torch-eager", "precision": a.precision,
        "first_step_s": round(first_s, 3),
        "clip": a.clip, "torch_version": torch.__version__, "threads": a.threads,
        "config": "S", "model": a.model, "experts": a.experts, "top_k": a.top_k, "shared": a.shared, "batch": B, "T": T, "params": sum(p.numel() for p in model.parameters()),
        "warmup": a.warmup, "steps": a.steps, "median_step_s": round(med, 6),
        "tokens_per_s": round(B * T / med, 1), "step_s": [round(t, 6) for t in times],
        "first_loss": round(losses[0], 5), "last_loss": round(losses[-1], 5),
        "peak_rss_mib": round(rss_kb / 1024.0, 1),
    }))


if __name__ == "__main__":
    main()

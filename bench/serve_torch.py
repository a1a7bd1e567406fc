"""The PyTorch peer of bench/serve.sh: an eager generate loop with a KV cache over the
PyTorch reference model (tests/reference/gpt_ref.py) holding the same weights as a kiln
checkpoint. Prints one JSON line: time to first token (prefill + first sample) and
single-stream decode tokens/s, medians over --reps runs after a warm-up.

  /usr/bin/python3 bench/serve_torch.py RUN_DIR/model.safetensors [--prompt-len 64] [--tokens 128]
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "reference"))
import gpt_ref  # noqa: E402


def load(path):
    t, meta = gpt_ref.load_safetensors(path)
    cfg = gpt_ref.gpt2_config()
    cfg.update(json.loads(meta["config"]))
    m = gpt_ref.GPT(cfg)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(t[name])
    return m.eval(), cfg


class Cache:
    def __init__(self, cfg, T):
        hs = cfg["n_embd"] // cfg["n_head"]
        shape = (1, cfg["n_kv_head"], T, hs)
        self.k = [torch.zeros(shape) for _ in range(cfg["n_layer"])]
        self.v = [torch.zeros(shape) for _ in range(cfg["n_layer"])]
        self.cos, self.sin = gpt_ref.rope_tables(T, hs, cfg["rope_theta"])


def step(m, cfg, cache, idx, pos0):
    """Logits of the last position for idx (1, T) at positions pos0.. (the cache grows)."""
    T = idx.shape[1]
    x = m.tok_emb(idx)
    if m.pos_emb is not None:
        x = x + m.pos_emb.weight[pos0:pos0 + T]
    for i, blk in enumerate(m.blocks):
        a = blk.attn
        H, Hk, hs = a.H, a.Hk, a.hs
        q, k, v = a.qkv(blk.norm1(x)).split([H * hs, Hk * hs, Hk * hs], dim=-1)
        q = q.view(1, T, H, hs).transpose(1, 2)
        k = k.view(1, T, Hk, hs).transpose(1, 2)
        v = v.view(1, T, Hk, hs).transpose(1, 2)
        if a.rope:
            cos, sin = cache.cos[pos0:pos0 + T], cache.sin[pos0:pos0 + T]
            q, k = gpt_ref.apply_rope(q, cos, sin), gpt_ref.apply_rope(k, cos, sin)
        cache.k[i][:, :, pos0:pos0 + T] = k
        cache.v[i][:, :, pos0:pos0 + T] = v
        K, V = cache.k[i][:, :, :pos0 + T], cache.v[i][:, :, :pos0 + T]
        if Hk != H:
            K = K.repeat_interleave(H // Hk, dim=1)
            V = V.repeat_interleave(H // Hk, dim=1)
        att = (q @ K.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        if T > 1:
            mask = torch.ones(T, pos0 + T, dtype=torch.bool).tril(pos0)
            att = att.masked_fill(~mask, float("-inf"))
        y = (torch.softmax(att, dim=-1) @ V).transpose(1, 2).reshape(1, T, -1)
        x = x + a.proj(y)
        x = x + blk.mlp(blk.norm2(x))
    x = m.norm_f(x[:, -1:])
    W = m.tok_emb.weight if m.lm_head is None else m.lm_head.weight
    return (x @ W.t())[0, -1]


def generate(m, cfg, prompt, n, temperature, gen):
    cache = Cache(cfg, len(prompt) + n)
    t0 = time.perf_counter()
    logits = step(m, cfg, cache, torch.tensor([prompt]), 0)
    out = []
    pos = len(prompt)
    t_first = None
    for i in range(n):
        probs = F.softmax(logits / temperature, dim=-1)
        tok = int(torch.multinomial(probs, 1, generator=gen))
        out.append(tok)
        if i == 0:
            t_first = time.perf_counter()
        if i + 1 < n:
            logits = step(m, cfg, cache, torch.tensor([[tok]]), pos)
            pos += 1
    t_end = time.perf_counter()
    return out, t_first - t0, (n - 1) / (t_end - t_first)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    m, cfg = load(a.model)
    prompt = [(i * 37 + 11) % cfg["vocab_size"] for i in range(a.prompt_len)]
    gen = torch.Generator().manual_seed(1)
    ttft, tps = [], []
    with torch.inference_mode():
        generate(m, cfg, prompt, 8, 0.8, gen)  # warm-up
        for _ in range(a.reps):
            _, t1, r = generate(m, cfg, prompt, a.tokens, 0.8, gen)
            ttft.append(t1)
            tps.append(r)
    print(json.dumps({"peer": "pytorch", "torch": torch.__version__, "threads": a.threads,
                      "prompt_len": a.prompt_len, "tokens": a.tokens, "ttft_ms": 1e3 * statistics.median(ttft),
                      "decode_tok_s": statistics.median(tps)}))


if __name__ == "__main__":
    main()

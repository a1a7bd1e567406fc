#!/usr/bin/env python3
"""A tiny Qwen3 model folder with random weights and its logits: the oracle of kiln's
Qwen3 import (tests/test_hf.c, qwen3_matches_reference).

    build/venv/bin/python tests/reference/qwen3_ref.py --out tests/reference/hf

needs numpy only. It writes OUT/qwen3/ as transformers' save_pretrained leaves a
Qwen3ForCausalLM (config.json of transformers 5, model.safetensors; tied embeddings, so
no lm_head.weight) and OUT/qwen3/expected.safetensors: `idx` (2, 12) I64 and `logits`
(2, 12, 256) F32, the forward computed here in float64 from the stored float32 weights,
written as transformers' modeling_qwen3.py computes it:

    x = embed_tokens[idx]
    per layer:  h = rmsnorm(x, input_layernorm)
                q, k, v = h Wq^T, h Wk^T, h Wv^T, as (T, heads, head_dim)
                q = rmsnorm(q, q_norm), k = rmsnorm(k, k_norm)   # per head, over head_dim
                q, k = rope(q), rope(k)                          # rotate_half, theta
                a = softmax(q k^T / sqrt(head_dim) + causal) v   # k, v repeated over the groups
                x = x + a Wo^T
                h = rmsnorm(x, post_attention_layernorm)
                x = x + (silu(h Wg^T) * (h Wu^T)) Wd^T
    logits = rmsnorm(x, norm) embed_tokens^T
    rmsnorm(x, w) = x / sqrt(mean(x^2) + eps) * w

Where torch and transformers are installed, tests/reference/hf_ref.py --only qwen3 makes
the same kind of folder with transformers itself as the oracle (its own random weights).
The norms' weights here are 1 + N(0, 0.1), not transformers' ones at init, so that a q
norm loaded as the k norm (or not at all) changes the logits.
"""
import argparse
import json
import os
import struct

import numpy as np

import byte_tokenizer

V, C, L, H, KV, F, T = 256, 32, 2, 4, 2, 80, 64
HD = C // H
EPS, THETA = 1e-6, 1000000.0


def save_safetensors(path, tensors):
    """tensors: name -> numpy array (float32 or int64), written in the order given."""
    header, blobs, at = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        dt = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}[a.dtype]
        b = a.astype(a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def rmsnorm(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * w


def rope(x, pos):  # x (T, heads, HD)
    inv = 1.0 / (THETA ** (np.arange(0, HD, 2, dtype=np.float64) / HD))
    ang = np.outer(pos, inv)  # (T, HD/2)
    cos = np.cos(np.concatenate([ang, ang], -1))[:, None, :]
    sin = np.sin(np.concatenate([ang, ang], -1))[:, None, :]
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return x * cos + np.concatenate([-x2, x1], -1) * sin


def forward(w, idx):
    Tn = len(idx)
    x = w["model.embed_tokens.weight"][idx]
    pos = np.arange(Tn, dtype=np.float64)
    mask = np.triu(np.full((Tn, Tn), -np.inf), 1)
    for i in range(L):
        p = f"model.layers.{i}."
        h = rmsnorm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(Tn, H, HD)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(Tn, KV, HD)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(Tn, KV, HD)
        q = rope(rmsnorm(q, w[p + "self_attn.q_norm.weight"]), pos)
        k = rope(rmsnorm(k, w[p + "self_attn.k_norm.weight"]), pos)
        out = np.zeros((Tn, H, HD))
        for hh in range(H):
            g = hh // (H // KV)
            s = q[:, hh, :] @ k[:, g, :].T / np.sqrt(HD) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, hh, :] = (s / s.sum(-1, keepdims=True)) @ v[:, g, :]
        x = x + out.reshape(Tn, H * HD) @ w[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return rmsnorm(x, w["model.norm.weight"]) @ w["model.embed_tokens.weight"].T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rng = np.random.default_rng(1234)
    shapes = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
                       p + "self_attn.q_proj.weight": (H * HD, C), p + "self_attn.k_proj.weight": (KV * HD, C),
                       p + "self_attn.v_proj.weight": (KV * HD, C), p + "self_attn.o_proj.weight": (C, H * HD),
                       p + "self_attn.q_norm.weight": (HD,), p + "self_attn.k_norm.weight": (HD,),
                       p + "mlp.gate_proj.weight": (F, C), p + "mlp.up_proj.weight": (F, C),
                       p + "mlp.down_proj.weight": (C, F)})
    w32 = {n: (1 + 0.1 * rng.standard_normal(s) if n.endswith("norm.weight") else 0.1 * rng.standard_normal(s))
           .astype(np.float32) for n, s in sorted(shapes.items())}
    idx = np.random.default_rng(7).integers(0, V, (2, 12)).astype(np.int64)
    w64 = {n: t.astype(np.float64) for n, t in w32.items()}
    logits = np.stack([forward(w64, row) for row in idx]).astype(np.float32)
    d = os.path.join(a.out, "qwen3")
    os.makedirs(d, exist_ok=True)
    config = {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None,
        "dtype": "float32", "eos_token_id": None, "head_dim": HD, "hidden_act": "silu", "hidden_size": C,
        "initializer_range": 0.1, "intermediate_size": F, "layer_types": ["full_attention"] * L,
        "max_position_embeddings": T, "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": H,
        "num_hidden_layers": L, "num_key_value_heads": KV, "pad_token_id": None, "rms_norm_eps": EPS,
        "rope_parameters": {"rope_theta": THETA, "rope_type": "default"}, "sliding_window": None,
        "tie_word_embeddings": True, "transformers_version": "5.25.0", "use_cache": True,
        "use_sliding_window": False, "vocab_size": V,
    }
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    save_safetensors(os.path.join(d, "model.safetensors"), w32)
    save_safetensors(os.path.join(d, "expected.safetensors"), {"idx": idx, "logits": logits})
    byte_tokenizer.write(d)
    print(f"qwen3: {sorted(os.listdir(d))}, logits |max| {np.abs(logits).max():.3f}")


if __name__ == "__main__":
    main()

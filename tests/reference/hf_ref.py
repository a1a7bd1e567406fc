#!/usr/bin/env python3
"""Tiny Hugging Face model folders with random weights, and transformers' logits on them:
the oracle of kiln's HF import (tests/test_hf.c).

    TORCH2/bin/python tests/reference/hf_ref.py --out tests/reference/hf

needs torch and transformers from PyPI (nothing is downloaded: each model is built from
a config with random weights, torch.manual_seed(1234), initializer_range 0.1 so that the
logits differ clearly). For each architecture it writes OUT/<name>/ as save_pretrained
leaves it (config.json and model.safetensors, or shards with their index), a byte-level
tokenizer.json (byte_tokenizer.py) and
OUT/<name>/expected.safetensors: `idx` (2, 12) I64 token ids and `logits` (2, 12, 256)
F32, the forward of the folder as saved, read back in float32 with eager attention (a
model stored in bf16 or f16 runs on its rounded weights widened to f32, as kiln holds
them). `--only NAME...` remakes those models and leaves the others as they are.
"""
import argparse
import json
import os
import shutil

import torch

import byte_tokenizer
from safetensors.torch import save_file

from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

V, C, L, H, KV, F, T = 256, 32, 2, 4, 2, 80, 64
COMMON = dict(vocab_size=V, hidden_size=C, num_hidden_layers=L, num_attention_heads=H, intermediate_size=F,
              max_position_embeddings=T, initializer_range=0.1)

MODELS = {
    # name: (model class, config, dtype stored, shard size or None)
    "llama": (LlamaForCausalLM, LlamaConfig(**COMMON, num_key_value_heads=KV, rms_norm_eps=1e-5, rope_theta=10000.0,
                                            tie_word_embeddings=False), torch.float32, None),
    "llama_tied_bf16": (LlamaForCausalLM, LlamaConfig(**COMMON, num_key_value_heads=KV, rms_norm_eps=1e-6,
                                                      rope_theta=500000.0, tie_word_embeddings=True),
                        torch.bfloat16, None),
    # LLaMA 3.1's rope scaling, with head size 8 and theta 100 so that its three bands
    # (kept, blended, divided) each hold a frequency; and linear scaling
    "llama31_scaled": (LlamaForCausalLM, LlamaConfig(**COMMON, num_key_value_heads=KV, rms_norm_eps=1e-5,
                                                     rope_theta=100.0, tie_word_embeddings=False,
                                                     rope_scaling={"rope_type": "llama3", "factor": 4.0,
                                                                   "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                                                                   "original_max_position_embeddings": 64}),
                       torch.float32, None),
    "qwen2_linear": (Qwen2ForCausalLM, Qwen2Config(**COMMON, num_key_value_heads=KV, tie_word_embeddings=False,
                                                   use_sliding_window=False, rope_theta=1000.0,
                                                   rope_scaling={"rope_type": "linear", "factor": 3.0}),
                     torch.float32, None),
    "mistral_sharded_f16": (MistralForCausalLM, MistralConfig(**COMMON, num_key_value_heads=KV, sliding_window=32,
                                                              tie_word_embeddings=False), torch.float16, "40KB"),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**COMMON, num_key_value_heads=KV, tie_word_embeddings=False,
                                            use_sliding_window=False), torch.float32, None),
    # q/k norms (each head's query and key RMS-normed before RoPE), tied embeddings;
    # tests/reference/qwen3_ref.py makes this folder with a numpy oracle where torch is
    # not installed
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**COMMON, num_key_value_heads=KV, head_dim=C // H, rms_norm_eps=1e-6,
                                            rope_theta=1000000.0, tie_word_embeddings=True,
                                            use_sliding_window=False), torch.float32, None),
    "gpt2": (GPT2LMHeadModel, GPT2Config(vocab_size=V, n_embd=C, n_layer=L, n_head=H, n_positions=T, n_inner=F,
                                         activation_function="gelu_new", initializer_range=0.1, bos_token_id=0,
                                         eos_token_id=0), torch.float32, None),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*", help="make these models only (the others are left as they are)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    for name, (cls, cfg, dtype, shard) in MODELS.items():
        if a.only and name not in a.only:
            continue
        torch.manual_seed(1234)
        cfg._attn_implementation = "eager"
        model = cls(cfg).eval()
        with torch.no_grad():  # biases are zero and q/k norms one at init: make them count
            for n, p in model.named_parameters():
                if n.endswith(".bias"):
                    p.normal_(0, 0.1)
                if n.endswith("q_norm.weight") or n.endswith("k_norm.weight"):
                    p.normal_(1, 0.1)
        model = model.to(dtype)
        d = os.path.join(a.out, name)
        shutil.rmtree(d, ignore_errors=True)
        kw = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(d, safe_serialization=True, **kw)
        byte_tokenizer.write(d)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(d, extra)):
                os.remove(os.path.join(d, extra))
        g = torch.Generator().manual_seed(7)
        idx = torch.randint(0, V, (2, 12), generator=g)
        # the folder as saved, read back in float32 (the rotary frequencies made afresh in
        # float32, not the ones the 16-bit model rounded)
        ref = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            logits = ref(idx).logits.float().contiguous()
        save_file({"idx": idx, "logits": logits}, os.path.join(d, "expected.safetensors"))
        files = sorted(os.listdir(d))
        print(f"{name}: {files}, logits |max| {logits.abs().max().item():.3f}")
        with open(os.path.join(d, "config.json")) as f:
            json.load(f)


if __name__ == "__main__":
    main()

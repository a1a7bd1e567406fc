#!/usr/bin/env python3
"""kiln's GGUF exports read by llama.cpp's own Python reader (the `gguf` package from
PyPI, gguf-py of the llama.cpp project, in build/venv): the oracle for the file's layout
and values, where tests/test_hf.c checks them with a reader of kiln's own. For the tiny
golden models of tests/reference/hf/ (made by transformers), `kiln import hf` then `kiln
export gguf` in each type, and:

- the header keys llama.cpp's loader needs, with the model's values;
- every tensor, dequantized by gguf-py (`gguf.quants.dequantize`), against the Hugging
  Face weights it came from (the safetensors files read here), after the row permutation
  llama.cpp's converter applies to q and k (its rope pairs adjacent values): f32 exactly,
  bf16 and f16 within their rounding (2^-8 and 2^-11 relative), q8_0 within 0.6 of each
  block's scale (max |x| / 127: half a step and the f16 scale's rounding);
- LLaMA 3.1's rope scaling as `rope_freqs.weight`, against the rule written out here;
- a SentencePiece-style tokenizer (built here by `tokenizers`, LLaMA-2's layout) as the
  "llama" vocabulary: token types, scores ranking the merges, the special ids.

Exits 77 (skip, never a pass) when gguf (with numpy) or tokenizers is missing.
    python tests/gguf/test_gguf_reader.py --kiln build/kiln --src . --workdir DIR
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys

try:
    import numpy as np
    import gguf
    from gguf.quants import dequantize
    import tokenizers  # noqa: F401 (before the import below, which would exit 77 without it)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tokenizer"))
    from test_hf_tokenizers import llama2_shape, sp_merges, sp_tokenizer  # the LLaMA-2-style builder, shared
except ImportError as e:
    print(f"skip: {e.name} is not installed (run scripts/install-test-deps.sh)")
    sys.exit(77)

failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def run(*args):
    r = subprocess.run(list(args), capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"{' '.join(args)} failed: {r.stderr.strip()}")


def field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        return [f.parts[i] for i in f.data]
    return f.parts[f.data[0]][0]


def tensors(reader):
    out = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # gguf lists dims innermost first
        out[t.name] = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
    return out


def permute(w, n_head):
    """llama.cpp's converter: each head's two halves interleaved (rope on adjacent pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_safetensors(path):
    """A safetensors file as float32 arrays (numpy has no bf16: its bits are widened here)."""
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b = data[e["data_offsets"][0]:e["data_offsets"][1]]
        if e["dtype"] == "BF16":
            a = (np.frombuffer(b, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            a = np.frombuffer(b, {"F32": np.float32, "F16": np.float16}[e["dtype"]]).astype(np.float32)
        out[name] = a.reshape(e["shape"])
    return out


def hf_weights(folder):
    w = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors") and f != "expected.safetensors":
            w.update(read_safetensors(os.path.join(folder, f)))
    return w


def within(got, want, dtype):
    if dtype == "f32":
        return float(np.abs(got - want).max()) == 0.0
    if dtype in ("bf16", "f16"):
        rel = 2.0 ** -8 if dtype == "bf16" else 2.0 ** -11
        return bool((np.abs(got - want) <= rel * np.abs(want) + 1e-7).all())
    blocks = want.reshape(-1, 32)  # q8_0
    scale = np.abs(blocks).max(axis=1, keepdims=True) / 127
    return bool((np.abs(got.reshape(-1, 32) - blocks) <= 0.6 * scale + 1e-9).all())


def llama_case(args, name, dtype):
    folder = os.path.join(args.src, "tests/reference/hf", name)
    cfg = json.load(open(os.path.join(folder, "config.json")))
    run_dir = os.path.join(args.workdir, f"{name}-run")
    if not os.path.isdir(run_dir):
        run(args.kiln, "import", "hf", folder, run_dir)
    path = os.path.join(args.workdir, f"{name}-{dtype}.gguf")
    run(args.kiln, "export", "gguf", run_dir, path, "--dtype", dtype)
    r = gguf.GGUFReader(path)
    tag = f"{name} {dtype}"
    check(field(r, "general.architecture") == "llama", f"{tag}: architecture llama")
    for key, want in (("llama.block_count", cfg["num_hidden_layers"]), ("llama.embedding_length", cfg["hidden_size"]),
                      ("llama.attention.head_count", cfg["num_attention_heads"]),
                      ("llama.attention.head_count_kv", cfg["num_key_value_heads"]),
                      ("llama.feed_forward_length", cfg["intermediate_size"])):
        check(field(r, key) == want, f"{tag}: {key} = {want} (file: {field(r, key)})")
    theta = cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta"))
    check(math.isclose(float(field(r, "llama.rope.freq_base")), theta, rel_tol=1e-6), f"{tag}: rope.freq_base {theta}")
    got, hf = tensors(r), hf_weights(folder)
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    pairs = [("token_embd.weight", hf["model.embed_tokens.weight"]), ("output_norm.weight", hf["model.norm.weight"])]
    if "lm_head.weight" in hf and not cfg.get("tie_word_embeddings"):
        pairs.append(("output.weight", hf["lm_head.weight"]))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        pairs += [(f"blk.{i}.attn_q.weight", permute(hf[p + "self_attn.q_proj.weight"], H)),
                  (f"blk.{i}.attn_k.weight", permute(hf[p + "self_attn.k_proj.weight"], KV)),
                  (f"blk.{i}.attn_v.weight", hf[p + "self_attn.v_proj.weight"]),
                  (f"blk.{i}.attn_output.weight", hf[p + "self_attn.o_proj.weight"]),
                  (f"blk.{i}.ffn_gate.weight", hf[p + "mlp.gate_proj.weight"]),
                  (f"blk.{i}.ffn_up.weight", hf[p + "mlp.up_proj.weight"]),
                  (f"blk.{i}.ffn_down.weight", hf[p + "mlp.down_proj.weight"]),
                  (f"blk.{i}.attn_norm.weight", hf[p + "input_layernorm.weight"]),
                  (f"blk.{i}.ffn_norm.weight", hf[p + "post_attention_layernorm.weight"])]
    bad = [n for n, want in pairs if n not in got or got[n].shape != want.shape or
           not within(got[n], want, dtype if want.ndim == 2 and (dtype != "q8_0" or want.shape[1] % 32 == 0) else "f32")]
    check(not bad, f"{tag}: {len(pairs)} tensors equal the HF weights as llama.cpp's converter lays them out"
          + (f" (wrong: {bad[:4]})" if bad else ""))
    rs = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rs.get("rope_type") == "llama3":
        D = cfg["hidden_size"] // H
        want = []
        for i in range(D // 2):
            f = theta ** (-2 * i / D)
            wl, ctx = 2 * math.pi / f, rs["original_max_position_embeddings"]
            lo, hi = ctx / rs["low_freq_factor"], ctx / rs["high_freq_factor"]
            s = (ctx / wl - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])
            want.append(1.0 if wl < hi else rs["factor"] if wl > lo else 1 / ((1 - s) / rs["factor"] + s))
        ok = "rope_freqs.weight" in got and np.allclose(got["rope_freqs.weight"], want, rtol=1e-5)
        check(ok, f"{tag}: rope_freqs.weight = {np.round(want, 4).tolist()}")


def sentencepiece_case(args):
    # a made-up corpus (nothing downloaded): words, punctuation, accents and CJK
    import random
    r = random.Random(5)
    words = ("in the beginning god created heaven and earth was without form void darkness upon face of deep "
             "Ça très déjà über 日本語 東京 hello world 123 4567").split()
    text = "\n".join(" ".join(r.choice(words) for _ in range(12)) + r.choice([".", ",", "!", "?"]) for _ in range(3000))
    names, merges = sp_merges(text, 300)
    tok, vocab = sp_tokenizer(names, merges)
    llama2_shape(tok)
    tp, corpus = os.path.join(args.workdir, "sp.json"), os.path.join(args.workdir, "sp.txt")
    tok.save(tp)
    open(corpus, "w", encoding="utf-8").write(text[:20000])
    run_dir, path = os.path.join(args.workdir, "sp-run"), os.path.join(args.workdir, "sp.gguf")
    run(args.kiln, "train", "--data", corpus, "--tokenizer", tp, "--out", run_dir, "--arch", "llama", "--layers", "1",
        "--width", "32", "--heads", "2", "--context", "16", "--batch", "2", "--steps", "1", "--quiet")
    run(args.kiln, "export", "gguf", run_dir, path)
    r = gguf.GGUFReader(path)
    check(field(r, "tokenizer.ggml.model") == "llama", "sentencepiece: tokenizer.ggml.model llama")
    tokens = [bytes(x).decode() for x in field(r, "tokenizer.ggml.tokens")]
    check(tokens == [tok.id_to_token(i) for i in range(tok.get_vocab_size())], f"sentencepiece: {len(tokens)} tokens in id order")
    types = [int(x[0]) for x in field(r, "tokenizer.ggml.token_type")]
    want_types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    check(types == want_types, "sentencepiece: types (<unk> 2, <s> </s> 3, bytes 6, the rest 1)")
    scores = [float(x[0]) for x in field(r, "tokenizer.ggml.scores")]
    rank = {}
    for i, (a, b) in enumerate(merges):
        rank.setdefault(vocab[a + b], i)
    ok = all(scores[t] == -r for t, r in rank.items()) and all(
        scores[t] < -len(merges) + 1 for t in range(len(tokens)) if t not in rank)
    check(ok, f"sentencepiece: {len(rank)} merged tokens score minus their merge's rank, the rest lower")
    for key, want in (("tokenizer.ggml.bos_token_id", 1), ("tokenizer.ggml.eos_token_id", 2),
                      ("tokenizer.ggml.unknown_token_id", 0), ("tokenizer.ggml.add_space_prefix", True)):
        check(field(r, key) == want, f"sentencepiece: {key} = {want}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    for dtype in ("f32", "bf16", "f16", "q8_0"):
        llama_case(args, "llama", dtype)
    llama_case(args, "llama_tied_bf16", "f32")
    llama_case(args, "llama31_scaled", "f32")
    sentencepiece_case(args)
    print(f"{len(failures)} failed" if failures else "all checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

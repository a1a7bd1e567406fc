#!/usr/bin/env python3
"""GGUF files as kiln models (kiln_gguf_load through kiln_model_load; issue 47 item 1).

The files are written here, not by kiln: the Hugging Face reference folders
(tests/reference/hf/, random weights, transformers' float32 logits beside them) converted
the way llama.cpp's convert_hf_to_gguf.py lays them out, with llama.cpp's own `gguf`
package (PyPI, in build/venv): the architecture's keys, the tensor names, q and k rows
interleaved per head for the llama architecture (its rope rotates adjacent pairs),
GPT-2's Conv1D weights transposed, LLaMA 3.1's scaling as rope_freqs.weight, and the
byte-level vocabulary as tokenizer.ggml.* with a chat template. Then:

- each family (llama, llama tied in bf16, llama 3.1 scaled, qwen2 with q/k/v biases,
  qwen3 with q/k norms, gpt2) in F32: kiln's logits within 1e-5 of transformers' (the
  tolerance tests/test_hf.c holds the folders to);
- the llama folder in F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 (tensors whose rows
  the blocks do not divide stay F32, as llama.cpp's quantizer leaves them): kiln's logits
  bit for bit those of an F32 twin file holding the gguf package's dequantization of the
  same tensors (the dequantization itself is checked bit for bit by test_gguf_read.py);
- with llama-cpp-python installed, llama.cpp's own logits on the F32 llama file within
  1e-4 of kiln's (reported as not run otherwise: never counted as a pass);
- the kiln program on a .gguf: sample (greedy text equal to sample on the HF folder),
  info, import gguf to a run folder that samples the same, serve answering a completion,
  train --init for two steps; and files refused by name: another architecture, a tensor
  missing, a tensor with no place, a head size of its own, a mixture of experts.
Exits 77 (skip, never a pass) without numpy and gguf.
    python tests/gguf/test_gguf_load.py --logits build/gguf_logits --kiln build/kiln --src . --workdir DIR
"""
import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

try:
    import numpy as np
    import gguf
    from gguf import GGMLQuantizationType as Q
except ImportError:
    print("skip: numpy and gguf are not installed (run scripts/install-test-deps.sh)")
    sys.exit(77)

passed = failed = 0


def check(ok, what):
    global passed, failed
    passed += bool(ok)
    failed += not ok
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    return ok


def read_safetensors(path):
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
        elif e["dtype"] == "I64":
            a = np.frombuffer(b, np.int64)
        else:
            a = np.frombuffer(b, {"F32": np.float32, "F16": np.float16}[e["dtype"]]).astype(np.float32)
        out[name] = a.reshape(e["shape"])
    return out


def hf_weights(folder):
    w = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors") and f != "expected.safetensors":
            w.update(read_safetensors(os.path.join(folder, f)))
    return {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in w.items()}


def permute(w, n_head):
    """llama.cpp's converter: each head's two halves interleaved (rope on adjacent pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_vocab():
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        out.append(chr(b) if b in keep else chr(256 + extra))
        extra += b not in keep
    return out


def convert(folder, arch):
    """(keys, tensors) of the folder as llama.cpp's converter writes it: keys as
    (name, value, type), tensors as name -> float32 array in kiln's (numpy's) order."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    w = hf_weights(folder)
    V = gguf.GGUFValueType
    T = {}
    if arch == "gpt2":
        C, L, H = cfg["n_embd"], cfg["n_layer"], cfg["n_head"]
        keys = [("context_length", cfg["n_positions"], V.UINT32), ("embedding_length", C, V.UINT32),
                ("feed_forward_length", cfg["n_inner"], V.UINT32), ("block_count", L, V.UINT32),
                ("attention.head_count", H, V.UINT32),
                ("attention.layer_norm_epsilon", cfg["layer_norm_epsilon"], V.FLOAT32)]
        T["token_embd.weight"], T["position_embd.weight"] = w["wte.weight"], w["wpe.weight"]
        T["output_norm.weight"], T["output_norm.bias"] = w["ln_f.weight"], w["ln_f.bias"]
        for i in range(L):
            p = f"h.{i}."
            for g, h in (("attn_norm", "ln_1"), ("ffn_norm", "ln_2")):
                T[f"blk.{i}.{g}.weight"], T[f"blk.{i}.{g}.bias"] = w[p + h + ".weight"], w[p + h + ".bias"]
            for g, h in (("attn_qkv", "attn.c_attn"), ("attn_output", "attn.c_proj"), ("ffn_up", "mlp.c_fc"),
                         ("ffn_down", "mlp.c_proj")):
                T[f"blk.{i}.{g}.weight"] = np.ascontiguousarray(w[p + h + ".weight"].T)  # Conv1D is (in, out)
                T[f"blk.{i}.{g}.bias"] = w[p + h + ".bias"]
        return keys, T
    C, L, H, KV = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rp = cfg.get("rope_parameters") or {}
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    keys = [("context_length", cfg["max_position_embeddings"], V.UINT32), ("embedding_length", C, V.UINT32),
            ("feed_forward_length", cfg["intermediate_size"], V.UINT32), ("block_count", L, V.UINT32),
            ("attention.head_count", H, V.UINT32), ("attention.head_count_kv", KV, V.UINT32),
            ("rope.freq_base", float(theta), V.FLOAT32), ("rope.dimension_count", C // H, V.UINT32),
            ("attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"], V.FLOAT32)]
    T["token_embd.weight"], T["output_norm.weight"] = w["model.embed_tokens.weight"], w["model.norm.weight"]
    if not cfg.get("tie_word_embeddings"):
        T["output.weight"] = w["lm_head.weight"]
    pair = arch == "llama"
    for i in range(L):
        p = f"model.layers.{i}."
        q, k = w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"]
        T[f"blk.{i}.attn_q.weight"] = permute(q, H) if pair else q
        T[f"blk.{i}.attn_k.weight"] = permute(k, KV) if pair else k
        T[f"blk.{i}.attn_v.weight"] = w[p + "self_attn.v_proj.weight"]
        for c in "qkv":
            if p + f"self_attn.{c}_proj.bias" in w:
                T[f"blk.{i}.attn_{c}.bias"] = w[p + f"self_attn.{c}_proj.bias"]
        if arch == "qwen3":
            T[f"blk.{i}.attn_q_norm.weight"] = w[p + "self_attn.q_norm.weight"]
            T[f"blk.{i}.attn_k_norm.weight"] = w[p + "self_attn.k_norm.weight"]
        T[f"blk.{i}.attn_output.weight"] = w[p + "self_attn.o_proj.weight"]
        T[f"blk.{i}.ffn_gate.weight"] = w[p + "mlp.gate_proj.weight"]
        T[f"blk.{i}.ffn_up.weight"] = w[p + "mlp.up_proj.weight"]
        T[f"blk.{i}.ffn_down.weight"] = w[p + "mlp.down_proj.weight"]
        T[f"blk.{i}.attn_norm.weight"] = w[p + "input_layernorm.weight"]
        T[f"blk.{i}.ffn_norm.weight"] = w[p + "post_attention_layernorm.weight"]
    rs = rp if rp.get("rope_type") == "llama3" else cfg.get("rope_scaling") or {}
    if rs.get("rope_type") == "llama3":  # LLaMA 3.1: each frequency's divisor, as llama.cpp's converter computes it
        D, want = C // H, []
        for i in range(D // 2):
            f = theta ** (-2 * i / D)
            wl, ctx = 2 * math.pi / f, rs["original_max_position_embeddings"]
            lo, hi = ctx / rs["low_freq_factor"], ctx / rs["high_freq_factor"]
            s = (ctx / wl - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])
            want.append(1.0 if wl < hi else rs["factor"] if wl > lo else 1 / ((1 - s) / rs["factor"] + s))
        T["rope_freqs.weight"] = np.array(want, dtype=np.float32)
    return keys, T


# ChatML, as Qwen's files carry it (kiln serve takes it by its family until it runs Jinja itself)
TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write(path, arch, keys, tensors, qtype=Q.F32, twin_of=None, extra_keys=(), spm=False, template=TEMPLATE):
    """The file; quantized matrices in qtype where the blocks divide their rows (the rest
    F32, as llama.cpp's quantizer leaves them). twin_of: the F32 file of the same
    tensors as the gguf package dequantizes qtype's blocks."""
    w = gguf.GGUFWriter(path, arch)
    for k, v, t in keys:
        w.add_key_value(f"{arch}.{k}", v, t)
    for k, v, t in extra_keys:
        w.add_key_value(k, v, t)
    if spm:  # SentencePiece's form of a byte vocabulary: token b is "<0xBB>", typed BYTE (what llama.cpp loads
        # without merges, which the gguf package cannot write empty)
        w.add_tokenizer_model("llama")
        w.add_token_list([f"<0x{b:02X}>" for b in range(256)])
        w.add_token_types([6] * 256)
        w.add_token_scores([0.0] * 256)
        w.add_add_space_prefix(False)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(byte_vocab())
        w.add_token_types([1] * 256)
    w.add_chat_template(template)
    twin = {}
    for name, a in tensors.items():
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        if qtype != Q.F32 and a.ndim == 2 and a.shape[-1] % block == 0:
            raw = gguf.quants.quantize(a.astype(np.float32), qtype)
            w.add_tensor(name, raw, raw_dtype=qtype)
            twin[name] = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(a.shape)
        else:
            w.add_tensor(name, a.astype(np.float32))
            twin[name] = a.astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return twin


def logits(a, model, expected):
    out = os.path.join(a.workdir, "logits.f32")
    if os.path.exists(out):
        os.remove(out)
    r = subprocess.run([a.logits, model, expected, out], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return None, r.stderr.strip()
    return np.fromfile(out, dtype=np.float32), r.stdout


FAMILIES = [("llama", "llama"), ("llama_tied_bf16", "llama"), ("llama31_scaled", "llama"), ("qwen2", "qwen2"),
            ("qwen3", "qwen3"), ("gpt2", "gpt2")]


def check_families(a):
    for name, arch in FAMILIES:
        folder = os.path.join(a.src, "tests/reference/hf", name)
        keys, T = convert(folder, arch)
        path = os.path.join(a.workdir, f"{name}.gguf")
        write(path, arch, keys, T)
        exp = os.path.join(folder, "expected.safetensors")
        want = read_safetensors(exp)["logits"].reshape(-1)
        got, out = logits(a, path, exp)
        worst = float(np.abs(got - want).max()) if got is not None and got.shape == want.shape else float("nan")
        check(got is not None and worst <= 1e-5 and "chat_template " + TEMPLATE in out,
              f"{name} as a {arch} GGUF file: kiln's logits within 1e-5 of transformers' (max {worst:.3g}), the "
              f"chat template read{'' if got is not None else ': ' + out}")


def check_types(a):
    folder = os.path.join(a.src, "tests/reference/hf/llama")
    keys, T = convert(folder, "llama")
    exp = os.path.join(folder, "expected.safetensors")
    for qt in (Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        path = os.path.join(a.workdir, f"llama-{qt.name}.gguf")
        twin = write(path, "llama", keys, T, qt)
        twin_path = os.path.join(a.workdir, f"llama-{qt.name}-twin.gguf")
        write(twin_path, "llama", keys, twin)
        got, err = logits(a, path, exp)
        want, err2 = logits(a, twin_path, exp)
        same = got is not None and want is not None and got.shape == want.shape and \
            (got.view(np.uint32) == want.view(np.uint32)).all()
        ref = read_safetensors(exp)["logits"].reshape(-1)
        drift = float(np.abs(got - ref).max()) if got is not None else float("nan")
        check(same, f"llama in {qt.name}: kiln's logits bit for bit those of its F32 twin (gguf's dequantization); "
                    f"{drift:.3g} from the f32 model's {'' if got is not None else err}{'' if want is not None else err2}")


def check_llama_cpp(a):
    try:
        from llama_cpp import Llama
    except ImportError:
        print("not run: llama.cpp's logits (llama-cpp-python is not installed; this check is not counted)")
        return
    folder = os.path.join(a.src, "tests/reference/hf/llama")
    path = os.path.join(a.workdir, "llama-spm.gguf")
    keys, T = convert(folder, "llama")
    write(path, "llama", keys, T, spm=True)
    exp = os.path.join(folder, "expected.safetensors")
    mine, err = logits(a, path, exp)
    if not check(mine is not None, f"the llama file with a SentencePiece byte vocabulary loads in kiln ({err})"):
        return
    idx = read_safetensors(exp)["idx"]
    worst = 0.0
    for row in range(idx.shape[0]):
        llm = Llama(model_path=path, n_ctx=64, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
        ids = [int(t) for t in idx[row]]
        llm.eval(ids)
        got = np.array(llm.scores[: len(ids)], dtype=np.float32).reshape(-1)
        part = mine.reshape(idx.shape[0], -1)[row]
        worst = max(worst, float(np.abs(got - part).max()))
        del llm
    check(worst <= 1e-4, f"llama.cpp's logits on the F32 llama file within 1e-4 of kiln's (max {worst:.3g})")


def kiln(a, *args, timeout=300):
    """The kiln program's result, its output decoded leniently (a random model's text is
    not UTF-8)."""
    return subprocess.run([a.kiln, *args], capture_output=True, text=True, errors="replace", timeout=timeout)


class Served:
    """kiln serve on a free port for `with`: .port (None if it never said it listens),
    .post(path, body) the decoded JSON answer."""

    def __init__(self, a, path):
        self.p = subprocess.Popen([a.kiln, "serve", path, "--port", "0", "--no-log-requests"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.port, deadline = None, time.time() + 120
        while time.time() < deadline and self.port is None:
            line = self.p.stderr.readline()
            if not line:
                break
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            self.port = int(m.group(1)) if m else None

    def post(self, path, body):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=60).read())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.p.terminate()
        self.p.wait(30)


def check_cli(a):
    folder = os.path.join(a.src, "tests/reference/hf/llama")
    path = os.path.join(a.workdir, "llama.gguf")
    greedy = ["--prompt", "Hello", "--max-tokens", "12", "--temperature", "0"]
    r1, r2 = kiln(a, "sample", path, *greedy), kiln(a, "sample", folder, *greedy)
    check(r1.returncode == 0 and r1.stdout == r2.stdout and r1.stdout.startswith("Hello"),
          f"kiln sample FILE.gguf gives the greedy text of the Hugging Face folder ({r1.stderr.strip()})")
    run = os.path.join(a.workdir, "imported")
    shutil.rmtree(run, ignore_errors=True)
    r = kiln(a, "import", "gguf", path, run)
    r3 = kiln(a, "sample", run, *greedy)
    check(r.returncode == 0 and r3.returncode == 0 and r3.stdout == r1.stdout,
          f"kiln import gguf writes a run folder that samples the same ({r.stderr.strip()}{r3.stderr.strip()})")
    text = os.path.join(a.workdir, "text.txt")
    with open(text, "w") as f:
        f.write("In the beginning was the word, and the word was with the model. " * 60)
    tr = os.path.join(a.workdir, "tuned")
    shutil.rmtree(tr, ignore_errors=True)
    r = kiln(a, "train", "--init", path, "--data", text, "--steps", "2", "--batch", "2", "--context", "32",
             "--out", tr, "--quiet")
    check(r.returncode == 0 and os.path.exists(os.path.join(tr, "model.safetensors")),
          f"kiln train --init FILE.gguf trains from it ({r.stderr.strip()[-300:]})")
    answer, chat = None, None
    with Served(a, path) as srv:
        if srv.port:
            answer = srv.post("/v1/completions", {"prompt": "Hello", "max_tokens": 5})
            chat = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})
    check(answer is not None and answer["usage"]["completion_tokens"] >= 1 and answer["model"] == "llama",
          f"kiln serve FILE.gguf answers a completion, as model 'llama' ({answer})")
    # ChatML's prompt of one user turn: <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n, in bytes
    check(answer is not None and chat["usage"]["prompt_tokens"] == len("<|im_start|>user\nHi<|im_end|>\n"
                                                                       "<|im_start|>assistant\n"),
          f"and a chat completion through the file's (ChatML) template ({chat if answer else None})")
    keys, T = convert(folder, "llama")
    odd = os.path.join(a.workdir, "odd-template.gguf")
    write(odd, "llama", keys, T, template="{{ messages[0].content }}!")
    r = kiln(a, "serve", odd, "--port", "0", timeout=60)
    check(r.returncode == 1 and "chat template is none of the families" in r.stderr and "--chat-template" in r.stderr,
          f"kiln serve refuses a file whose Jinja template it cannot render, naming --chat-template ({r.stderr.strip()})")


def check_quantize(a):
    """kiln quantize writes each matrix as the gguf package (ggml's reference quantizers)
    quantizes it, byte for byte, in the layout of llama.cpp's converter; the file loads
    in kiln with logits bit for bit those of the gguf package's own file of the type."""
    folder = os.path.join(a.src, "tests/reference/hf/llama")
    keys, T = convert(folder, "llama")
    exp = os.path.join(folder, "expected.safetensors")
    for qt in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.F16, Q.BF16):
        path = os.path.join(a.workdir, f"kiln-{qt.name}.gguf")
        r = kiln(a, "quantize", folder, path, "--type", qt.name.lower())
        if not check(r.returncode == 0, f"kiln quantize --type {qt.name.lower()} ({r.stderr.strip()})"):
            continue
        block = gguf.GGML_QUANT_SIZES[qt][0]
        bad = []
        for t in gguf.GGUFReader(path).tensors:
            want = T[t.name]
            quantized = want.ndim == 2 and want.shape[-1] % block == 0
            got_type = t.tensor_type
            raw = np.asarray(t.data).tobytes()
            expect = gguf.quants.quantize(want, qt).tobytes() if quantized else want.astype(np.float32).tobytes()
            if got_type != (qt if quantized else Q.F32) or raw != expect:
                bad.append(t.name)
        ours, _ = logits(a, path, exp)
        theirs_path = os.path.join(a.workdir, f"llama-{qt.name}.gguf")
        theirs, _ = logits(a, theirs_path, exp)
        same = ours is not None and theirs is not None and (ours.view(np.uint32) == theirs.view(np.uint32)).all()
        check(not bad and same, f"{qt.name}: every tensor byte for byte the gguf package's quantization in the "
                                f"converter's layout, logits those of the package's file{' (differ: ' + str(bad[:3]) + ')' if bad else ''}")
    r = kiln(a, "quantize", folder, os.path.join(a.workdir, "k.gguf"), "--type", "Q4_K_M")
    check(r.returncode == 2 and "llama.cpp's spelling is q4_K_M" in r.stderr,
          f"--type Q4_K_M is refused, naming the spelling ({r.stderr.strip()})")
    r = kiln(a, "quantize", folder, os.path.join(a.workdir, "k.gguf"), "--type", "q2_K")
    check(r.returncode == 2 and "not one kiln writes" in r.stderr and not os.path.exists(os.path.join(a.workdir, "k.gguf")),
          f"--type q2_K is refused, listing the types, nothing written ({r.stderr.strip()})")


def check_llama_cpp_quantized(a):
    """llama.cpp loads the files kiln quantize writes. Its logits are not kiln's bit for
    bit: llama.cpp rounds the activations to 8 bits for its integer dot products, where
    kiln multiplies the dequantized weights in f32; the tolerance, 0.1 on logits of
    magnitude about 2, is some ten times what that rounding gave here (0.02 to 0.03), and
    the greedy token must agree wherever kiln's best logit leads the next by more than
    twice it (a nearer tie may fall either way under that rounding)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print("not run: llama.cpp on kiln's quantized files (llama-cpp-python is not installed; not counted)")
        return
    exp = os.path.join(a.src, "tests/reference/hf/llama/expected.safetensors")
    idx = read_safetensors(exp)["idx"]
    for t in ("Q8_0", "Q4_0", "Q5_1"):
        path = os.path.join(a.workdir, f"kiln-{t}.gguf")
        mine, err = logits(a, path, exp)
        if mine is None:
            check(False, f"kiln's {t} file loads in kiln ({err})")
            continue
        mine = mine.reshape(idx.shape[0], idx.shape[1], -1)
        worst, same = 0.0, True
        for row in range(idx.shape[0]):
            llm = Llama(model_path=path, n_ctx=64, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0)
            llm.eval([int(x) for x in idx[row]])
            got = np.array(llm.scores[: idx.shape[1]], dtype=np.float32)
            worst = max(worst, float(np.abs(got - mine[row]).max()))
            top2 = np.sort(mine[row], axis=-1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 0.2
            same &= bool((got.argmax(-1) == mine[row].argmax(-1))[clear].all())
            del llm
        check(worst <= 0.1 and same, f"llama.cpp runs kiln's {t} file: logits within 0.1 of kiln's (max {worst:.3g}), "
                                     f"greedy tokens {'the same' if same else 'DIFFERENT'} where kiln's lead is over 0.2")


def k_model(a):
    """An F32 llama file wide enough for the K-quants' 256-value blocks (random weights,
    8 layers for the _M mixes' layer rules), and its tensors."""
    rng = np.random.default_rng(256)
    C, F, L, H, KV = 256, 512, 8, 4, 2
    V = gguf.GGUFValueType
    keys = [("context_length", 64, V.UINT32), ("embedding_length", C, V.UINT32), ("feed_forward_length", F, V.UINT32),
            ("block_count", L, V.UINT32), ("attention.head_count", H, V.UINT32),
            ("attention.head_count_kv", KV, V.UINT32), ("rope.freq_base", 10000.0, V.FLOAT32),
            ("attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32)]
    hs = C // H
    T = {"token_embd.weight": rng.standard_normal((256, C)), "output_norm.weight": 1 + 0.1 * rng.standard_normal(C),
         "output.weight": rng.standard_normal((256, C)) * 0.05}
    for i in range(L):
        for n, shape in (("attn_q", (C, C)), ("attn_k", (KV * hs, C)), ("attn_v", (KV * hs, C)), ("attn_output", (C, C)),
                         ("ffn_gate", (F, C)), ("ffn_up", (F, C)), ("ffn_down", (C, F))):
            # heavy-tailed, as trained weights are, so that the scales and mins are exercised
            T[f"blk.{i}.{n}.weight"] = rng.standard_t(4, shape) * 0.05
        T[f"blk.{i}.attn_norm.weight"] = 1 + 0.1 * rng.standard_normal(C)
        T[f"blk.{i}.ffn_norm.weight"] = 1 + 0.1 * rng.standard_normal(C)
    T = {k: v.astype(np.float32) for k, v in T.items()}
    path = os.path.join(a.workdir, "k-f32.gguf")
    write(path, "llama", keys, T, spm=True)
    return path, T


def check_kquants(a):
    """kiln's K-quant quantizers (Q4_K, Q5_K, Q6_K) against llama.cpp's own, which
    llama_model_quantize runs (no importance matrix: ggml's reference quantizers): every
    K-quant tensor of llama.cpp's Q4_K_M, Q5_K_M and Q6_K files, quantized again from
    the same f32 values by kiln, is the same bytes."""
    try:
        import llama_cpp
    except ImportError:
        print("not run: kiln's K-quants against llama.cpp's (llama-cpp-python is not installed; not counted)")
        return
    src, T = k_model(a)
    for ftype, name in ((15, "Q4_K_M"), (17, "Q5_K_M"), (18, "Q6_K")):
        out = os.path.join(a.workdir, f"llama-cpp-{name}.gguf")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.nthread = 2
        rc = llama_cpp.llama_model_quantize(src.encode(), out.encode(), params)
        if not check(rc == 0, f"llama.cpp quantizes the K test model to {name}"):
            continue
        compared, bad = 0, []
        for t in gguf.GGUFReader(out).tensors:
            if t.tensor_type not in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
                continue
            raw_in = os.path.join(a.workdir, "k-in.f32")
            T[t.name].astype(np.float32).tofile(raw_in)
            got = os.path.join(a.workdir, "k-out.bin")
            r = subprocess.run([a.quant, str(int(t.tensor_type)), raw_in, got], capture_output=True, text=True)
            compared += 1
            if r.returncode != 0 or open(got, "rb").read() != np.asarray(t.data).tobytes():
                bad.append(f"{t.name} ({t.tensor_type.name})")
        check(compared > 0 and not bad, f"{name}: {compared} K-quant tensors of llama.cpp's file, kiln's quantization "
                                        f"of each byte for byte the same{' (differ: ' + ', '.join(bad[:4]) + ')' if bad else ''}")
        # the whole file through kiln quantize: the same type for every tensor (the mix's rules) and the same bytes
        mine = os.path.join(a.workdir, f"kiln-{name}.gguf")
        r = kiln(a, "quantize", src, mine, "--type", {"Q4_K_M": "q4_K_M", "Q5_K_M": "q5_K_M", "Q6_K": "q6_K"}[name])
        theirs = {t.name: t for t in gguf.GGUFReader(out).tensors}
        diff = []
        if r.returncode == 0:
            for t in gguf.GGUFReader(mine).tensors:
                o = theirs.get(t.name)
                if o is None or o.tensor_type != t.tensor_type or np.asarray(o.data).tobytes() != np.asarray(t.data).tobytes():
                    diff.append(f"{t.name} kiln {t.tensor_type.name}, llama.cpp {o.tensor_type.name if o else None}")
        check(r.returncode == 0 and not diff and len(theirs) == len(gguf.GGUFReader(mine).tensors),
              f"kiln quantize --type {name}: every tensor of the type llama.cpp's quantizer picks, byte for byte "
              f"its file's{' (differ: ' + '; '.join(diff[:3]) + ')' if diff else ''} {r.stderr.strip()}")


def prompt_tokens(a, path):
    """usage.prompt_tokens of a completion of "Hello" served from the file."""
    try:
        with Served(a, path) as srv:
            return srv.post("/v1/completions", {"prompt": "Hello", "max_tokens": 1})["usage"]["prompt_tokens"]
    except Exception as e:  # noqa: BLE001
        return repr(e)


def check_bos(a):
    """A prompt starts with the start-of-text token where the file says so
    (tokenizer.ggml.add_bos_token), and by llama.cpp's default without the key: on for a
    SentencePiece vocabulary, off for a byte-level one."""
    folder = os.path.join(a.src, "tests/reference/hf/llama")
    keys, T = convert(folder, "llama")
    V = gguf.GGUFValueType
    cases = [("spm-default", True, [], 6), ("spm-off", True, [("tokenizer.ggml.add_bos_token", False, V.BOOL)], 5),
             ("bpe-default", False, [], 5), ("bpe-on", False, [("tokenizer.ggml.add_bos_token", True, V.BOOL)], 6)]
    for name, spm, extra, want in cases:
        path = os.path.join(a.workdir, f"bos-{name}.gguf")
        write(path, "llama", keys, T, spm=spm, extra_keys=extra + [("tokenizer.ggml.bos_token_id", 1, V.UINT32)])
        got = prompt_tokens(a, path)
        check(got == want, f"{name}: 'Hello' is {want} prompt tokens ({'with' if want == 6 else 'without'} the start "
                           f"of text; got {got})")


def check_refusals(a):
    folder = os.path.join(a.src, "tests/reference/hf/llama")
    keys, T = convert(folder, "llama")
    exp = os.path.join(folder, "expected.safetensors")
    V = gguf.GGUFValueType
    cases = []
    path = os.path.join(a.workdir, "bad-arch.gguf")
    write(path, "falcon", keys, T)
    cases.append(("another architecture", path, r"general.architecture 'falcon' is not one kiln runs \(.*llama"))
    path = os.path.join(a.workdir, "bad-missing.gguf")
    write(path, "llama", keys, {k: v for k, v in T.items() if k != "blk.1.ffn_up.weight"})
    cases.append(("a tensor missing", path, r"no tensor blk\.1\.ffn_up\.weight"))
    path = os.path.join(a.workdir, "bad-extra.gguf")
    write(path, "llama", keys, dict(T, **{"blk.0.attn_q.bias": np.zeros(32, np.float32)}))
    cases.append(("a tensor with no place", path, r"blk\.0\.attn_q\.bias' has no place"))
    path = os.path.join(a.workdir, "bad-keylen.gguf")
    write(path, "llama", keys + [("attention.key_length", 16, V.UINT32)], T)
    cases.append(("a head size of its own", path, r"key_length is 16"))
    path = os.path.join(a.workdir, "bad-moe.gguf")
    write(path, "llama", keys + [("expert_count", 8, V.UINT32)], T)
    cases.append(("a mixture of experts", path, r"mixture-of-experts"))
    path = os.path.join(a.workdir, "bad-shape.gguf")
    write(path, "llama", keys, dict(T, **{"blk.0.ffn_down.weight": np.zeros((32, 64), np.float32)}))
    cases.append(("a tensor of the wrong shape", path, r"blk\.0\.ffn_down\.weight is 32x64"))
    path = os.path.join(a.workdir, "bad-yarn.gguf")
    write(path, "llama", keys + [("rope.scaling.type", "yarn", V.STRING)], T)
    cases.append(("YaRN rope scaling", path, r"rope\.scaling\.type is 'yarn'"))
    for what, path, msg in cases:
        got, err = logits(a, path, exp)
        check(got is None and re.search(msg, err) and path in err, f"{what} is refused by name: {err!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--logits", required=True)
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--quant", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    check_families(a)
    check_types(a)
    check_llama_cpp(a)
    check_cli(a)
    check_quantize(a)
    check_llama_cpp_quantized(a)
    check_kquants(a)
    check_bos(a)
    check_refusals(a)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""kiln's tokenizer against the `tokenizers` library (PyPI, in build/venv): tokenizers of
the shapes real models ship, built and trained here by `tokenizers` itself on a small
multilingual text (no file is downloaded), must encode a different multilingual text to
the same ids in kiln (`kiln tokenizer encode --file`), and kiln must decode them back to
the text. The shapes:

- GPT-2: ByteLevel with its own regex;
- LLaMA-3: a Split on LLaMA-3's pattern (case-insensitive contractions, letters with one
  leading non-letter, numbers in runs of up to three), then ByteLevel without a regex;
- Qwen2: the same with single digits, after NFC normalization;
- LLaMA-3's shape after NFKC normalization;
- LLaMA-2 / Mistral (SentencePiece-style, char-level BPE with byte fallback, unk_token
  "<unk>", fuse_unk; the 256 "<0xXX>" tokens at ids 3..258 as LLaMA-2 has them; an
  alphabet limited so that CJK and emoji fall back to bytes), in the shape transformers
  writes today (Metaspace, prepend_scheme "first", no split; a BOS template the ids
  leave out, as kiln leaves out every post_processor), in the older one (normalizer
  Sequence[Prepend("▁"), Replace(" ", "▁")], no pre_tokenizer), both with the decoder
  Sequence[Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0)], and with a
  splitting Metaspace (prepend "always") and the Metaspace decoder. For these the text
  has "</s>" and "<s>" in it, and a few short texts (a leading space, a leading special
  token) are checked too; decoding must give what `tokenizers` decodes (special tokens
  kept), which for the text itself is the text (with ByteFallback in the decoder); and
  the tokenizer.json kiln writes back (tokenizer_resave) must load in `tokenizers` and
  give the same ids and text. Two more shapes have no byte tokens, so that what the
  vocab lacks becomes "<unk>": one per run of such characters (fuse_unk) or one each.
- GPT-2's shape without the tokens of some bytes (StarCoder's family leaves out the
  bytes UTF-8 never holds and some control bytes), on a text holding control bytes:
  without an unk token they are dropped, with one each is it (or a run, fused).

The text holds Latin with accents, CJK, Arabic, Cyrillic, emoji, digits of several
scripts, runs of spaces, tabs and newlines, code, decomposed accents and Hangul jamo,
and compatibility characters (full-width, ligatures, fractions). A tokenizer.json kiln
cannot read (another normalizer, a Split that is not Isolated, a Regex Replace, BPE
dropout, another decoder) is refused with a message naming it.
Exits 77 (skip, never a pass) when `tokenizers` is not installed.
    python tests/tokenizer/test_hf_tokenizers.py --kiln build/kiln --resave build/tokenizer_resave --workdir DIR
"""
import argparse
import json
import os
import re
import subprocess
import sys

try:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
except ImportError:
    print("skip: the tokenizers package is not installed (run scripts/install-test-deps.sh)")
    sys.exit(77)

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")

TRAIN = """In the beginning God created the heaven and the earth. And the earth was without form.
Ça va très bien, merci ! Où est la gare ? Naïve café, déjà vu, Übermäßig große Straße.
日本語のテキストです。東京は大きな都市です。中文也在这里：你好，世界！
مرحبا بالعالم، هذه جملة عربية قصيرة. Привет, мир! Это тест.
def main(argv):\n    for i in range(10):\n        print(f"{i:03d} -> {i * 2}")  # double
Numbers: 12345 678 9 0.5 3,141,592 ٣٤٥ ௧௨ and emoji 😀🎉👍🏽 ok!!! ...   spaces\t\ttabs
It's, I'm, we're, they've, you'll, he'd, DON'T, IT'S.
""" * 20

TEST = """The LORD spake unto Moses, saying: "Go forth!"  Don't STOP; it'S fine.
Évidemment, l'été à Noël… Fußgänger über die Brücke. 北京欢迎你！漢字とカタカナ、ひらがな。
السلام عليكم ٢٠٢٤ Москва 2024 год — 😀😀 🎉 👍🏽👍🏽
    if x >= 1000000:\r\n\treturn [a+b for a, b in zip(xs, ys)]   \n\n\n   trailing   
1234567 12 1 ١٢٣٤ 3.14159e-10 <|endoftext|> after the special token
Decomposed: cafe\u0301 A\u030angstro\u0308m \u1100\u1161 ; compatibility: ＡＢＣ１２３ ﬁne ½ ㌀
"""


def build(kind, path):
    tok = Tokenizer(models.BPE())
    if kind == "qwen2":
        tok.normalizer = normalizers.NFC()
    elif kind == "llama3-nfkc":
        tok.normalizer = normalizers.NFKC()
    if kind == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        pattern = QWEN2 if kind == "qwen2" else LLAMA3
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TRAIN], trainer=trainer)
    tok.save(path)
    return tok


# Byte-level vocabularies without some bytes, as StarCoder's family ships them (issue 47):
# the bytes UTF-8 text never holds (0xC0, 0xC1, 0xF5-0xFF) and some control bytes are left
# out and the ids closed up. `tokenizers` writes the unk token for such a byte (one for a
# run with fuse_unk), or with none drops it, so that its neighbours may merge.
GAP_BYTES = [0x00, 0x01, 0x04, 0x07, 0x1B, 0x7F, 0xC0, 0xC1] + list(range(0xF5, 0x100))
GAP_TEST = TEST + "control bytes: a\x04b \x01\x01\x01 x\x00y \x1b[0m ok\x7f and \x07\x04 the end\n"
GAP_SHAPES = ("gap-none", "gap-unk", "gap-unk-fused")


def build_gap(kind, path):
    """The gpt2 shape, trained by tokenizers, its vocab without GAP_BYTES' tokens."""
    tok = build("gpt2", path)
    j = json.loads(tok.to_str())
    table = {b: c for b, c in zip(range(256), bytes_to_chars())}
    gone = {table[b] for b in GAP_BYTES}
    old = sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1])
    kept = [k for k, _ in old if k not in gone]
    j["model"]["vocab"] = {k: i for i, k in enumerate(kept)}
    j["model"]["merges"] = [m for m in j["model"]["merges"]
                            if not any(part in gone for part in (m.split(" ") if isinstance(m, str) else m))]
    for t in j["added_tokens"]:
        t["id"] = j["model"]["vocab"][t["content"]]
    if kind != "gap-none":
        j["model"]["unk_token"] = "<|endoftext|>"
        j["model"]["fuse_unk"] = kind == "gap-unk-fused"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False)
    return Tokenizer.from_file(path)


def bytes_to_chars():
    """GPT-2's byte-to-character table, in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def check_gap(a, kind):
    path = os.path.join(a.workdir, f"{kind}.json")
    text_path = os.path.join(a.workdir, "gap.txt")
    with open(text_path, "w", encoding="utf-8", newline="") as f:
        f.write(GAP_TEST)
    tok = build_gap(kind, path)
    want = tok.encode(GAP_TEST).ids
    r = kiln(a, "tokenizer", "encode", "--tokenizer", path, "--file", text_path)
    got = [int(x) for x in r.stdout.split()] if r.returncode == 0 else None
    if got != want:
        at = next((i for i, (x, y) in enumerate(zip(got or [], want)) if x != y), min(len(got or []), len(want)))
        print(f"FAIL {kind}: kiln gave {len(got or [])} ids, tokenizers {len(want)}; first difference at {at}: "
              f"kiln {(got or [])[at:at + 5]}, tokenizers {want[at:at + 5]} {r.stderr.strip()}")
        return False
    d = kiln(a, "tokenizer", "decode", "--tokenizer", path, *map(str, want))
    if d.returncode != 0 or d.stdout != tok.decode(want, skip_special_tokens=False) + "\n":
        print(f"FAIL {kind}: kiln decodes the ids to {d.stdout[-80:]!r}, tokenizers to "
              f"{tok.decode(want, skip_special_tokens=False)[-80:]!r} {d.stderr}")
        return False
    unk = sum(1 for i in want if i == tok.token_to_id("<|endoftext|>"))
    print(f"ok   {kind}: {len(tok.get_vocab())} tokens, none for {len(GAP_BYTES)} bytes; {len(want)} ids "
          f"({unk} unk), the same as tokenizers', and decoded as it decodes them")
    return True


# A GGUF file's tokenizer (kiln_gguf_tokenizer), written here as llama.cpp's converter
# writes it: the tokens in id order, their types (an added special token CONTROL, the
# rest NORMAL), the merges as "a b", and tokenizer.ggml.pre naming the pattern; for the
# SentencePiece shape, scores in place of merges (a merged token scores minus its merge's
# rank, the others below every merge) and the "<0xXX>" tokens typed BYTE. GGUF has no
# normalizer, so the oracle is tokenizers on the same document without one.
GGUF_SHAPES = {"gpt2": "gpt-2", "llama3": "llama-bpe", "qwen2": "qwen2", "llama2": None}


def write_gguf_tokenizer(doc, pre, path):
    import gguf
    V = len(doc["model"]["vocab"]) + sum(1 for t in doc["added_tokens"] if t["content"] not in doc["model"]["vocab"])
    tokens, types = [""] * V, [1] * V
    for k, i in doc["model"]["vocab"].items():
        tokens[i] = k
    for t in doc["added_tokens"]:
        tokens[t["id"]] = t["content"]
        types[t["id"]] = 3 if t.get("special", True) else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in doc["model"]["merges"]]
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2" if pre else "llama")
    if pre:
        w.add_tokenizer_pre(pre)
        w.add_token_merges(merges)
    else:
        rank = {m.replace(" ", ""): r for r, m in reversed(list(enumerate(merges)))}
        scores = [-float(rank[t]) if t in rank else -float(len(merges) + i) - 1 for i, t in enumerate(tokens)]
        for i, t in enumerate(tokens):
            if re.fullmatch(r"<0x[0-9A-F]{2}>", t):
                types[i] = 6
            elif t == doc["model"].get("unk_token"):
                types[i] = 2
        w.add_token_scores(scores)
        w.add_add_space_prefix(True)
        if doc["model"].get("unk_token"):
            w.add_unk_token_id(doc["model"]["vocab"][doc["model"]["unk_token"]])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def check_gguf(a, kind, text, json_path):
    try:
        import gguf  # noqa: F401
    except ImportError:
        print(f"FAIL {kind}.gguf: the gguf package is not installed (scripts/install-test-deps.sh installs it)")
        return False
    with open(json_path, encoding="utf-8") as f:
        doc = json.load(f)
    doc["normalizer"] = None
    doc["post_processor"] = None  # (kiln's ids are the text's alone, no BOS added: as for every shape)
    plain = os.path.join(a.workdir, f"{kind}-plain.json")
    with open(plain, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False)
    tok = Tokenizer.from_file(plain)
    path = os.path.join(a.workdir, f"{kind}.gguf")
    write_gguf_tokenizer(doc, GGUF_SHAPES[kind], path)
    text_path = os.path.join(a.workdir, f"{kind}-gguf.txt")
    with open(text_path, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    want = tok.encode(text).ids
    r = kiln(a, "tokenizer", "encode", "--tokenizer", path, "--file", text_path)
    got = [int(x) for x in r.stdout.split()] if r.returncode == 0 else None
    if got != want:
        at = next((i for i, (x, y) in enumerate(zip(got or [], want)) if x != y), min(len(got or []), len(want)))
        print(f"FAIL {kind}.gguf: kiln gave {len(got or [])} ids, tokenizers {len(want)}; first difference at {at}: "
              f"kiln {(got or [])[at:at + 5]}, tokenizers {want[at:at + 5]} {r.stderr.strip()}")
        return False
    d = kiln(a, "tokenizer", "decode", "--tokenizer", path, *map(str, want))
    if d.returncode != 0 or d.stdout != tok.decode(want, skip_special_tokens=False) + "\n":
        print(f"FAIL {kind}.gguf: kiln decodes the ids to {d.stdout[-80:]!r}, tokenizers to "
              f"{tok.decode(want, skip_special_tokens=False)[-80:]!r} {d.stderr}")
        return False
    print(f"ok   {kind}.gguf: {len(want)} ids from the GGUF file's tokenizer, the same as tokenizers' on "
          f"its tokenizer.json, and decoded as it decodes them")
    return True


# The SentencePiece-style shapes see their own special tokens in the text.
SP_TEST = TEST.replace("<|endoftext|>", "</s>") + "<s>after a special token, a literal ▁ and   spaces"
SP_EXTRA = [" a leading space", "<s>a leading special token", "  two\n\n  spaces\t"]
SP_SHAPES = ("llama2", "llama2-legacy", "metaspace-split", "unk-fused", "unk-unfused")
_sp_trained = {}


def sp_merges(text, vocab_size, across=False, limit_alphabet=None):
    """What tokenizers' BPE trainer learns from text in the SentencePiece style (byte
    fallback, Metaspace "always"; split into words unless across, when merges cross "▁"
    too): the token names in id order and the merges. Also used by tests/gguf/ and
    bench/tokenizer.sh."""
    t = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=not across)
    kw = {"limit_alphabet": limit_alphabet} if limit_alphabet else {}
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  **kw)
    t.train_from_iterator([text], trainer=trainer)
    m = json.loads(t.to_str())["model"]
    return sorted(m["vocab"], key=m["vocab"].get), [tuple(x) for x in m["merges"]]


def sp_tokenizer(names, merges, byte_tokens=True, fuse_unk=True):
    """A LLaMA-2-style tokenizer of those merges, its vocab laid out as LLaMA-2's (<unk>,
    <s>, </s>, the 256 "<0xXX>" byte tokens unless byte_tokens is false, then names), with
    no pre-tokenizer or decoder yet; and its vocab."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256 if byte_tokens else 0):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for name in names:
        vocab.setdefault(name, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=fuse_unk))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok, vocab


def llama2_decoder():
    return decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                              decoders.Strip(content=" ", left=1, right=0)])


def llama2_shape(tok):
    """The pre-tokenizer and decoder transformers writes for LLaMA-2 and Mistral today."""
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = llama2_decoder()
    return tok


def build_sp(kind, path):
    """A LLaMA-2-style tokenizer of one of SP_SHAPES, trained on TRAIN. The legacy shape's
    merges are learned across "▁" too ("e▁t"), so that kiln cannot cut its text into
    words."""
    across = kind == "llama2-legacy"
    if across not in _sp_trained:
        _sp_trained[across] = sp_merges(TRAIN, 500, across, limit_alphabet=90)
        if across and not any(re.search("[^▁]▁", name) for name in _sp_trained[across][0]):
            sys.exit("the merges learned across ▁ have no token with ▁ after another character")
    # unk-*: no byte tokens, so what the vocab lacks is <unk>
    tok, _ = sp_tokenizer(*_sp_trained[across], byte_tokens=not kind.startswith("unk"), fuse_unk=kind != "unk-unfused")
    if kind in ("llama2", "unk-fused", "unk-unfused"):
        llama2_shape(tok)
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    elif kind == "llama2-legacy":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = llama2_decoder()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.save(path)
    return tok


def kiln(args, *argv):
    # bytes, not text mode: the text's \r\n must come back as it is
    r = subprocess.run([args.kiln, *argv], capture_output=True, timeout=120)
    r.stdout, r.stderr = r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")
    return r


def first_difference(got, want):
    at = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
    return f"first difference at {at}: kiln {got[at:at + 5]}, tokenizers {want[at:at + 5]}"


def check_sp(a, kind, text_path):
    """One SentencePiece-style shape: ids, decoding, and kiln's saved file in tokenizers."""
    path = os.path.join(a.workdir, f"{kind}.json")
    tok = build_sp(kind, path)
    resaved = os.path.join(a.workdir, f"{kind}.kiln.json")
    r = subprocess.run([a.resave, path, resaved], capture_output=True, text=True, timeout=120)
    if r.returncode != 0 or r.stdout.strip() != "bpe":
        print(f"FAIL {kind}: kiln could not read and write it back: {r.stdout.strip()} {r.stderr.strip()}")
        return False
    back = Tokenizer.from_file(resaved)
    texts = [TEST, SP_TEST] + SP_EXTRA
    n_bytes = 0
    for k, text in enumerate(texts):
        with open(text_path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        want = tok.encode(text, add_special_tokens=False).ids
        r = kiln(a, "tokenizer", "encode", "--tokenizer", path, "--file", text_path)
        got = [int(x) for x in r.stdout.split()] if r.returncode == 0 else []
        if r.returncode != 0 or got != want:
            print(f"FAIL {kind}, text {k}: kiln gave {len(got)} ids, tokenizers {len(want)}; "
                  f"{first_difference(got, want)} {r.stderr}")
            return False
        n_bytes += sum(i == 0 for i in want) if kind.startswith("unk") else sum(3 <= i < 259 for i in want)
        d = kiln(a, "tokenizer", "decode", "--tokenizer", path, *map(str, want)) if want else None
        decoded = tok.decode(want, skip_special_tokens=False)
        # (the Metaspace decoder has no ByteFallback: it spells byte tokens as "<0xXX>")
        text_back = k != 0 or kind != "llama2" and kind != "llama2-legacy" or decoded == TEST
        if want and (d.returncode != 0 or d.stdout != decoded + "\n" or not text_back):
            print(f"FAIL {kind}, text {k}: kiln decodes to {d.stdout[:60]!r}..., tokenizers to {decoded[:60]!r}... "
                  f"{d.stderr}")
            return False
        if back.encode(text, add_special_tokens=False).ids != want or back.decode(want, skip_special_tokens=False) != decoded:
            print(f"FAIL {kind}, text {k}: tokenizers reads kiln's tokenizer.json as a different tokenizer: "
                  f"{first_difference(back.encode(text, add_special_tokens=False).ids, want)}")
            return False
    what = "<unk>" if kind.startswith("unk") else "byte-fallback"
    if n_bytes < 20:
        print(f"FAIL {kind}: only {n_bytes} {what} ids; the test means to exercise them")
        return False
    print(f"ok   {kind}: {len(texts)} texts, the same ids as tokenizers' ({n_bytes} {what} ids), decoded as "
          f"tokenizers decodes{' (the text back)' if kind.startswith('llama2') else ''}, and kiln's saved file read "
          f"by tokenizers as the same tokenizer")
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--resave", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
    for exe in (a.kiln, a.resave):
        if not os.access(exe, os.X_OK):
            print(f"FAIL {exe} is not built (make kiln_tool tokenizer_resave)")
            return 1
    os.makedirs(a.workdir, exist_ok=True)
    text_path = os.path.join(a.workdir, "multilingual.txt")
    with open(text_path, "w", encoding="utf-8", newline="") as f:
        f.write(TEST)
    passed = failed = 0
    for kind in ("gpt2", "llama3", "qwen2", "llama3-nfkc"):
        path = os.path.join(a.workdir, f"{kind}.json")
        tok = build(kind, path)
        want = tok.encode(TEST).ids
        r = kiln(a, "tokenizer", "encode", "--tokenizer", path, "--file", text_path)
        got = [int(x) for x in r.stdout.split()] if r.returncode == 0 else None
        if got != want:
            at = next((i for i, (x, y) in enumerate(zip(got or [], want)) if x != y), min(len(got or []), len(want)))
            print(f"FAIL {kind}: kiln gave {len(got or [])} ids, tokenizers {len(want)}; first difference at {at}: "
                  f"kiln {(got or [])[at:at + 5]}, tokenizers {want[at:at + 5]} ({tok.decode(want[at:at + 5])!r})"
                  f"{' ' + r.stderr if r.returncode else ''}")
            failed += 1
            continue
        d = kiln(a, "tokenizer", "decode", "--tokenizer", path, *map(str, want))
        norm = tok.normalizer.normalize_str(TEST) if tok.normalizer else TEST
        if d.returncode != 0 or d.stdout != norm + "\n":
            print(f"FAIL {kind}: kiln decodes the ids to {d.stdout[:80]!r}... {d.stderr}")
            failed += 1
            continue
        print(f"ok   {kind}: {len(want)} ids, the same as tokenizers', and decoded back to the "
              f"{'normalized ' if tok.normalizer else ''}text")
        passed += 1
    for kind in GAP_SHAPES:
        ok = check_gap(a, kind)
        passed += ok
        failed += not ok
    for kind in SP_SHAPES:
        ok = check_sp(a, kind, text_path)
        passed += ok
        failed += not ok
    for kind in GGUF_SHAPES:
        ok = check_gguf(a, kind, SP_TEST if kind == "llama2" else TEST, os.path.join(a.workdir, f"{kind}.json"))
        passed += ok
        failed += not ok
    # Refused by name: a normalizer, a Split that is not Isolated; for the LLaMA-2 shape
    # a Replace on a regex, BPE dropout, a decoder kiln does not have.
    for base, what, edit in (
            ("llama3", "normalizer \"Lowercase\"", lambda j: j.update(normalizer={"type": "Lowercase"})),
            ("llama3", "behavior \"MergedWithPrevious\"",
             lambda j: j["pre_tokenizer"]["pretokenizers"][0].update(behavior="MergedWithPrevious")),
            ("llama2-legacy", "normalizer Replace with a Regex pattern",
             lambda j: j["normalizer"]["normalizers"][1].update(pattern={"Regex": " "})),
            ("llama2", "BPE dropout", lambda j: j["model"].update(dropout=0.1)),
            ("llama2", "decoder \"BPEDecoder\"", lambda j: j.update(decoder={"type": "BPEDecoder", "suffix": "</w>"}))):
        with open(os.path.join(a.workdir, f"{base}.json")) as f:
            j = json.load(f)
        edit(j)
        bad = os.path.join(a.workdir, "bad.json")
        with open(bad, "w") as f:
            json.dump(j, f)
        r = kiln(a, "tokenizer", "encode", "--tokenizer", bad, "--text", "x")
        if r.returncode == 1 and what in r.stderr:
            print(f"ok   refused: {r.stderr.strip()}")
            passed += 1
        else:
            print(f"FAIL a tokenizer.json with {what}: exit {r.returncode}, {r.stderr.strip()!r}")
            failed += 1
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

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
- LLaMA-3's shape after NFKC normalization.

The text holds Latin with accents, CJK, Arabic, Cyrillic, emoji, digits of several
scripts, runs of spaces, tabs and newlines, code, decomposed accents and Hangul jamo,
and compatibility characters (full-width, ligatures, fractions). A tokenizer.json kiln
cannot read (another normalizer, a Split that is not Isolated) is refused with a
message naming it.
Exits 77 (skip, never a pass) when `tokenizers` is not installed.
    python tests/tokenizer/test_hf_tokenizers.py --kiln build/kiln --workdir DIR
"""
import argparse
import json
import os
import subprocess
import sys

try:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
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


def kiln(args, *argv):
    # bytes, not text mode: the text's \r\n must come back as it is
    r = subprocess.run([args.kiln, *argv], capture_output=True, timeout=120)
    r.stdout, r.stderr = r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--workdir", required=True)
    a = ap.parse_args()
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
    # Refused by name: a normalizer, a Split that is not Isolated.
    for what, edit in (("normalizer \"Lowercase\"", lambda j: j.update(normalizer={"type": "Lowercase"})),
                       ("behavior \"MergedWithPrevious\"",
                        lambda j: j["pre_tokenizer"]["pretokenizers"][0].update(behavior="MergedWithPrevious"))):
        with open(os.path.join(a.workdir, "llama3.json")) as f:
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

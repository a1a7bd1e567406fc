#!/usr/bin/env python3
"""Checks that HuggingFace `tokenizers` encodes a text to the same ids as kiln.

Usage:
    python3 tests/reference/check_tokenizer.py TOKENIZER_JSON TEXT_FILE KILN_IDS

TOKENIZER_JSON is a file written by kiln_tokenizer_save, TEXT_FILE the text (read as
UTF-8), and KILN_IDS the ids kiln_tokenizer_encode gave for that text, one per line.
Needs `pip install tokenizers`. Prints "match: N ids" and exits 0 when the ids are equal;
otherwise prints where they first differ, with the text around that place, and exits 1.
Not part of the CTest suite: it needs Python and a package kiln does not depend on.
"""
import sys

from tokenizers import Tokenizer


def main(argv):
    if len(argv) != 4:
        sys.exit(__doc__)
    tok = Tokenizer.from_file(argv[1])
    with open(argv[2], encoding="utf-8", newline="") as f:
        text = f.read()
    with open(argv[3]) as f:
        kiln_ids = [int(line) for line in f if line.strip()]
    enc = tok.encode(text)
    hf_ids = enc.ids
    if hf_ids == kiln_ids:
        print(f"match: {len(hf_ids)} ids")
        return 0
    i = next((k for k, (a, b) in enumerate(zip(hf_ids, kiln_ids)) if a != b), min(len(hf_ids), len(kiln_ids)))
    start = enc.offsets[i][0] if i < len(enc.offsets) else len(text)
    print(f"MISMATCH at id {i}: tokenizers {hf_ids[i:i + 8]} vs kiln {kiln_ids[i:i + 8]} "
          f"(lengths {len(hf_ids)} vs {len(kiln_ids)}); text there: {text[max(0, start - 20):start + 40]!r}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))

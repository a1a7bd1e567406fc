#!/usr/bin/env python3
"""A byte-level tokenizer.json for the tiny Hugging Face folders of hf_ref.py (vocabulary
256: token b is byte b), so that each folder is complete as a user's would be: kiln
refuses a folder without a tokenizer.json rather than guess one.

    python3 tests/reference/byte_tokenizer.py DIR...

writes DIR/tokenizer.json in the `tokenizers` library's format: a BPE model with no
merges over GPT-2's byte-to-character table, ByteLevel pre-tokenizer and decoder.
"""
import json
import os
import sys


def byte_chars():
    """GPT-2's table: printable Latin-1 bytes stand for themselves, the others are moved
    to 256 and up in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write(d):
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    doc = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": level, "post_processor": None, "decoder": level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {c: b for b, c in byte_chars().items()}, "merges": []},
    }
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=2)


if __name__ == "__main__":
    for d in sys.argv[1:]:
        write(d)

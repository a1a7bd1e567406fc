#!/bin/sh
# Encoding speed, kiln against the tokenizers library, side by side in one run: a
# tokenizer of VOCAB tokens for TEXT (the KJV by default), then the whole text encoded
# by `kiln tokenizer encode --file` (one thread; the ids written to /dev/null) and by
# tokenizers (PyPI, build/venv; PYTHON overrides) as one string and as a batch of its
# lines (tokenizers' threads: RAYON_NUM_THREADS, 2 here). Each best of 3; prints MB/s
# and the ratios, and checks the two give the same number of ids. SHAPE is
#   bytelevel  a byte-level BPE trained by kiln (GPT-2's shape), the default;
#   llama2     a SentencePiece-style BPE trained by tokenizers: byte fallback, the 256
#              "<0xXX>" tokens, Metaspace (prepend_scheme "first", no split) and the
#              LLaMA-2 decoder, as transformers writes LLaMA-2 and Mistral today.
#   sh bench/tokenizer.sh [BUILD_DIR] [TEXT] [VOCAB] [SHAPE]
set -eu
build=${1:-build}
text=${2:-data/kjv.txt}
vocab=${3:-1024}
shape=${4:-bytelevel}
py=${PYTHON:-${build}/venv/bin/python}
tmp=$(mktemp -d)
case $shape in
bytelevel)
    "$build/kiln" tokenizer train --data "$text" --vocab "$vocab" --out "$tmp/tok.json" >/dev/null ;;
llama2)
    "$py" - "$text" "$vocab" "$tmp/tok.json" <<'PY'
import sys
sys.path.insert(0, "tests/tokenizer")
from test_hf_tokenizers import llama2_shape, sp_merges, sp_tokenizer  # the tests' LLaMA-2-style builder
path, vocab_size, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
tok, _ = sp_tokenizer(*sp_merges(open(path, encoding="utf-8").read(), vocab_size - 256))
llama2_shape(tok).save(out)
PY
    ;;
*)
    echo "bench/tokenizer.sh: SHAPE is bytelevel or llama2, not $shape" >&2
    exit 2 ;;
esac
bytes=$(wc -c <"$text")
best=999
for i in 1 2 3; do
    t=$(python3 -c 'import time; print(time.perf_counter())')
    "$build/kiln" tokenizer encode --tokenizer "$tmp/tok.json" --file "$text" >"$tmp/ids"
    t=$(python3 -c "import time; print(time.perf_counter() - $t)")
    best=$(python3 -c "print(min($best, $t))")
done
kn=$(wc -w <"$tmp/ids")
RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-2} "$py" - "$tmp/tok.json" "$text" "$bytes" "$best" "$kn" "$shape" <<'PY'
import sys, time
from tokenizers import Tokenizer
tok, path, nbytes, kiln_s, kiln_n = Tokenizer.from_file(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
text = open(path, encoding="utf-8", newline="").read()
lines = text.splitlines(keepends=True)
# kiln leaves out the post_processor (no BOS): tokenizers is asked for the same ids
enc = lambda s: tok.encode(s, add_special_tokens=False)
def best(f):
    r = []
    for _ in range(3):
        t = time.perf_counter(); out = f(); r.append(time.perf_counter() - t)
    return min(r), out
one_s, ids = best(lambda: enc(text).ids)
batch_s, _ = best(lambda: tok.encode_batch(lines, add_special_tokens=False))
mb = nbytes / 1e6
print(f"shape {sys.argv[6]}, {tok.get_vocab_size()} tokens")
print(f"kiln (1 thread, with writing the ids):  {mb / kiln_s:7.1f} MB/s  {kiln_n} ids")
print(f"tokenizers, the text as one string:     {mb / one_s:7.1f} MB/s  {len(ids)} ids")
print(f"tokenizers, encode_batch of its lines:  {mb / batch_s:7.1f} MB/s")
print(f"kiln / tokenizers: {one_s / kiln_s:.2f} (one string), {batch_s / kiln_s:.2f} (batch of lines)")
if kiln_n != len(ids):
    sys.exit(f"the id counts differ: kiln {kiln_n}, tokenizers {len(ids)}")
PY
rm -rf "$tmp"

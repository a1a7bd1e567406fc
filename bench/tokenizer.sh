#!/bin/sh
# Encoding speed, kiln against the tokenizers library, side by side in one run: a
# byte-level BPE of VOCAB tokens trained by kiln on TEXT (the KJV by default), then the
# whole text encoded by `kiln tokenizer encode --file` (one thread; the ids written to
# /dev/null) and by tokenizers (PyPI, build/venv) as one string and as a batch of its
# lines (tokenizers' threads: RAYON_NUM_THREADS, 2 here). Each best of 3; prints MB/s and
# the ratios, and checks the two give the same number of ids.
#   sh bench/tokenizer.sh [BUILD_DIR] [TEXT] [VOCAB]
set -eu
build=${1:-build}
text=${2:-data/kjv.txt}
vocab=${3:-1024}
py=${build}/venv/bin/python
tmp=$(mktemp -d)
"$build/kiln" tokenizer train --data "$text" --vocab "$vocab" --out "$tmp/tok.json" >/dev/null
bytes=$(wc -c <"$text")
best=999
for i in 1 2 3; do
    t=$(python3 -c 'import time; print(time.perf_counter())')
    "$build/kiln" tokenizer encode --tokenizer "$tmp/tok.json" --file "$text" >"$tmp/ids"
    t=$(python3 -c "import time; print(time.perf_counter() - $t)")
    best=$(python3 -c "print(min($best, $t))")
done
kn=$(wc -w <"$tmp/ids")
RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-2} "$py" - "$tmp/tok.json" "$text" "$bytes" "$best" "$kn" <<'PY'
import sys, time
from tokenizers import Tokenizer
tok, path, nbytes, kiln_s, kiln_n = Tokenizer.from_file(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
text = open(path, encoding="utf-8", newline="").read()
lines = text.splitlines(keepends=True)
def best(f):
    r = []
    for _ in range(3):
        t = time.perf_counter(); out = f(); r.append(time.perf_counter() - t)
    return min(r), out
one_s, ids = best(lambda: tok.encode(text).ids)
batch_s, _ = best(lambda: tok.encode_batch(lines))
mb = nbytes / 1e6
print(f"kiln (1 thread, with writing the ids):  {mb / kiln_s:7.1f} MB/s  {kiln_n} ids")
print(f"tokenizers, the text as one string:     {mb / one_s:7.1f} MB/s  {len(ids)} ids")
print(f"tokenizers, encode_batch of its lines:  {mb / batch_s:7.1f} MB/s")
print(f"kiln / tokenizers: {one_s / kiln_s:.2f} (one string), {batch_s / kiln_s:.2f} (batch of lines)")
if kiln_n != len(ids):
    sys.exit(f"the id counts differ: kiln {kiln_n}, tokenizers {len(ids)}")
PY
rm -rf "$tmp"

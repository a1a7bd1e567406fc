#!/bin/sh
# A GPT-2-style model for the serving benchmarks (bench/serve.sh, bench/serve_weights.sh):
# a byte tokenizer, context 256, trained on a small made-up corpus for STEPS steps only
# (speed does not depend on the weights), written to OUT.
#   sh bench/serve_model.sh BUILD_DIR OUT LAYERS WIDTH HEADS [STEPS] [BATCH]
set -eu
build=$1
out=$2
corpus=$(mktemp)
trap 'rm -f "$corpus"' EXIT
python3 -c "
import random
r = random.Random(3)
w = 'in the beginning god created heaven and earth was without form void darkness upon face of deep'.split()
print('\n'.join(' '.join(r.choice(w) for _ in range(12)) for _ in range(4000)))" >"$corpus"
"$build/kiln" train --data "$corpus" --out "$out" --arch gpt2 --layers "$3" --width "$4" --heads "$5" \
    --context 256 --batch "${7:-4}" --steps "${6:-5}" --log-every "${6:-5}" --eval-every 1000 >/dev/null

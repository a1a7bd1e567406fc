#!/bin/sh
# `make demo`: pretrain a small GPT on the King James Bible for a few minutes on the
# CPU, save it, draw the loss chart, and sample from it.
set -eu
build=${1:-build}
sh scripts/get-corpus.sh data/kjv.txt
flags="--data data/kjv.txt --out runs/demo --arch gpt2 --layers 4 --width 128 --heads 4 --context 128 --batch 16
       --lr 2e-3 --min-lr 2e-4 --warmup 100 --eval-every 200 --log-every 25 --save-every 500"
# (--overwrite: a second `make demo` trains runs/demo again rather than being refused)
# shellcheck disable=SC2086
"$build/kiln" train $flags --steps 1000 --overwrite
echo
echo "--- a sample from runs/demo ---"
"$build/kiln" sample runs/demo --prompt "And God said" --max-tokens 300 --temperature 0.8 --seed 1
echo
echo "loss chart: runs/demo/loss.svg (open it in a browser)"
echo "continue training: $build/kiln train --out runs/demo --resume --steps 1500   (run.json holds the rest)"

#!/bin/sh
# The layering check must fail on an upward call: an object planted in core that calls
# kiln_backward (autograd, a floor above) is reported with both files and the symbol,
# and the same check passes on the real objects alone.
set -eu
src=$1
build=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat >"$tmp/planted.c" <<'C'
#include "kiln/ops.h"
int planted_upward_call(kiln_tensor_t *t) { return kiln_backward(t); }
C
cc -c -I"$src/include" -o "$tmp/planted.o" "$tmp/planted.c"
sh "$src/scripts/check-layers.sh" "$src" "$build" >"$tmp/clean.txt" 2>&1 || {
  echo "FAIL: the check fails on the real objects:"; cat "$tmp/clean.txt"; exit 1; }
if sh "$src/scripts/check-layers.sh" "$src" "$build" --extra core "$tmp/planted.o" >"$tmp/out.txt" 2>&1; then
  echo "FAIL: the planted upward call was not reported:"; cat "$tmp/out.txt"; exit 1
fi
for want in planted kiln_backward "autograd/autograd.c" "room autograd is above room core"; do
  grep -q "$want" "$tmp/out.txt" || { echo "FAIL: the report does not name '$want':"; cat "$tmp/out.txt"; exit 1; }
done
echo "layers_planted: the planted call was reported:"
cat "$tmp/out.txt"
echo "1 passed, 0 failed"

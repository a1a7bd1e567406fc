#!/bin/sh
# The layering check must fail on an upward call: an object planted in core that calls
# kiln_backward (autograd, a floor above) is reported with both files and the symbol;
# a source planted in core that includes autograd's header is reported with the file
# and the header; and the same check passes on the real tree alone.
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
printf '#include "autograd/autograd.h"\n' >"$tmp/planted_include.c"
if sh "$src/scripts/check-layers.sh" "$src" "$build" --extra-source core "$tmp/planted_include.c" >"$tmp/inc.txt" 2>&1; then
  echo "FAIL: the planted include was not reported:"; cat "$tmp/inc.txt"; exit 1
fi
for want in planted_include.c autograd/autograd.h "room autograd is above room core"; do
  grep -q "$want" "$tmp/inc.txt" || { echo "FAIL: the include report does not name '$want':"; cat "$tmp/inc.txt"; exit 1; }
done
echo "layers_planted: the planted include was reported:"
cat "$tmp/inc.txt"
echo "2 passed, 0 failed"

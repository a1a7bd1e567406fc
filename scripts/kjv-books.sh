#!/bin/sh
# Writes data/kjv.txt as its 66 books joined by <|endoftext|>, the end-of-text marker a
# BPE tokenizer trained by kiln keeps as one token: packed documents for
# `kiln train --attention doc` (document masking; docs/flex.md). A book starts at the
# heading "Name 1" of a name not seen just before.
#   sh scripts/kjv-books.sh [IN] [OUT]   (default data/kjv.txt, stdout)
set -eu
in=${1:-data/kjv.txt}
[ -r "$in" ] || { echo "kjv-books.sh: cannot read $in" >&2; exit 1; }
awk 'BEGIN { prev = "" }
     /^[1-3]? ?[A-Z][A-Za-z ]+ 1$/ { name = $0; sub(/ 1$/, "", name)
                                     if (name != prev && prev != "") printf "<|endoftext|>"
                                     prev = name }
     { print }' "$in" > "${2:-/dev/stdout}"

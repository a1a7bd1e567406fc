#!/bin/sh
# Writes the built-in default corpus, the King James Bible (public domain), to
# data/kjv.txt from Debian's bible-kjv-text package via its `bible` reader. Verse
# numbers are stripped so that the model learns the prose.
set -eu
out=${1:-data/kjv.txt}
[ -s "$out" ] && exit 0
command -v bible >/dev/null || { echo "kiln: the 'bible' command is missing (apt-get install bible-kjv)" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
echo | bible -l200 "Gen1:1-Rev22:21" | sed -E 's/^ +[0-9]+ //' > "$out.tmp"
mv "$out.tmp" "$out"
echo "kiln: wrote $out ($(wc -c < "$out") bytes)"

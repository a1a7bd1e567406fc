#!/bin/sh
# The layering check (src/LAYERS): lists every symbol that a room of the library uses
# from a room on its own floor or above, naming the file that uses it, the symbol and
# the file that defines it; exits 1 if there is any, 0 if none.
#
#   sh scripts/check-layers.sh SOURCE_DIR BUILD_DIR [--extra ROOM OBJECT]... [--extra-source ROOM FILE]...
#
# It reads the objects CMake built for each room (BUILD_DIR/CMakeFiles/kiln_room_*), and
# the #include lines of each room's sources: a room includes the headers of the floors
# below it only (a struct layout or a macro from above is an upward dependency too,
# though no symbol shows it). --extra adds an object, --extra-source a source file, as
# if it were part of ROOM (tests/layers/test_planted.sh plants upward uses this way, to
# see the check fail).
set -eu
src=$1
build=$2
shift 2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# room floor, one a line (floors counted from 0, bottom first)
awk '/^#/ || /^library / || NF == 0 { next } { for (i = 1; i <= NF; i++) print $i, f; f++ }' "$src/src/LAYERS" >"$tmp/floors"

# One line a symbol: "def|use SYMBOL ROOM FILE" for every object of every room.
scan() { # room object file-name
  nm -P --defined-only "$2" 2>/dev/null | awk -v r="$1" -v f="$3" '$2 ~ /^[A-Z]$/ && $2 != "U" { print "def", $1, r, f }'
  nm -P --undefined-only "$2" 2>/dev/null | awk -v r="$1" -v f="$3" '{ print "use", $1, r, f }'
}
: >"$tmp/syms"
while read -r room floor; do
  id=$(echo "$room" | tr / _)
  dir="$build/CMakeFiles/kiln_room_$id.dir"
  [ -d "$dir" ] || { echo "check-layers: no objects for room $room in $dir (build first)" >&2; exit 2; }
  find "$dir" -name '*.o' | sort | while read -r o; do
    scan "$room" "$o" "${o#"$dir"/}" | sed 's/\.o$//' >>"$tmp/syms"
  done
done <"$tmp/floors"
# One line an include: "ROOM FILE INCLUDED-ROOM HEADER".
includes() { # room file name
  grep -oE '^[[:space:]]*#[[:space:]]*include[[:space:]]+"[^"]+"' "$2" | sed -E 's/.*"([^"]+)"/\1/' |
    awk -v r="$1" -v f="$3" -F/ 'NF > 1 { room = ($1 == "backends" && NF > 2) ? $1 "/" $2 : $1; print r, f, room, $0 }'
}
: >"$tmp/incs"
while read -r room floor; do
  for f in "$src/src/$room"/*.c "$src/src/$room"/*.h; do
    [ -f "$f" ] && includes "$room" "$f" "${f#"$src"/}" >>"$tmp/incs"
  done
done <"$tmp/floors"
while [ $# -gt 0 ]; do
  case "$1" in
    --extra) [ $# -ge 3 ] || { echo "check-layers: --extra ROOM OBJECT" >&2; exit 2; }
      scan "$2" "$3" "$(basename "$3" .o)" >>"$tmp/syms" ;;
    --extra-source) [ $# -ge 3 ] || { echo "check-layers: --extra-source ROOM FILE" >&2; exit 2; }
      includes "$2" "$3" "$(basename "$3")" >>"$tmp/incs" ;;
    *) echo "usage: check-layers.sh SRC BUILD [--extra ROOM OBJECT]... [--extra-source ROOM FILE]..." >&2; exit 2 ;;
  esac
  shift 3
done

# Headers: a room's own, a lower floor's, or the public ones (kiln/...) only.
bad_inc=$(awk '
  FNR == NR { floor[$1] = $2; next }
  !($3 in floor) || $3 == $1 { next }
  floor[$3] >= floor[$1] {
    printf "layers: %s includes %s (room %s is %s room %s)\n", $2, $4, $3,
           floor[$3] == floor[$1] ? "on the same floor as" : "above", $1
  }' "$tmp/floors" "$tmp/incs")

awk '
  FNR == NR { floor[$1] = $2; next }
  $1 == "def" { def[$2] = $3; deffile[$2] = $4; next }
  { use[++n] = $2; user[n] = $3; usefile[n] = $4 }
  END {
    bad = 0
    for (i = 1; i <= n; i++) {
      s = use[i]
      if (!(s in def)) continue                       # a system library symbol
      if (def[s] == user[i]) continue                 # the same room
      if (floor[def[s]] < floor[user[i]]) continue    # downward: allowed
      printf "layers: %s uses %s from %s (room %s is %s room %s)\n", usefile[i], s, deffile[s], def[s],
             floor[def[s]] == floor[user[i]] ? "on the same floor as" : "above", user[i]
      bad++
    }
    if (bad) { printf "layers: %d upward or sideways use(s); see src/LAYERS\n", bad; exit 1 }
  }' "$tmp/floors" "$tmp/syms"
if [ -n "$bad_inc" ]; then
  echo "$bad_inc"
  echo "layers: $(echo "$bad_inc" | wc -l) upward or sideways include(s); see src/LAYERS"
  exit 1
fi
echo "layers: every room uses and includes only the floors below it"

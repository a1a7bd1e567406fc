#!/bin/sh
# Installs the built kiln into a temporary prefix, then builds tests/install/hello.c
# outside the tree four ways (pkg-config shared and static, find_package shared and
# static) and runs each: every one must print the gradient 2 4 6.
set -eu
src=$1
build=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix="$tmp/prefix"
cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; exit 1; }
libdir=$(ls -d "$prefix"/lib*/pkgconfig | head -1)
libdir=${libdir%/pkgconfig}
for f in include/kiln/kiln.h; do [ -f "$prefix/$f" ] || { echo "FAIL: $f not installed"; exit 1; }; done
for l in kiln kiln-nn kiln-serve; do
  [ -f "$libdir/lib$l.a" ] && [ -e "$libdir/lib$l.so" ] && [ -f "$libdir/pkgconfig/$l.pc" ] ||
    { echo "FAIL: lib$l (.a, .so, .pc) not installed under $libdir"; ls "$libdir"; exit 1; }
done
export PKG_CONFIG_PATH="$libdir/pkgconfig"
passed=0
check() { # name, program
  out=$("$2") || { echo "FAIL: $1: $out"; exit 1; }
  case "$out" in "grad 2 4 6 on cpu") ;; *) echo "FAIL: $1 printed '$out'"; exit 1 ;; esac
  echo "ok: $1: $out"
  passed=$((passed + 1))
}
cc -o "$tmp/pc_shared" "$src/tests/install/hello.c" $(pkg-config --cflags --libs kiln) -Wl,-rpath,"$libdir"
check "pkg-config, shared" "$tmp/pc_shared"
cc -o "$tmp/pc_static" "$src/tests/install/hello.c" $(pkg-config --cflags kiln) "$libdir/libkiln.a" \
  $(pkg-config --static --libs-only-other --libs-only-l kiln | sed 's/-lkiln\b//')
check "pkg-config, static" "$tmp/pc_static"
cmake -S "$src/tests/install" -B "$tmp/b" -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/cmake.log" 2>&1 ||
  { cat "$tmp/cmake.log"; exit 1; }
cmake --build "$tmp/b" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
check "find_package, shared" "$tmp/b/hello_shared"
check "find_package, static" "$tmp/b/hello_static"
echo "$passed passed, 0 failed"

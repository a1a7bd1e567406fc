#!/bin/sh
# Mutation testing: do the tests catch plausible one-line bugs? Each mutant below is one
# line of the library changed the way a real bug would change it (an off-by-one, a wrong
# comparison or initial value, swapped operands, a dropped check), with the CTest regex
# of the tests expected to catch it. For each mutant the script changes that line in a
# scratch copy of the tree, builds, runs those tests, and reports CAUGHT (some test
# failed, or timed out) or MISSED (all passed); then it puts the line back. A MISSED
# mutant is a hole in the tests: strengthen them (or, if the mutant is truly equivalent,
# replace it and say why in the commit). Run on demand, not in CI: it builds and tests
# once a mutant.
#
#   sh scripts/mutate.sh                 every mutant, each against its listed tests
#   sh scripts/mutate.sh 3 7             mutants 3 and 7
#   sh scripts/mutate.sh --list          the list: number, room, file, tests
#   sh scripts/mutate.sh --show 3        mutant 3's line before and after
#   sh scripts/mutate.sh --full [N...]   the whole ctest (ctest -j nproc) instead
#
# The scratch copy is KILN_MUTATE_DIR (default /tmp/kiln-mutate-$USER): the tracked and
# untracked-not-ignored files of this tree are copied there (mtimes kept, so its build
# folder, kept between runs, rebuilds only what changed), built with KILN_MUTATE_CMAKE
# (default -DCMAKE_BUILD_TYPE=Release -DKILN_BLAS=OPENBLAS), and the mutants are made
# there: this tree is only read. A build/venv here is linked into the copy's build folder
# for the Python tests. KILN_MUTATE_JOBS sets the build's parallelism (default nproc),
# KILN_MUTATE_TIMEOUT the seconds one mutant's tests may take (default 900).
# Exit status: 0 when every mutant run was caught, 1 when one was missed or could not
# be applied or built, 2 on a usage error. A file deleted from this tree stays in the
# copy until KILN_MUTATE_DIR is removed.
#
# Each record: room @@ file @@ the line's text (a substring that occurs exactly once in
# the file) @@ what it becomes @@ the CTest regex of the tests expected to catch it.
set -u

mutants() {
  cat <<'EOF'
core @@ src/core/kmath.h @@ KM_C0 * (1.0f + 3.0f * KM_C1 * x * x); @@ KM_C0 * (1.0f + 2.0f * KM_C1 * x * x); @@ ^test_gradcheck$
core @@ src/core/dtype.h @@ x += 0x7fff + ((x >> 16) & 1); @@ x += 0x7fff; @@ ^test_tensor$|^test_amp$
core @@ src/core/threadpool.c @@ int64_t e = b + job.chunk < job.n ? b + job.chunk : job.n; @@ int64_t e = b + job.chunk < job.n ? b + job.chunk - 1 : job.n; @@ ^test_ops$|^test_tensor$
core @@ src/core/infer.c @@ if (v == s || v == 1) continue; @@ if (v == s || v == 1 || s != 1) continue; @@ ^test_tensor$|^test_ops$
backends/cpu @@ src/backends/cpu/cpu_reduce.c @@ double acc = r->kind == 0 ? 0.0 : -INFINITY; @@ double acc = r->kind == 0 ? 0.0 : 0.0; @@ ^test_ops$
backends/cpu @@ src/backends/cpu/cpu_reduce.c @@ } else if (!nan && v > acc) { @@ } else if (!nan && v >= acc) { @@ ^test_ops$
backends/cpu @@ src/backends/cpu/cpu_pointwise.c @@ float p = k->p[i] * (1.0f - k->lr * k->wd); @@ float p = k->p[i] * (1.0f - k->wd); @@ ^test_ops$
ops @@ src/ops/backward.c @@ BINARY_BW(sub, G, kiln_neg(G)) @@ BINARY_BW(sub, G, G) @@ ^test_gradcheck$
ops @@ src/ops/backward.c @@ kiln_neg(kiln_div(kiln_mul(G, X(0)), kiln_mul(X(1), X(1)))) @@ kiln_neg(kiln_div(kiln_mul(G, X(0)), kiln_mul(X(1), X(0)))) @@ ^test_gradcheck$
autograd @@ src/autograd/autograd.c @@ if (held) return kiln_add_(held, g, 1.0); @@ if (held) return kiln_tensor_copy_(held, g); @@ ^test_gradcheck$
autograd @@ src/autograd/autograd.c @@ kiln_tensor_t *sum = kiln_add(*slot, g); @@ kiln_tensor_t *sum = kiln_clone(g); @@ ^test_gradcheck$
graph @@ src/graph/passes.c @@ !memcmp(&o->attrs, &n->attrs, sizeof n->attrs) && @@  @@ ^test_graph$
graph @@ src/graph/passes.c @@ if (d->is_inplace || n->op == KILN_OP_RAND || n->op == KILN_OP_DROPOUT) continue; @@ if (d->is_inplace || n->op == KILN_OP_DROPOUT) continue; @@ ^test_graph$
compile @@ src/compile/codegen_c.c @@ k->acc[a].op == KILN_OP_MAX ? "-INFINITY" : "0.0f"); @@ k->acc[a].op == KILN_OP_MAX ? "0.0f" : "0.0f"); @@ ^test_compile$
compile @@ src/compile/codegen_c.c @@ for (int l = 1; l < 16; l++) a%d += l%d[l]; @@ for (int l = 2; l < 16; l++) a%d += l%d[l]; @@ ^test_compile$
flex @@ src/flex/flex.c @@ #define CAUSAL "q_idx + kv_len - q_len >= kv_idx" @@ #define CAUSAL "q_idx + kv_len - q_len > kv_idx" @@ ^test_flex$
flex @@ src/flex/flex.c @@ CAUSAL " && q_idx + kv_len - q_len - kv_idx < %lld" @@ CAUSAL " && q_idx + kv_len - q_len - kv_idx <= %lld" @@ ^test_flex$
optim @@ src/optim/optim.c @@ return lr_max * (double)(step + 1) / (double)warmup; @@ return lr_max * (double)step / (double)warmup; @@ ^test_nn$
optim @@ src/optim/optim.c @@ if (s == KILN_OK && max_norm > 0 && nrm > max_norm) { @@ if (s == KILN_OK && max_norm > 0 && nrm < max_norm) { @@ ^test_nn$
optim @@ src/optim/optim.c @@ s = kiln_mul_scalar_(o->slot[0][i], o->momentum); @@ s = kiln_mul_scalar_(o->slot[0][i], 1.0 - o->momentum); @@ ^test_nn$
io @@ src/io/safetensors.c @@ if (hlen > file_size - 8) @@ if (hlen > file_size) @@ ^test_safetensors$
io @@ src/io/data.c @@ uint64_t range = len - (size_t)T; @@ uint64_t range = len - (size_t)T + 1; @@ ^test_nn$
io @@ src/io/bpe.c @@ return p->a < q->a; @@ return p->a > q->a; @@ ^test_tokenizer$
nn @@ src/nn/gguf.c @@ int heads[3] = {c->n_head, c->n_kv_head, 0}; @@ int heads[3] = {c->n_head, c->n_head, 0}; @@ ^test_hf$
nn @@ src/nn/hf.c @@ cfg_int(c, "num_key_value_heads", false, g->n_head, &g->n_kv_head) @@ cfg_int(c, "num_kv_heads", false, g->n_head, &g->n_kv_head) @@ ^test_hf$
nn @@ src/nn/gpt.c @@ k = kiln_rope_at_scaled(k, ps->pos, c->rope_theta, &c->rope_scaling); @@ (void)0; @@ ^test_paged$
serve @@ src/serve/sample.c @@ if (cum >= s->top_p) { @@ if (cum > s->top_p) { @@ ^test_sample$
serve @@ src/serve/sample.c @@ if (s->top_k > 0 && s->top_k < V) keep = s->top_k; @@ if (s->top_k > 0 && s->top_k < V) keep = s->top_k + 1; @@ ^test_sample$
serve @@ src/serve/openai.c @@ get(c, o, "temperature", T_NUM, 0, 2, &r->temperature) @@ get(c, o, "temperature", T_NUM, 0, 5, &r->temperature) @@ ^test_openai$
serve @@ src/serve/openai.c @@ if (len < 0 || c == 0xC0 || c == 0xC1 || c > 0xF4) return -1; @@ if (len < 0 || c == 0xC1 || c > 0xF4) return -1; @@ ^test_openai$
serve @@ src/serve/openai.c @@ if (n > 4) return bad(c, "stop", @@ if (n > 5) return bad(c, "stop", @@ ^test_openai$
tools @@ tools/kiln.c @@ if (!strcmp(a, "--help") || !strcmp(a, "-h")) { @@ if (!strcmp(a, "-h")) { @@ ^test_cli$
tools @@ tools/cmd_train.c @@ if (ints[i].v < ints[i].lo || ints[i].v > (1 << 24)) { @@ if (ints[i].v < ints[i].lo) { @@ ^test_cli$
EOF
}

# The rest is one function, read whole before it runs, so that editing this file while
# it runs (the list, say) does not change the run.
main() {
here=$(cd "$(dirname "$0")/.." && pwd)
scratch=${KILN_MUTATE_DIR:-/tmp/kiln-mutate-${USER:-$(id -u)}}
cmake_flags=${KILN_MUTATE_CMAKE:--DCMAKE_BUILD_TYPE=Release -DKILN_BLAS=OPENBLAS}
jobs=${KILN_MUTATE_JOBS:-$(nproc)}
limit=${KILN_MUTATE_TIMEOUT:-900}
sep=' @@ '

field() { # field N of record $2
  printf '%s\n' "$2" | awk -F "$sep" -v n="$1" '{ print $n }'
}
count=$(mutants | grep -c .)
record() { mutants | sed -n "${1}p"; }

full=0 list=0 show=0
picked=""
for a in "$@"; do
  case $a in
    --full) full=1 ;;
    --list) list=1 ;;
    --show) show=1 ;;
    -h | --help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *[!0-9]* | '') echo "mutate: unknown argument '$a' (--list, --show N, --full, or mutant numbers 1..$count)" >&2; exit 2 ;;
    *)
      if [ "$a" -lt 1 ] || [ "$a" -gt "$count" ]; then echo "mutate: no mutant $a (1..$count)" >&2; exit 2; fi
      picked="$picked $a" ;;
  esac
done
[ -n "$picked" ] || picked=$(seq 1 "$count")

if [ "$list" = 1 ]; then
  for i in $picked; do
    r=$(record "$i")
    n=$(FROM=$(field 3 "$r") perl -0ne '$n = () = /\Q$ENV{FROM}\E/g; print $n' "$here/$(field 2 "$r")" 2>/dev/null)
    warn=""
    [ "${n:-0}" = 1 ] || warn="  (its line occurs ${n:-0} times here: fix the record)"
    printf '%3d  %-13s %-32s %s%s\n' "$i" "$(field 1 "$r")" "$(field 2 "$r")" "$(field 5 "$r")" "$warn"
  done
  exit 0
fi
if [ "$show" = 1 ]; then
  for i in $picked; do
    r=$(record "$i")
    printf '%d (%s, %s; caught by %s)\n  - %s\n  + %s\n' "$i" "$(field 1 "$r")" "$(field 2 "$r")" "$(field 5 "$r")" \
      "$(field 3 "$r")" "$(field 4 "$r")"
  done
  exit 0
fi

# The scratch copy: this tree's files with their mtimes, then the files the last run
# mutated touched, so that make rebuilds them whatever mtime the copy gave them.
mkdir -p "$scratch/src" || exit 1
echo "mutate: copying $here to $scratch/src"
(cd "$here" && git ls-files -z -c -o --exclude-standard | tar --null -T - -cf -) | (cd "$scratch/src" && tar -xf -) || exit 1
if [ -f "$scratch/dirty" ]; then
  while read -r f; do [ -f "$scratch/src/$f" ] && touch "$scratch/src/$f"; done <"$scratch/dirty"
  rm -f "$scratch/dirty"
fi
build="$scratch/build"
# shellcheck disable=SC2086 # cmake_flags is a list of flags
cmake -S "$scratch/src" -B "$build" $cmake_flags >/dev/null || exit 1
[ -e "$here/build/venv" ] && [ ! -e "$build/venv" ] && ln -s "$(cd "$here/build/venv" && pwd -P)" "$build/venv"
echo "mutate: building the unmutated copy"
if ! cmake --build "$build" -j "$jobs" >"$scratch/build.log" 2>&1; then
  tail -20 "$scratch/build.log"
  echo "mutate: the unmutated tree does not build" >&2
  exit 1
fi

caught=0 missed=0 broken=0 table=""
for i in $picked; do
  r=$(record "$i")
  room=$(field 1 "$r") file=$(field 2 "$r") regex=$(field 5 "$r")
  src="$scratch/src/$file"
  n=$(FROM=$(field 3 "$r") perl -0ne '$n = () = /\Q$ENV{FROM}\E/g; print $n' "$src" 2>/dev/null)
  if [ "${n:-0}" != 1 ]; then
    result="NOT-APPLIED (the line occurs ${n:-0} times in $file)"
    broken=$((broken + 1))
  else
    cp "$src" "$scratch/original"
    echo "$file" >>"$scratch/dirty"
    FROM=$(field 3 "$r") TO=$(field 4 "$r") perl -0pi -e 's/\Q$ENV{FROM}\E/$ENV{TO}/' "$src"
    if ! cmake --build "$build" -j "$jobs" >"$scratch/build.log" 2>&1; then
      result="BUILD-FAILED (see $scratch/build-$i.log)"
      broken=$((broken + 1))
      cp "$scratch/build.log" "$scratch/build-$i.log"
    elif [ "$full" = 0 ] && [ "$(ctest --test-dir "$build" -N -R "$regex" | sed -n 's/^Total Tests: //p')" = 0 ]; then
      result="NO-TESTS (nothing matches $regex)"
      broken=$((broken + 1))
    else
      if [ "$full" = 1 ]; then
        timeout "$limit" ctest --test-dir "$build" -j "$jobs" --output-on-failure >"$scratch/test-$i.log" 2>&1
      else
        timeout "$limit" ctest --test-dir "$build" -R "$regex" --output-on-failure >"$scratch/test-$i.log" 2>&1
      fi
      rc=$?
      if [ "$rc" = 0 ]; then
        result="MISSED"
        missed=$((missed + 1))
      else
        failed=$(sed -n 's/^[[:space:]]*[0-9]* - \([^ ]*\) .*/\1/p' "$scratch/test-$i.log" | tr '\n' ' ' | sed 's/ *$//')
        [ "$rc" = 124 ] && failed="$failed(timed out)"
        result="CAUGHT by ${failed:-ctest rc $rc}"
        caught=$((caught + 1))
      fi
    fi
    cp "$scratch/original" "$src" && touch "$src"
  fi
  line=$(printf '%3d  %-12s %-32s %s' "$i" "$room" "$file" "$result")
  echo "$line"
  table="$table$line
"
done
total=$((caught + missed + broken))
echo
printf '%s' "$table"
echo "mutate: $caught caught, $missed missed, $broken not run, of $total"
[ "$missed" = 0 ] && [ "$broken" = 0 ]
}

main "$@"
exit $?

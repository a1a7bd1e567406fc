#!/bin/sh
# Config S training step, compiled: kiln eager, kiln --compile (the whole step as one
# graph), PyTorch 2.x eager and torch.compile (inductor, cpu), side by side in one run,
# each at 1 and 2 threads, interleaved over ROUNDS rounds. Prints every figure, each
# engine's best median tokens/s and thread count, the ratios kiln-compile / kiln eager
# and kiln-compile / torch.compile, the first-step (compile) times and peak RSS.
#   sh bench/train_step_compile.sh [BUILD_DIR] [ROUNDS] [STEPS]
# PyTorch 2.x comes from PyPI (Debian's python3-torch is 1.13, without torch.compile):
#   python3 -m venv ~/torch2 && ~/torch2/bin/pip install torch numpy
#   TORCH2_PY=~/torch2/bin/python sh bench/train_step_compile.sh
# The kiln kernel cache is a fresh folder, so kiln's first step in the first round is a
# cold compile and later ones load from the cache (warm); torch keeps its own cache
# under /tmp/torchinductor_$USER.
set -eu
build=${1:-build}
rounds=${2:-2}
steps=${3:-10}
py=${TORCH2_PY:-python3}
if ! "$py" -c 'import sys, torch; sys.exit(int(torch.__version__.split(".")[0]) < 2)' 2>/dev/null; then
    echo "train_step_compile.sh: $py has no PyTorch 2.x; set TORCH2_PY (see the comment at the top)" >&2
    exit 2
fi
out=$(mktemp)
cache=$(mktemp -d)
for r in $(seq "$rounds"); do
    for t in 1 2; do
        "$build/bench_train_step" --threads "$t" --steps "$steps" --warmup 2 | tee -a "$out"
        KILN_CACHE_DIR=$cache "$build/bench_train_step" --threads "$t" --steps "$steps" --warmup 2 --compile | tee -a "$out"
        "$py" -W ignore tests/reference/train_step_torch.py --threads "$t" --steps "$steps" --warmup 2 2>/dev/null | tee -a "$out"
        "$py" -W ignore tests/reference/train_step_torch.py --threads "$t" --steps "$steps" --warmup 2 --compile 2>/dev/null | tee -a "$out"
    done
done
"$py" - "$out" <<'PY'
import json, sys, statistics
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
def name(r):
    return r.get("engine") or r.get("impl")
res = {}
for e in ("kiln", "kiln-compile", "torch-eager", "torch-compile"):
    by = {}
    for r in rows:
        if name(r) == e:
            by.setdefault(r["threads"], []).append(r["tokens_per_s"])
    med = {t: statistics.median(v) for t, v in by.items()}
    t = max(med, key=med.get)
    first = [r["first_step_s"] for r in rows if name(r) == e]
    rss = max(r.get("peak_rss_mb", r.get("peak_rss_mib", 0)) for r in rows if name(r) == e)
    res[e] = med[t]
    print(f"{e:14s} median tokens/s by threads {med}; best {med[t]:.0f} at {t} thread(s); first step "
          f"{first[0]:.2f} s cold, {min(first):.2f} s best; peak RSS {rss:.0f} MiB")
print(f"ratio kiln-compile / kiln eager     = {res['kiln-compile'] / res['kiln']:.2f}")
print(f"ratio kiln-compile / torch.compile  = {res['kiln-compile'] / res['torch-compile']:.2f}")
print(f"ratio torch.compile / torch eager   = {res['torch-compile'] / res['torch-eager']:.2f}")
PY
rm -rf "$out" "$cache"

#!/bin/sh
# A recorded replay on a device as a launch list and as the device's own graph
# (KILN_OPT_DEVICE_GRAPHS=0 / 1), each beside eager dispatch in the same process, ROUNDS
# runs of each, interleaved; prints each run's JSON and the medians' ratios.
#   sh bench/device_graph.sh [BUILD_DIR] [ROUNDS] [bench_device_graph flags...]
set -eu
build=${1:-build}
rounds=${2:-3}
[ $# -ge 2 ] && shift 2 || shift $#
out=$(mktemp)
i=0
while [ "$i" -lt "$rounds" ]; do
  for o in 0 1; do
    KILN_OPT_DEVICE_GRAPHS=$o "$build/bench_device_graph" "$@" | tee -a "$out"
  done
  i=$((i + 1))
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for native in (False, True):
    r = [x for x in rows if x["native"] == native]
    if not r:
        continue
    e = statistics.median(x["eager_ms"] for x in r)
    p = statistics.median(x["replay_ms"] for x in r)
    print(f"{'device graph' if native else 'launch list '}: eager {e:.4f} ms, replay {p:.4f} ms, "
          f"eager/replay {e / p:.2f} ({r[0]['launches']} launches on {r[0]['device']})")
PY
rm -f "$out"

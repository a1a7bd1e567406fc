#!/bin/sh
# On a machine with an NVIDIA GPU: builds kiln, runs the conformance suite on cuda:0
# (the op, autograd, model, graph and PyTorch-alignment tests with every tensor on the
# GPU; test_amp_cuda checks the bf16 and f16 matmuls) and the config S training step on
# cuda:0 beside the cpu, then in bf16 on cuda:0, in well under 10 minutes.
#   sh bench/gpu.sh [BUILD_DIR]
# Prints the test summary, the two bench_train_step JSON lines and their ratio.
set -eu
build=${1:-build-gpu}
start=$(date +%s)
nvidia-smi -L || { echo "gpu.sh: no NVIDIA GPU here (nvidia-smi failed)"; exit 2; }
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)" >/dev/null
"$build/kiln" doctor | sed -n '/devices:/,/distributed/p'
"$build/kiln" doctor --ops cuda:0 | tail -1
ctest --test-dir "$build" -R '_cuda$|test_backends' --output-on-failure -j 4 || true
out=$(mktemp)
"$build/bench_train_step" --device cuda:0 --steps 20 --warmup 3 | tee -a "$out"
"$build/bench_train_step" --device cpu --steps 10 --warmup 2 | tee -a "$out"
# bf16 on the GPU (cublasGemmEx for the matmuls; the rest as issue 25 left it)
"$build/bench_train_step" --device cuda:0 --steps 20 --warmup 3 --precision bf16 || true
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
by = {r["device"]: r for r in rows}
g, c = by.get("cuda:0"), by.get("cpu")
if g and c:
    print(f"config S: cuda:0 {g['tokens_per_s']:.0f} tokens/s, cpu {c['tokens_per_s']:.0f}; ratio {g['tokens_per_s'] / c['tokens_per_s']:.2f}")
PY
rm -f "$out"
# A replay as a launch list against the same replay as a CUDA graph.
sh bench/device_graph.sh "$build" 2 --device cuda:0 --rows 16 --width 256 --steps 200 --rounds 5 || true
echo "gpu.sh: $(( $(date +%s) - start )) s"

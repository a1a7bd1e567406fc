#!/bin/sh
# Installs what the tests use beyond the build: curl, Chromium and python3-websocket
# (the server's end-to-end tests), Slurm's daemons and srun (tests/dist/test_dist_srun.py
# starts a one-node cluster of its own) and g++ (llama.cpp is built from source) from
# Debian (only what is missing), and a venv at
# BUILD/venv with the openai, tokenizers and gguf packages from PyPI (the server's client
# test, the oracle of tests/tokenizer/, and llama.cpp's GGUF reader for tests/gguf/), and
# llama-cpp-python (llama.cpp, the GGUF tests' peer). Run
# as root on Debian 12.
#   sh scripts/install-test-deps.sh [BUILD_DIR]
set -eu
build=${1:-build}
PKGS="python3 python3-venv curl chromium python3-websocket slurmctld slurmd slurm-client g++"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "kiln: missing Debian packages:$missing (run: sudo apt-get install$missing)" >&2
    exit 1
  fi
  echo "kiln: installing$missing"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
if [ ! -x "$build/venv/bin/python" ] || ! "$build/venv/bin/python" -c "import openai, tokenizers, gguf" 2>/dev/null; then
  mkdir -p "$build"
  py=/usr/bin/python3
  [ -x "$py" ] || py=python3
  [ -x "$build/venv/bin/python" ] || "$py" -m venv --system-site-packages "$build/venv"
  "$build/venv/bin/pip" install -q --disable-pip-version-check openai tokenizers gguf
fi
# llama.cpp itself, the peer of kiln's GGUF support (tests/gguf/test_gguf_load.py compares
# its logits with kiln's). PyPI has it as source only: pip builds llama.cpp with CMake
# (about 10 minutes on two cores, once: pip keeps the wheel it built in its cache). A
# build that fails is said and not fatal: the checks that need it then say "not run",
# and are never counted as passed.
if ! "$build/venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
  echo "kiln: building llama-cpp-python for the GGUF tests (once; pip caches the wheel)"
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_CURL=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$build/venv/bin/pip" install -q --disable-pip-version-check "llama-cpp-python==0.3.16" jinja2 ||
    echo "kiln: llama-cpp-python did not build; the checks against llama.cpp will say 'not run'" >&2
fi

#!/bin/sh
# Installs what the tests use beyond the build: curl, Chromium and python3-websocket
# (the server's end-to-end tests), Slurm's daemons and srun (tests/dist/test_dist_srun.py
# starts a one-node cluster of its own) from Debian (only what is missing), and a venv at
# BUILD/venv with the openai, tokenizers and gguf packages from PyPI (the server's client
# test, the oracle of tests/tokenizer/, and llama.cpp's GGUF reader for tests/gguf/). Run
# as root on Debian 12.
#   sh scripts/install-test-deps.sh [BUILD_DIR]
set -eu
build=${1:-build}
PKGS="python3 python3-venv curl chromium python3-websocket slurmctld slurmd slurm-client"
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

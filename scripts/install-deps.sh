#!/bin/sh
# Installs the Debian packages kiln needs to build, test and run its demo, only when
# one is missing. Run as root on Debian 12; elsewhere it names what to install.
set -eu
PKGS="cmake make gcc pkg-config binutils libcmocka-dev libblis-dev libopenblas-dev libjansson-dev libpcre2-dev libutf8proc-dev libmicrohttpd-dev libopenmpi-dev openmpi-bin bible-kjv ocl-icd-opencl-dev opencl-headers pocl-opencl-icd"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "kiln: missing Debian packages:$missing (run: sudo apt-get install$missing)" >&2
  exit 1
fi
echo "kiln: installing$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends $missing >/dev/null

#!/bin/sh
# The backend conformance run: a test binary with every tensor it makes on DEVICE
# (KILN_DEVICE), so that its own oracles (double-precision references, finite
# differences, PyTorch's golden files) check that device. Exits 77, which CTest reports
# as skipped (not passed), with the reason, when this machine has no such device.
#   sh tests/on_device.sh DEVICE TEST_BINARY
set -eu
dev=$1
shift
if ! "${KILN_TOOL:-kiln}" doctor | grep -q "^  $dev:"; then
    echo "skipped: no device $dev on this machine (kiln doctor lists the devices)"
    exit 77
fi
KILN_DEVICE=$dev exec "$@"

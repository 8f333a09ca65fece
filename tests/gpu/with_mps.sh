#!/usr/bin/env bash
# with_mps.sh CMD...: runs CMD (and every process it starts) as a client of an MPS control daemon
# of its own (tests/gpu/mps_lib.sh: pipe and log folders under /tmp/refit-mps-PID), quit after.
#   bash tests/gpu/with_mps.sh .device/bin/cuda_armed_test
cd "$(dirname "$0")/../.." || exit 1
source tests/gpu/mps_lib.sh
start_mps "/tmp/refit-mps-$$" || exit 1
"$@"
rc=$?
stop_mps
exit $rc

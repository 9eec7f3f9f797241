#!/usr/bin/env bash
# CUTLASS / CuTe headers (header-only, from the pinned nvidia-cutlass wheel, 6.4 MB) in
# .carry/cutlass/include (git-ignored), for our sm_90a attention kernels (issue 25,
# src/kernels_sm90/): scripts/setup.sh runs it; re-run cmake after it. The device machine gets
# the compiled kernels in the packed build (scripts/device_pack.sh). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/fetch_wheel_headers.sh nvidia-cutlass "${CUTLASS_VERSION:-4.2.0.0}" \
  cutlass_library/source/include/ .carry/cutlass

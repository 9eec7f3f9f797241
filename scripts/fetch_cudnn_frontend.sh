#!/usr/bin/env bash
# The cuDNN frontend's C++ headers (header-only, from the pinned nvidia-cudnn-frontend wheel) in
# .carry/cudnn_frontend/include (git-ignored), for bench_kernels --op sdpa_fe (issue 25): run it
# on a machine with internet, re-run cmake, and pass the build in `carry` as usual. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/fetch_wheel_headers.sh nvidia-cudnn-frontend "${CUDNN_FRONTEND_VERSION:-1.32.0}" \
  include/ .carry/cudnn_frontend

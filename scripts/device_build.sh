#!/usr/bin/env bash
# Configure and build on the GPU machine (no apt there; python3 carries torch 2.11.0+cu130).
# Gloo's headers travel in the git-ignored .carry/gloo (populate it on a Debian machine with
#   mkdir -p .carry/gloo && (cd /tmp && apt-get download libgloo-dev) && dpkg -x /tmp/libgloo-dev_*.deb .carry/gloo
# and pass .carry/gloo in `carry`). Usage:
#   scripts/device_build.sh [extra cmake args...]      (env: BUILD, TARGETS, COLOSSAL_PYTHON, JOBS)
#   TARGETS="colossal_cli test_nccl" scripts/device_build.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-gpu}
PY=${COLOSSAL_PYTHON:-python3}
GLOO=${COLOSSAL_GLOO_INCLUDE:-$PWD/.carry/gloo/usr/include}
JOBS=${JOBS:-$(nproc)}
if [ ! -f "$GLOO/gloo/config.h" ]; then
  echo "device_build: no Gloo headers under $GLOO -- this build will have no CPU collectives" >&2
fi
"$PY" -c "import torch; print('device_build: torch', torch.__version__, 'cuda', torch.version.cuda)"
GEN="Unix Makefiles"
command -v ninja >/dev/null && GEN=Ninja
cmake -S . -B "$BUILD" -G "$GEN" -DCMAKE_BUILD_TYPE=Release -DCOLOSSAL_PYTHON="$PY" \
  -DCOLOSSAL_GLOO_INCLUDE="$GLOO" -DCOLOSSAL_CUDA_ARCH=90 "$@"
if [ -n "${TARGETS:-}" ]; then
  # shellcheck disable=SC2086
  cmake --build "$BUILD" -j "$JOBS" --target $TARGETS
else
  cmake --build "$BUILD" -j "$JOBS"
fi
echo "device_build: done; try $BUILD/colossal check"

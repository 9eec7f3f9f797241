#!/usr/bin/env bash
# One idempotent set-up step for a fresh Debian machine: apt packages, then the project-local
# Python environment (.venv) holding the pinned torch wheel (its LibTorch is what we build
# against) and the test oracles (transformers, safetensors). `make demo` and `make test` call it.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${COLOSSAL_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}

# libsentencepiece-dev: SentencePiece .model tokenizers; libpcre2-dev, libicu-dev: the
# tokenizer.json pre-tokenizer regex and normalizers; chromium: the headless browser
# tests/app/test_report.py renders `colossal report`'s page in; libprotobuf-dev,
# protobuf-compiler: `train --tensorboard`'s event files (protoc generates their code).
APT_PKGS=(build-essential cmake ninja-build ccache git libgloo-dev libgtest-dev libgmock-dev openmpi-bin
          libsentencepiece-dev libpcre2-dev libicu-dev pkg-config libprotobuf-dev protobuf-compiler
          python3 python3-venv python3-dev chromium)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  echo "[setup] installing apt packages: ${missing[*]}"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

REQ="$ROOT/scripts/requirements.txt"
STAMP="$VENV/.colossal-requirements"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
if ! cmp -s "$REQ" "$STAMP" 2>/dev/null; then
  echo "[setup] installing Python packages (torch==2.11.0 is large: a few minutes the first time)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -r "$REQ"
  cp "$REQ" "$STAMP"
fi
echo "[setup] ok: $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)')"

# The CUTLASS / CuTe headers (pinned wheel, 6.4 MB) when CUDA code is compiled: the sm_90a
# attention kernels (src/kernels_sm90/) build with them. Without network they are skipped and
# the build says so (those kernels are then absent; SDPA serves attention).
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  COLOSSAL_PYTHON="$VENV/bin/python" bash "$ROOT/scripts/fetch_cutlass.sh" ||
    echo "[setup] warning: could not fetch the CUTLASS headers; the sm_90a kernels will not be built"
fi

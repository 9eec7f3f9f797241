#!/usr/bin/env bash
# The cuDNN frontend's C++ headers (header-only, from the pinned nvidia-cudnn-frontend wheel) in
# .carry/cudnn_frontend/include (git-ignored), for bench_kernels --op sdpa_fe (issue 25): run it
# on a machine with internet, re-run cmake, and pass the build in `carry` as usual. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${CUDNN_FRONTEND_VERSION:-1.32.0}
DEST=.carry/cudnn_frontend
if [ -f "$DEST/include/cudnn_frontend.h" ] && [ "$(cat "$DEST/VERSION" 2>/dev/null)" = "$VERSION" ]; then
  echo "cudnn frontend $VERSION already in $DEST"; exit 0
fi
PY=${COLOSSAL_PYTHON:-.venv/bin/python}
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$TMP" "nvidia-cudnn-frontend==$VERSION"
rm -rf "$DEST"; mkdir -p "$DEST"
"$PY" - "$TMP"/nvidia_cudnn_frontend-*.whl "$DEST" <<'PYEOF'
import sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if n.startswith("include/")]
    z.extractall(dest, names)
print("%d headers from %s" % (len(names), whl.rsplit("/", 1)[-1]))
PYEOF
echo "$VERSION" > "$DEST/VERSION"
du -sh "$DEST"

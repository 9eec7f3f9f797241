#!/usr/bin/env bash
# CUTLASS / CuTe headers (header-only, from the pinned nvidia-cutlass wheel, 6.4 MB) in
# .carry/cutlass/include (git-ignored), for our sm_90a attention kernels (issue 25,
# src/kernels/attention_sm90.cu): run it on a machine with internet, re-run cmake; the device
# machine gets the compiled kernels in the packed build (scripts/device_pack.sh). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${CUTLASS_VERSION:-4.2.0.0}
DEST=.carry/cutlass
if [ -f "$DEST/include/cute/tensor.hpp" ] && [ "$(cat "$DEST/VERSION" 2>/dev/null)" = "$VERSION" ]; then
  echo "cutlass $VERSION already in $DEST"; exit 0
fi
PY=${COLOSSAL_PYTHON:-.venv/bin/python}
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$TMP" "nvidia-cutlass==$VERSION"
rm -rf "$DEST"; mkdir -p "$DEST"
"$PY" - "$TMP"/nvidia_cutlass-*.whl "$DEST" <<'PYEOF'
import os, sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
prefix = "cutlass_library/source/include/"
n = 0
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            out = os.path.join(dest, "include", name[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(name) as src, open(out, "wb") as dst:
                dst.write(src.read())
            n += 1
print("%d headers from %s" % (n, whl.rsplit("/", 1)[-1]))
PYEOF
echo "$VERSION" > "$DEST/VERSION"
du -sh "$DEST"

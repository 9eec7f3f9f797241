#!/usr/bin/env bash
# fetch_wheel_headers.sh PACKAGE VERSION PREFIX DEST: the files under PREFIX inside the pinned
# wheel PACKAGE==VERSION (header-only libraries shipped as Python wheels) into DEST/include
# (git-ignored .carry), with DEST/VERSION recording what is there. Idempotent: nothing is
# downloaded when DEST already holds that version. Needs pip and network; run by
# fetch_cutlass.sh and fetch_cudnn_frontend.sh.
set -euo pipefail
[ $# -eq 4 ] || { echo "usage: $0 PACKAGE VERSION PREFIX DEST" >&2; exit 2; }
PACKAGE=$1 VERSION=$2 PREFIX=$3 DEST=$4
if [ -d "$DEST/include" ] && [ "$(cat "$DEST/VERSION" 2>/dev/null)" = "$VERSION" ]; then
  echo "$PACKAGE $VERSION already in $DEST"; exit 0
fi
PY=${COLOSSAL_PYTHON:-.venv/bin/python}
TMP=$(mktemp -d); trap 'rm -rf "$TMP"' EXIT
"$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$TMP" "$PACKAGE==$VERSION"
rm -rf "$DEST"; mkdir -p "$DEST"
"$PY" - "$TMP"/*.whl "$DEST" "$PREFIX" <<'PYEOF'
import os, sys, zipfile
whl, dest, prefix = sys.argv[1], sys.argv[2], sys.argv[3]
n = 0
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            out = os.path.join(dest, "include", name[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(name) as src, open(out, "wb") as dst:
                dst.write(src.read())
            n += 1
if n == 0:
    sys.exit("no files under %s in %s" % (prefix, whl))
print("%d headers from %s" % (n, whl.rsplit("/", 1)[-1]))
PYEOF
echo "$VERSION" > "$DEST/VERSION"
du -sh "$DEST"

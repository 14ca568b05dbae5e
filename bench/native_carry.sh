#!/usr/bin/env bash
# The native front end (--frontend-impl native) as one file to carry to the GPU device machine, whose image has no
# gRPC C++ library: the binary built here (server/native/build.py) and the shared libraries it loads beyond the C
# and C++ runtimes, packed (xz: ~6 MB) into DEST/voxserve-native.tar.xz. bench/device_service.sh unpacks it and
# points VOXSERVE_NATIVE_FRONTEND and LD_LIBRARY_PATH at it.
#
#   bash bench/native_carry.sh [DEST]     then carry DEST (.native) with the device call
set -euo pipefail
DEST=${1:-.native}
PYTHON=${PYTHON:-.venv/bin/python}
binary=$("$PYTHON" -c "from voxserve.server.native import build; print(build.build())")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lib" "$DEST"
cp "$binary" "$work/voxserve-frontend"
# Every library it loads but the C and C++ runtimes (any newer glibc and libstdc++ run what these were built for).
ldd "$binary" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' \
  | grep -v -E '/(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' \
  | while read -r lib; do cp -L "$lib" "$work/lib/"; done
tar -C "$work" -cJf "$DEST/voxserve-native.tar.xz" voxserve-frontend lib
du -h "$DEST/voxserve-native.tar.xz" | awk '{print $1 " in " $2}'

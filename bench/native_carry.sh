#!/usr/bin/env bash
# The native front end (--frontend-impl native) as files to carry to the GPU device machine, whose image has no
# gRPC C++ library: the binary built here (server/native/build.py) and the shared libraries it loads beyond the C
# runtime's, into DEST (.native). bench/device_service.sh uses them (VOXSERVE_NATIVE_FRONTEND, LD_LIBRARY_PATH).
#
#   bash bench/native_carry.sh [DEST]     then carry ".native" with the device call
set -euo pipefail
DEST=${1:-.native}
PYTHON=${PYTHON:-.venv/bin/python}
binary=$("$PYTHON" -c "from voxserve.server.native import build; print(build.build())")
rm -rf "$DEST" && mkdir -p "$DEST/lib"
cp "$binary" "$DEST/voxserve-frontend"
# Every library it loads but the C and C++ runtimes (any newer glibc and libstdc++ run what these were built for).
ldd "$binary" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' \
  | grep -v -E '/(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' \
  | while read -r lib; do cp -L "$lib" "$DEST/lib/"; done
du -sh "$DEST" | awk '{print $1 " in " $2}'

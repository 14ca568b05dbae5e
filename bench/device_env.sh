# Source on the device machine (repository root) to make `voxserve` importable from any directory:
# installs the carried wheels (.whl/) and the package, or lays the package out with links when pip
# cannot install it offline. Used by the device_*.sh scripts.
# .whl-tools/ (what only the tests and probes import: bench/device_wheels.sh) travels only with the calls that need it, so that a
# service benchmark's call has room for its peers.
# It also defines native_frontend_env: the native front end carried in .native/ (bench/native_carry.sh) unpacked, and
# VOXSERVE_NATIVE_FRONTEND and LD_LIBRARY_PATH pointed at it; fails when it is not carried.
native_frontend_env() {
  [ -f .native/voxserve-native.tar.xz ] || return 1
  mkdir -p /tmp/voxserve-native && tar -C /tmp/voxserve-native -xJf .native/voxserve-native.tar.xz || return 1
  export VOXSERVE_NATIVE_FRONTEND=/tmp/voxserve-native/voxserve-frontend
  export LD_LIBRARY_PATH=/tmp/voxserve-native/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $(compgen -G ".whl-tools/*.whl")
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH  # bin: console scripts such as py-spy
fi
if ! python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . 2>&1 | tail -2 \
    || ! python3 -c "import voxserve.server.app" 2>/dev/null; then
  # Offline fallback: lay the namespace out with links (proto/ -> voxserve/proto, ...).
  mkdir -p /tmp/pkg/voxserve
  for f in voxserve/*.py; do ln -sf "$PWD/$f" /tmp/pkg/voxserve/; done
  for d in proto server kernels client; do ln -sfn "$PWD/$d" /tmp/pkg/voxserve/$d; done
  ln -sfn "$PWD/voxserve/testing" /tmp/pkg/voxserve/testing
  export PYTHONPATH=/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import voxserve.server.app, voxserve.kernels; print('voxserve imports ok')" || return 1

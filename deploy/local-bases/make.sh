#!/usr/bin/env bash
# Local stand-ins for the Dockerfile's base images, made without a registry (podman only):
#   localhost/voxserve-base/debian:bookworm-minbase   debootstrap of Debian bookworm (minbase) from the apt mirror
#   localhost/voxserve-base/python:3.11-bookworm      for python:3.12-slim (Debian's Python 3.11 in a venv)
#   localhost/voxserve-base/cuda:13.0-bookworm        for nvidia/cuda:13.0.1-devel-ubuntu24.04 (nvcc from NVIDIA's wheels)
#   localhost/voxserve-base/prometheus:bookworm       for prom/prometheus in deploy/docker-compose.yml (PROMETHEUS_IMAGE)
#
#   deploy/local-bases/make.sh                 make the bases (idempotent: the minbase is made once, the stand-ins
#                                              are podman builds with layer caching, seconds when nothing changed)
#   deploy/local-bases/make.sh --flags [cpu|cuda]
#                                              print the `podman build` flags for the project's Dockerfile on these
#                                              bases: the base and torch build args, and the host's CA bundle and pip
#                                              settings mounted read-only into the build (never copied into an image)
#
# Environment: DEBIAN_MIRROR (default: the first Debian URI in /etc/apt/sources.list*, else deb.debian.org).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

DEBIAN_IMAGE=localhost/voxserve-base/debian:bookworm-minbase
PYTHON_IMAGE=localhost/voxserve-base/python:3.11-bookworm
CUDA_IMAGE=localhost/voxserve-base/cuda:13.0-bookworm
PROMETHEUS_IMAGE=localhost/voxserve-base/prometheus:bookworm

# The host's CA bundle and pip settings as read-only volumes of the build, never copied into an image: outbound
# HTTPS here may pass a proxy with its own CA. The pip settings are the host's effective ones (`pip config list`:
# its files and PIP_* variables) written to one file for /etc/pip.conf, with the local folders they name (find-links,
# file:// indexes, constraints) mounted too. For the CUDA variant find-links are left out, so that PyPI's torch (the
# CUDA build) is not shadowed by a local CPU wheel of the same version.
host_mounts() {
  local variant="$1" conf="$repo/build/local-bases/pip-$1.conf" bundle=/etc/ssl/certs/ca-certificates.crt
  mkdir -p "$(dirname "$conf")"
  # Beside the image's own /etc/ssl/certs (a package installing ca-certificates writes there).
  [ -f "$bundle" ] && echo "-v $bundle:/run/host-ca/ca-certificates.crt:ro"
  python3 - "$variant" "$conf" "$bundle" << 'PY'
import os, re, subprocess, sys
variant, conf, bundle = sys.argv[1:]
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
settings: dict = {}
for line in listed.splitlines():
    m = re.fullmatch(r"(:env:|global|install|download)\.([\w-]+)='(.*)'", line)
    if m and (m[1] == ":env:" or m[2] not in settings):   # PIP_* variables win over files, as in pip
        settings[m[2]] = m[3]
for key in ("cert", "client-cert"):
    if settings.get(key) == bundle:
        settings[key] = "/run/host-ca/ca-certificates.crt"
if variant == "cuda":
    settings.pop("find-links", None)
with open(conf, "w") as f:
    f.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in settings.items()))
print(f"-v {conf}:/etc/pip.conf:ro")
tops = set()
for value in settings.values():
    for path in re.findall(r"(?:file://)?(/[\w.+/-]+)", value):
        parts = path.split("/")
        # a file under /etc as itself; elsewhere the folder two levels down (an index links to ../../files)
        top = path if path.startswith("/etc/") or len(parts) < 3 else "/".join(parts[:3])
        if os.path.exists(top) and top != bundle and not top.startswith(("/proc", "/sys", "/dev")):
            tops.add(top)
for top in sorted(tops):
    print(f"-v {top}:{top}:ro")
PY
}

if [ "${1:-}" = --flags ]; then
  variant="${2:-cpu}"
  torch_spec="$(sed -n 's/^ARG TORCH_SPEC=//p' "$repo/Dockerfile" | tr -d '"')"
  [ "$variant" = cpu ] && torch_spec="${torch_spec}+cpu"
  # --jobs 2: the kernel stage (nvcc) and the Python stage (torch) build at the same time.
  echo "--pull=never --jobs 2 --build-arg PYTHON_BASE=$PYTHON_IMAGE --build-arg CUDA_BASE=$CUDA_IMAGE" \
       "--build-arg TORCH_SPEC=$torch_spec" $(host_mounts "$variant")
  exit 0
fi

command -v podman > /dev/null || { echo "make.sh: podman is not installed" >&2; exit 1; }

if ! podman image exists "$DEBIAN_IMAGE"; then
  command -v debootstrap > /dev/null || { echo "make.sh: debootstrap is not installed" >&2; exit 1; }
  mirror="${DEBIAN_MIRROR:-$(grep -rhoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ \
                             2> /dev/null | head -1 | tr -d ' ' || true)}"
  mirror="${mirror:-http://deb.debian.org/debian}"
  rootfs="$(mktemp -d)"
  trap 'rm -rf "$rootfs"' EXIT
  echo "make.sh: debootstrap bookworm (minbase) from $mirror" >&2
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" > "$rootfs.log" 2>&1 \
    || { tail -20 "$rootfs.log" >&2; exit 1; }
  rm -f "$rootfs.log"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$DEBIAN_IMAGE" > /dev/null
fi

# The three at once (each waits on apt, pip or dpkg in turn); any failure fails the script.
pids=() mounts="$(host_mounts cpu)"
for base in python:"$PYTHON_IMAGE" cuda:"$CUDA_IMAGE" prometheus:"$PROMETHEUS_IMAGE"; do
  # shellcheck disable=SC2086  # the mounts are words
  podman build -q --pull=never --layers $mounts -f "$here/${base%%:*}.Containerfile" -t "${base#*:}" \
    "$here" > /dev/null &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
echo "make.sh: $PYTHON_IMAGE, $CUDA_IMAGE and $PROMETHEUS_IMAGE are ready" >&2

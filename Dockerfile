# voxserve image: the fused kernel and the native front end are compiled at image build time (nvcc and g++, no GPU
# needed) and the runtime image carries only Python, the CUDA build of PyTorch, the kernel library and the native
# front end with gRPC's C++ runtime libraries.
#   docker build -t voxserve .
#   docker run --gpus all -p 8000:8000 -p 8001:8001 -p 8002:8002 voxserve
# Without a GPU the same image serves on the CPU. Minimum NVIDIA driver on the host: 580.65.06 (CUDA 13.0).
# The bases are build arguments so that a registry-free build can name local stand-ins
# (deploy/local-bases/make.sh); the defaults are the real images.
ARG CUDA_BASE=nvidia/cuda:13.0.1-devel-ubuntu24.04
ARG PYTHON_BASE=python:3.12-slim

FROM ${CUDA_BASE} AS kernel
# Flags mirror kernels/build.py (NVCC_FLAGS, arch_flags): Ampere, Hopper with its arch-specific
# instructions (the wgmma kernel; VOXSERVE_WGMMA enables it), and PTX for newer GPUs.
ARG CUDA_GENCODE="-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=compute_90 -DVOXSERVE_WGMMA"
COPY kernels/csrc/fused.cu /src/fused.cu
# --threads 0: the targets compile in parallel (the same output).
RUN mkdir /out && nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC -lineinfo -split-compile=0 --threads 0 ${CUDA_GENCODE} \
      -o /out/libvoxserve_fused.so /src/fused.cu

# The native front end (--frontend-impl native), built as server/native/build.py builds it on a host.
FROM ${PYTHON_BASE} AS native
# DL3008: the versions are Debian bookworm's, the same release as the runtime's libraries below.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ pkg-config libgrpc++-dev libprotobuf-dev \
      protobuf-compiler-grpc libssl-dev && rm -rf /var/lib/apt/lists/*
COPY proto /src/proto
COPY server/native /src/server/native
RUN mkdir /out && VOXSERVE_NATIVE_CACHE=/tmp/native python3 -c "import runpy, shutil; \
      shutil.copy(runpy.run_path('/src/server/native/build.py')['build'](), '/out/voxserve-frontend')"

FROM ${PYTHON_BASE}
RUN useradd --create-home --uid 10001 voxserve
# The native front end's libraries (gRPC's C++ library and protobuf, as the build stage linked them).
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends libgrpc++1.51 libprotobuf32 \
      && rm -rf /var/lib/apt/lists/*
# PyPI's torch for Linux x86_64 is the CUDA build and carries its own CUDA libraries; the driver comes from the
# host through the NVIDIA container runtime. TORCH_SPEC is used in the RUN, so it is part of that layer's cache
# key: a build for another torch (torch==2.13.0+cpu from a CPU index) never reuses this layer. Its own layer,
# before the sources, so that a change to the code does not install torch again.
ARG TORCH_SPEC="torch==2.13.0"
# DL3013: the version is in TORCH_SPEC.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir "${TORCH_SPEC}"
WORKDIR /opt/voxserve
COPY pyproject.toml README.md ./
COPY voxserve voxserve
COPY proto proto
COPY server server
COPY kernels kernels
COPY client client
# The tracing extra too: --tracing then works in the image (OpenTelemetry is imported only when it is on).
# DL3013: "." is this project from source; its dependency ranges are in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[server,tracing]"
COPY --from=kernel /out/libvoxserve_fused.so /opt/voxserve/lib/libvoxserve_fused.so
COPY --from=native /out/voxserve-frontend /opt/voxserve/bin/voxserve-frontend
ENV VOXSERVE_KERNEL_LIBRARY=/opt/voxserve/lib/libvoxserve_fused.so \
    VOXSERVE_NATIVE_FRONTEND=/opt/voxserve/bin/voxserve-frontend \
    PYTHONUNBUFFERED=1
USER 10001
EXPOSE 8000 8001 8002
# The port the server listens on: VOXSERVE_GRPC_PORT when set (the environment twin of --grpc-port), else 8001.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s \
  CMD ["sh", "-c", "exec voxserve health --url \"localhost:${VOXSERVE_GRPC_PORT:-8001}\" --timeout-s 3"]
ENTRYPOINT ["voxserve", "serve"]

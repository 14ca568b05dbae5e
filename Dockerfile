# voxserve image: the fused kernel is compiled at image build time (nvcc, no GPU needed) and the
# runtime image carries only Python, the CUDA build of PyTorch and the kernel library.
#   docker build -t voxserve .
#   docker run --gpus all -p 8001:8001 -p 8002:8002 voxserve
# Without a GPU the same image serves on the CPU.

FROM nvidia/cuda:13.0.1-devel-ubuntu24.04 AS kernel
# Flags mirror kernels/build.py (NVCC_FLAGS, arch_flags): Ampere, Hopper with its arch-specific
# instructions (the wgmma kernel; VOXSERVE_WGMMA enables it), and PTX for newer GPUs.
ARG CUDA_GENCODE="-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=compute_90 -DVOXSERVE_WGMMA"
COPY kernels/csrc/fused.cu /src/fused.cu
RUN mkdir /out && nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC -lineinfo -split-compile=0 ${CUDA_GENCODE} \
      -o /out/libvoxserve_fused.so /src/fused.cu

FROM python:3.12-slim
RUN useradd --create-home --uid 10001 voxserve
WORKDIR /opt/voxserve
COPY pyproject.toml README.md ./
COPY voxserve voxserve
COPY proto proto
COPY server server
COPY kernels kernels
COPY client client
# The CUDA build of PyTorch from PyPI carries its own CUDA libraries; the driver comes from the host
# through the NVIDIA container runtime.
ARG TORCH_VERSION=2.13.0
# DL3013: "." is this project from source; its dependency ranges are in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" ".[server]"
COPY --from=kernel /out/libvoxserve_fused.so /opt/voxserve/lib/libvoxserve_fused.so
ENV VOXSERVE_KERNEL_LIBRARY=/opt/voxserve/lib/libvoxserve_fused.so \
    PYTHONUNBUFFERED=1
USER 10001
EXPOSE 8001 8002
# The port the server listens on: VOXSERVE_GRPC_PORT when set (the environment twin of --grpc-port), else 8001.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s \
  CMD ["sh", "-c", "exec voxserve health --url \"localhost:${VOXSERVE_GRPC_PORT:-8001}\" --timeout-s 3"]
ENTRYPOINT ["voxserve", "serve"]

"""voxserve's client library: typed sync and asyncio clients over the Open Inference Protocol."""

from .client import AsyncClient, Client, InferenceError, build_request, build_shm_request, parse_response
from .cuda import CudaArray, CudaBuffer, CudaError, CudaRegion, CudaUnavailable
from .shm import SharedMemoryBuffer

__all__ = ["AsyncClient", "Client", "CudaArray", "CudaBuffer", "CudaError", "CudaRegion", "CudaUnavailable",
           "InferenceError", "SharedMemoryBuffer", "build_request", "build_shm_request", "parse_response"]

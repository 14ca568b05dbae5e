"""voxserve's client library: typed sync and asyncio clients over the Open Inference Protocol."""

from .client import AsyncClient, Client, InferenceError, build_request, build_shm_request, parse_response
from .shm import SharedMemoryBuffer

__all__ = ["AsyncClient", "Client", "InferenceError", "SharedMemoryBuffer", "build_request", "build_shm_request",
           "parse_response"]

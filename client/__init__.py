"""voxserve's client library: typed sync and asyncio clients over the Open Inference Protocol."""

from .client import AsyncClient, Client, InferenceError, build_request, parse_response

__all__ = ["AsyncClient", "Client", "InferenceError", "build_request", "parse_response"]

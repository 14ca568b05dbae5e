"""A small typed client for voxserve (or any Open Inference Protocol server), sync and asyncio.

    from voxserve.client import Client
    with Client("localhost:8001") as c:
        probs = c.infer(x)          # x: (N, Cin, D, H, W) float array -> (N, Cout) float32

Needs only grpcio, protobuf and numpy.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

import grpc
import numpy as np

from voxserve.datatypes import INPUT_DATATYPES, ITEMSIZE, from_wire, to_wire
from voxserve.proto import pb, pb_grpc

from .cuda import CudaArray, CudaRegion, locate, synchronize
from .security import PLAINTEXT, Credentials

DEFAULT_MODEL = "voxnet"
DEFAULT_MAX_MESSAGE_BYTES = 512 * 1024 * 1024


class InferenceError(Exception):
    """A failed RPC: the gRPC status code and the server's message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError) -> InferenceError:
        return cls(exc.code(), exc.details() or "")  # type: ignore[attr-defined]


def _channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # A connection of its own per channel (gRPC otherwise shares one between channels to the same address
        # in a process): with a server of several replicas (--replicas), each connection is served by one.
        ("grpc.use_local_subchannel_pool", 1),
    ]


def build_request(x: np.ndarray, model: str, datatype: str, request_id: str = "") -> pb.ModelInferRequest:
    """A ModelInferRequest carrying ``x`` as raw bytes of ``datatype`` (FP32, FP16 or BF16)."""
    if datatype not in INPUT_DATATYPES:
        raise ValueError(f"datatype must be one of {INPUT_DATATYPES}; got {datatype!r}")
    x = np.asarray(x)
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="input", datatype=datatype, shape=list(x.shape))
    request.outputs.add(name="output")
    request.raw_input_contents.append(to_wire(x, datatype))
    return request


def parse_response(response: pb.ModelInferResponse, name: str = "output") -> np.ndarray:
    """The named output of a response as a float32 array (raw or typed contents)."""
    for i, tensor in enumerate(response.outputs):
        if tensor.name != name:
            continue
        shape = tuple(tensor.shape)
        if response.raw_output_contents:
            return from_wire(response.raw_output_contents[i], tensor.datatype, shape).copy()
        return np.asarray(tensor.contents.fp32_contents, dtype=np.float32).reshape(shape)
    raise ValueError(f"response has no output named {name!r}")


def build_shm_request(shape: tuple[int, ...], model: str, datatype: str, input_region: str, input_offset: int = 0,
                      output_region: str | None = None, output_offset: int = 0,
                      output_byte_size: int | None = None) -> pb.ModelInferRequest:
    """A ModelInferRequest whose input (and optionally output) lives in registered system shared memory.
    With ``output_region``, ``output_byte_size`` is required: the protocol has every shared-memory tensor state
    its size (N x Cout x 4 bytes for this model's FP32 output)."""
    if datatype not in INPUT_DATATYPES:
        raise ValueError(f"datatype must be one of {INPUT_DATATYPES}; got {datatype!r}")
    if output_region is not None and output_byte_size is None:
        raise ValueError("output_byte_size is required with output_region (the protocol requires "
                         "shared_memory_byte_size on every shared-memory tensor)")
    request = pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add(name="input", datatype=datatype, shape=list(shape))
    tensor.parameters["shared_memory_region"].string_param = input_region
    tensor.parameters["shared_memory_offset"].int64_param = input_offset
    tensor.parameters["shared_memory_byte_size"].int64_param = int(np.prod(shape)) * ITEMSIZE[datatype]
    out = request.outputs.add(name="output")
    if output_region is not None:
        out.parameters["shared_memory_region"].string_param = output_region
        out.parameters["shared_memory_offset"].int64_param = output_offset
        out.parameters["shared_memory_byte_size"].int64_param = int(output_byte_size)  # type: ignore[arg-type]
    return request


# The shared-memory extensions' calls, shared by Client and AsyncClient: (method, request) to send, and the answer
# read back.

def _system_register(name: str, key: str, byte_size: int, offset: int) -> tuple[str, Any]:
    return "SystemSharedMemoryRegister", pb.SystemSharedMemoryRegisterRequest(name=name, key=key, offset=offset,
                                                                              byte_size=byte_size)


def _system_unregister(name: str) -> tuple[str, Any]:
    return "SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest(name=name)


def _system_status(name: str) -> tuple[str, Any]:
    return "SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest(name=name)


def _system_regions(response: pb.SystemSharedMemoryStatusResponse) -> dict[str, tuple[str, int, int]]:
    return {n: (r.key, r.offset, r.byte_size) for n, r in response.regions.items()}


def _cuda_register(name: str, raw_handle: bytes, device_id: int, byte_size: int) -> tuple[str, Any]:
    return "CudaSharedMemoryRegister", pb.CudaSharedMemoryRegisterRequest(name=name, raw_handle=raw_handle,
                                                                          device_id=device_id, byte_size=byte_size)


def _cuda_unregister(name: str) -> tuple[str, Any]:
    return "CudaSharedMemoryUnregister", pb.CudaSharedMemoryUnregisterRequest(name=name)


def _cuda_status(name: str) -> tuple[str, Any]:
    return "CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest(name=name)


def _cuda_regions(response: pb.CudaSharedMemoryStatusResponse) -> dict[str, tuple[int, int]]:
    return {n: (r.device_id, r.byte_size) for n, r in response.regions.items()}


def _cuda_infer(input: CudaArray, output: CudaArray | None, synchronize_device: bool) -> dict[str, Any]:
    """``infer_shared_memory``'s arguments for ``infer_cuda`` (after the device's work, if asked to wait for it)."""
    if output is not None and output.datatype != "FP32":
        raise ValueError(f"the output is FP32; the output array is {output.datatype}")
    if synchronize_device:
        synchronize(input.device_id)
    return {"shape": input.shape, "input_region": input.region, "datatype": input.datatype,
            "input_offset": input.offset, "output_region": None if output is None else output.region,
            "output_offset": 0 if output is None else output.offset,
            "output_byte_size": None if output is None else output.byte_size}


class Client:
    """Blocking client over one gRPC channel (plaintext, or TLS/mTLS/token per ``credentials``)."""

    def __init__(self, url: str, model: str = DEFAULT_MODEL, timeout_s: float | None = 60.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, credentials: Credentials | None = None) -> None:
        self.model = model
        self.timeout_s = timeout_s
        self.credentials = credentials or PLAINTEXT
        self._metadata = self.credentials.metadata()
        self._channel = self.credentials.channel(url, _channel_options(max_message_bytes))
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)
        self._width: int | None = None

    def _call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise InferenceError.from_rpc(exc) from None

    def infer(self, x: np.ndarray, datatype: str = "FP32") -> np.ndarray:
        """Run the model on ``x`` (N, Cin, D, H, W); returns (N, Cout) float32."""
        return parse_response(self._call("ModelInfer", build_request(x, self.model, datatype)))

    def infer_shared_memory(self, shape: tuple[int, ...], input_region: str, *, datatype: str = "FP32",
                            input_offset: int = 0, output_region: str | None = None,
                            output_offset: int = 0, output_byte_size: int | None = None) -> np.ndarray | None:
        """Infer on an input already in a registered region; the output comes back in the response, or is
        written to output_region (then None is returned). ``output_byte_size`` defaults to the output's own
        size, N x (the model's output width, from its metadata) x 4 bytes."""
        if output_region is not None and output_byte_size is None:
            output_byte_size = shape[0] * self._output_width() * 4
        response = self._call("ModelInfer", build_shm_request(shape, self.model, datatype, input_region, input_offset,
                                                              output_region, output_offset, output_byte_size))
        return None if output_region is not None else parse_response(response)

    def register_system_shared_memory(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        self._call(*_system_register(name, key, byte_size, offset))

    def unregister_system_shared_memory(self, name: str = "") -> None:
        """Unregister one region, or all of them when name is empty."""
        self._call(*_system_unregister(name))

    def system_shared_memory_status(self, name: str = "") -> dict[str, tuple[str, int, int]]:
        """{region name: (key, offset, byte_size)}."""
        return _system_regions(self._call(*_system_status(name)))

    def register_cuda_shared_memory(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Register ``byte_size`` bytes of device memory by its CUDA IPC handle (the 64 bytes of
        ``cudaIpcGetMemHandle``, exported by this process, never the server's) on GPU ``device_id``; reference it
        from inputs and outputs by name as a system region (``infer_shared_memory``): the server reads the input
        where it lies and writes the output there."""
        self._call(*_cuda_register(name, raw_handle, device_id, byte_size))

    def register_cuda_region(self, name: str, region: CudaRegion) -> None:
        """Register a device allocation of this process (``CudaBuffer.region``, ``cuda.region_of``) as ``name``."""
        self.register_cuda_shared_memory(name, region.raw_handle, region.device_id, region.byte_size)

    def register_cuda_array(self, name: str, array: Any) -> CudaArray:
        """Register the device allocation that ``array`` lies in (a torch CUDA tensor, or anything with
        ``__cuda_array_interface__``; C-contiguous) as region ``name``, and return where the array lies in it: for
        ``infer_cuda`` as an input or an output. The whole allocation is registered (a server maps allocations),
        so arrays in one allocation may share one region: register one, ``cuda.locate(other, name)`` the others.
        Needs cuda-bindings (``voxserve[cuda]``)."""
        region, where = locate(array, name)
        self.register_cuda_region(name, region)
        return where

    def infer_cuda(self, input: CudaArray, output: CudaArray | None = None, *,
                   synchronize_device: bool = True) -> np.ndarray | None:
        """Infer on an input in a registered CUDA region (``register_cuda_array``); the output is written into
        ``output`` (an FP32 array of N x Cout in a registered region; then None is returned), or comes back in the
        response. ``synchronize_device``: first wait for this process's work on the device, so that what was
        written into the input (on any stream) is there when the server reads it."""
        return self.infer_shared_memory(**_cuda_infer(input, output, synchronize_device))

    def unregister_cuda_shared_memory(self, name: str = "") -> None:
        """Unregister one CUDA region, or all of them when name is empty (the server unmaps each once the
        requests reading it are done)."""
        self._call(*_cuda_unregister(name))

    def cuda_shared_memory_status(self, name: str = "") -> dict[str, tuple[int, int]]:
        """{region name: (device_id, byte_size)}."""
        return _cuda_regions(self._call(*_cuda_status(name)))

    def is_live(self) -> bool:
        return bool(self._call("ServerLive", pb.ServerLiveRequest()).live)

    def is_ready(self) -> bool:
        """Server and model ready; False (not an exception) when the server cannot be reached."""
        try:
            return bool(self._call("ServerReady", pb.ServerReadyRequest()).ready) and bool(
                self._call("ModelReady", pb.ModelReadyRequest(name=self.model)).ready)
        except InferenceError:
            return False

    def server_metadata(self) -> pb.ServerMetadataResponse:
        return self._call("ServerMetadata", pb.ServerMetadataRequest())

    def model_metadata(self) -> pb.ModelMetadataResponse:
        return self._call("ModelMetadata", pb.ModelMetadataRequest(name=self.model))

    def _output_width(self) -> int:
        """The model's output width (Cout: its output shape is [-1, Cout]), asked once."""
        if self._width is None:
            self._width = int(self.model_metadata().outputs[0].shape[-1])
        return self._width

    def model_config(self) -> Any:
        return self._call("ModelConfig", pb.ModelConfigRequest(name=self.model)).config

    def model_statistics(self) -> pb.ModelStatistics:
        return self._call("ModelStatistics", pb.ModelStatisticsRequest(name=self.model)).model_stats[0]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client over one grpc.aio channel; the same calls as Client, awaited."""

    def __init__(self, url: str, model: str = DEFAULT_MODEL, timeout_s: float | None = 60.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, credentials: Credentials | None = None) -> None:
        self.model = model
        self.timeout_s = timeout_s
        self.credentials = credentials or PLAINTEXT
        self._metadata = self.credentials.metadata()
        self._channel = self.credentials.channel(url, _channel_options(max_message_bytes), aio=True)
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)
        self._width: int | None = None

    async def _call(self, method: str, request: Any) -> Any:
        try:
            return await getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise InferenceError.from_rpc(exc) from None

    async def infer(self, x: np.ndarray, datatype: str = "FP32") -> np.ndarray:
        return parse_response(await self._call("ModelInfer", build_request(x, self.model, datatype)))

    async def infer_stream(self, arrays: Iterable[np.ndarray] | AsyncIterable[np.ndarray],
                           datatype: str = "FP32") -> AsyncIterator[np.ndarray]:
        """Infer each array as one message of a single ModelStreamInfer stream and yield the outputs in the
        same order. The server runs a stream's requests concurrently (they batch together), so one
        connection keeps many in flight at a lower cost per request than separate calls. The first request
        the server refuses raises InferenceError, which ends the stream."""
        async def requests() -> AsyncIterator[pb.ModelInferRequest]:
            if isinstance(arrays, AsyncIterable):
                async for x in arrays:
                    yield build_request(x, self.model, datatype)
            else:
                for x in arrays:
                    yield build_request(x, self.model, datatype)

        call = self._stub.ModelStreamInfer(requests(), metadata=self._metadata)  # no deadline: as long as input
        try:
            async for answer in call:
                if answer.error_message:
                    name, _, message = answer.error_message.partition(": ")
                    raise InferenceError(grpc.StatusCode.__members__.get(name, grpc.StatusCode.UNKNOWN), message)
                yield parse_response(answer.infer_response)
        except grpc.RpcError as exc:
            raise InferenceError.from_rpc(exc) from None
        finally:
            call.cancel()

    async def infer_shared_memory(self, shape: tuple[int, ...], input_region: str, *, datatype: str = "FP32",
                                  input_offset: int = 0, output_region: str | None = None, output_offset: int = 0,
                                  output_byte_size: int | None = None) -> np.ndarray | None:
        """Client.infer_shared_memory, awaited."""
        if output_region is not None and output_byte_size is None:
            output_byte_size = shape[0] * await self._output_width() * 4
        response = await self._call("ModelInfer", build_shm_request(
            shape, self.model, datatype, input_region, input_offset, output_region, output_offset, output_byte_size))
        return None if output_region is not None else parse_response(response)

    async def register_system_shared_memory(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        await self._call(*_system_register(name, key, byte_size, offset))

    async def unregister_system_shared_memory(self, name: str = "") -> None:
        await self._call(*_system_unregister(name))

    async def system_shared_memory_status(self, name: str = "") -> dict[str, tuple[str, int, int]]:
        return _system_regions(await self._call(*_system_status(name)))

    async def register_cuda_shared_memory(self, name: str, raw_handle: bytes, device_id: int,
                                          byte_size: int) -> None:
        await self._call(*_cuda_register(name, raw_handle, device_id, byte_size))

    async def register_cuda_region(self, name: str, region: CudaRegion) -> None:
        await self.register_cuda_shared_memory(name, region.raw_handle, region.device_id, region.byte_size)

    async def register_cuda_array(self, name: str, array: Any) -> CudaArray:
        """Client.register_cuda_array, awaited."""
        region, where = locate(array, name)
        await self.register_cuda_region(name, region)
        return where

    async def infer_cuda(self, input: CudaArray, output: CudaArray | None = None, *,
                         synchronize_device: bool = True) -> np.ndarray | None:
        """Client.infer_cuda, awaited (the device's synchronisation, when asked for, blocks this loop meanwhile)."""
        return await self.infer_shared_memory(**_cuda_infer(input, output, synchronize_device))

    async def unregister_cuda_shared_memory(self, name: str = "") -> None:
        await self._call(*_cuda_unregister(name))

    async def cuda_shared_memory_status(self, name: str = "") -> dict[str, tuple[int, int]]:
        return _cuda_regions(await self._call(*_cuda_status(name)))

    async def _output_width(self) -> int:
        if self._width is None:
            self._width = int((await self.model_metadata()).outputs[0].shape[-1])
        return self._width

    async def is_live(self) -> bool:
        return bool((await self._call("ServerLive", pb.ServerLiveRequest())).live)

    async def is_ready(self) -> bool:
        try:
            server = await self._call("ServerReady", pb.ServerReadyRequest())
            model = await self._call("ModelReady", pb.ModelReadyRequest(name=self.model))
        except InferenceError:
            return False
        return bool(server.ready and model.ready)

    async def server_metadata(self) -> pb.ServerMetadataResponse:
        return await self._call("ServerMetadata", pb.ServerMetadataRequest())

    async def model_metadata(self) -> pb.ModelMetadataResponse:
        return await self._call("ModelMetadata", pb.ModelMetadataRequest(name=self.model))

    async def model_statistics(self) -> pb.ModelStatistics:
        return (await self._call("ModelStatistics", pb.ModelStatisticsRequest(name=self.model))).model_stats[0]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

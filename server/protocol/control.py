"""The control RPCs of the Open Inference Protocol: liveness and readiness, server and model metadata, the model
configuration, statistics, and shared-memory registration (system and CUDA). Cold paths: one call does little
work.

Each method takes the request message and returns the response message, or raises ServingError: no transport
here. The gRPC service (``service.add_to_server``) and the REST front end (``rest.py``) call the same methods
and turn a ServingError into their own status at their edge."""

from __future__ import annotations

from voxserve import __version__
from voxserve.proto import config_pb, pb

from ..core.errors import unimplemented
from ..core.stats import Duration
from . import codec
from .codec import ModelSpec
from .cudashm import CudaSharedMemoryRegistry
from .service import CUDA_SHM_EXTENSION, EXTENSIONS, PLATFORM, ServingState
from .shm import SharedMemoryRegistry


def _duration(d: Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=d.count, ns=d.ns)


class ControlService:
    def __init__(self, state: ServingState, model_name: str, model_version: str,
                 shm: SharedMemoryRegistry | None = None, cuda_shm: CudaSharedMemoryRegistry | None = None) -> None:
        self.state = state
        self.shm = shm
        # None in a server without a device layer of its own (a CPU server, a front end): the CUDA RPCs are
        # UNIMPLEMENTED there and the extension is not listed, as its metadata must tell a client what works.
        self.cuda_shm = cuda_shm
        self.model_name = model_name
        self.model_version = model_version

    # --- health and metadata -------------------------------------------------

    async def ServerLive(self, request):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request):
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def ModelReady(self, request):
        # A probe, open to callers without a token under --open-health: a wrong name learns nothing of what is served.
        self._check_model(request.name, request.version, reveal=False)
        return pb.ModelReadyResponse(ready=self.state.ready)

    async def ServerMetadata(self, request):
        extensions = [*EXTENSIONS, *([CUDA_SHM_EXTENSION] if self.cuda_shm is not None else [])]
        return pb.ServerMetadataResponse(name="voxserve", version=__version__, extensions=extensions)

    async def ModelMetadata(self, request):
        spec = self._check_model(request.name, request.version)
        response = pb.ModelMetadataResponse(name=self.model_name, versions=[self.model_version], platform=PLATFORM)
        if spec is not None:
            # Each tensor once: generic v2 clients build one input per entry. FP16 and BF16 are accepted too
            # (ModelConfig's parameter accepted_input_datatypes says so).
            response.inputs.add(name=codec.INPUT_NAME, datatype="FP32", shape=[-1, spec.cin, -1, -1, -1])
            response.outputs.add(name=codec.OUTPUT_NAME, datatype="FP32", shape=[-1, spec.cout])
        return response

    async def ModelConfig(self, request):
        spec = self._check_model(request.name, request.version)
        config = config_pb.ModelConfig(name=self.model_name, platform=PLATFORM, backend="voxserve",
                                       max_batch_size=self.state.max_batch)
        if spec is not None:
            config.input.add(name=codec.INPUT_NAME, data_type=config_pb.TYPE_FP32, dims=[spec.cin, -1, -1, -1])
            config.output.add(name=codec.OUTPUT_NAME, data_type=config_pb.TYPE_FP32, dims=[spec.cout])
            config.parameters["kernel_size"].string_value = str(spec.k)
        devices = [d for d in self.state.device.split(",") if d]
        gpu = bool(devices) and devices[0].startswith("cuda")
        kind = config_pb.ModelInstanceGroup.KIND_GPU if gpu else config_pb.ModelInstanceGroup.KIND_CPU
        group = config.instance_group.add(name=f"{self.model_name}_0", count=max(1, len(devices)), kind=kind)
        if gpu:
            group.gpus.extend(int(d.partition(":")[2] or 0) for d in devices)
        runner = self.state.runner
        if runner is not None and runner.batching.enabled:
            config.dynamic_batching.max_queue_delay_microseconds = int(runner.batching.max_delay_s * 1e6)
        config.parameters["device"].string_value = self.state.device
        config.parameters["kernel"].string_value = self.state.kernel
        config.parameters["accepted_input_datatypes"].string_value = "FP32,FP16,BF16"
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request):
        if request.name:
            self._check_model(request.name, request.version)
        s = self.state.stats.combined()  # with --replicas: every replica's figures
        stats = pb.ModelStatistics(
            name=self.model_name, version=self.model_version, last_inference=s.last_inference_ms,
            inference_count=s.inference_count, execution_count=s.execution_count,
            inference_stats=pb.InferStatistics(
                success=_duration(s.success), fail=_duration(s.fail), queue=_duration(s.queue),
                compute_input=_duration(s.compute_input), compute_infer=_duration(s.compute_infer),
                compute_output=_duration(s.compute_output)),
        )
        for size, b in s.batches.items():
            stats.batch_stats.add(batch_size=size, compute_input=_duration(b.compute_input),
                                  compute_infer=_duration(b.compute_infer), compute_output=_duration(b.compute_output))
        return pb.ModelStatisticsResponse(model_stats=[stats])

    # --- system shared memory ----------------------------------------------------

    async def SystemSharedMemoryRegister(self, request):
        self._shm_call(self.shm.register, request.name, request.key, request.offset,
                             request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request):
        self._shm_call(self.shm.unregister, request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def SystemSharedMemoryStatus(self, request):
        regions = self._shm_call(self.shm.status, request.name)
        response = pb.SystemSharedMemoryStatusResponse()
        for r in regions:
            response.regions[r.name].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(
                name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size))
        return response

    def _shm_call(self, fn, *args):
        if self.shm is None:
            raise unimplemented("this server does not offer system shared memory")
        return fn(*args)

    # --- CUDA shared memory -------------------------------------------------------

    async def CudaSharedMemoryRegister(self, request):
        await self._cuda().register(request.name, request.raw_handle, request.device_id, request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(self, request):
        await self._cuda().unregister(request.name)
        return pb.CudaSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request):
        response = pb.CudaSharedMemoryStatusResponse()
        for r in self._cuda().status(request.name):  # never the handle: it maps the client's memory
            response.regions[r.name].CopyFrom(pb.CudaSharedMemoryStatusResponse.RegionStatus(
                name=r.name, device_id=r.device_id, byte_size=r.byte_size))
        return response

    def _cuda(self) -> CudaSharedMemoryRegistry:
        if self.cuda_shm is None:
            raise unimplemented("this server does not offer CUDA shared memory: its model does not run on a CUDA "
                                "device with the kernel library")
        return self.cuda_shm

    def _check_model(self, name: str, version: str, reveal: bool = True) -> ModelSpec | None:
        codec.check_model(self.model_name, self.model_version, name, version, reveal)
        return self.state.spec

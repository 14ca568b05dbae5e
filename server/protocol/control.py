"""The control RPCs of the GRPCInferenceService: liveness and readiness, server and model metadata, the model
configuration, statistics, and system shared-memory registration. Cold paths: one call does little work."""

from __future__ import annotations

import grpc

from voxserve import __version__
from voxserve.proto import config_pb, pb

from ..core.errors import ServingError
from ..core.stats import Duration
from . import codec
from .codec import ModelSpec
from .service import EXTENSIONS, PLATFORM, ServingState
from .shm import SharedMemoryRegistry
from .status import abort


def _duration(d: Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=d.count, ns=d.ns)


class ControlService:
    def __init__(self, state: ServingState, model_name: str, model_version: str,
                 shm: SharedMemoryRegistry | None = None) -> None:
        self.state = state
        self.shm = shm
        self.model_name = model_name
        self.model_version = model_version

    # --- health and metadata -------------------------------------------------

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.state.ready)

    async def ModelReady(self, request, context):
        # A probe, open to callers without a token under --open-health: a wrong name learns nothing of what is served.
        await self._check_model(request.name, request.version, context, reveal=False)
        return pb.ModelReadyResponse(ready=self.state.ready)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="voxserve", version=__version__, extensions=list(EXTENSIONS))

    async def ModelMetadata(self, request, context):
        spec = await self._check_model(request.name, request.version, context)
        response = pb.ModelMetadataResponse(name=self.model_name, versions=[self.model_version], platform=PLATFORM)
        if spec is not None:
            # Each tensor once: generic v2 clients build one input per entry. FP16 and BF16 are accepted too
            # (ModelConfig's parameter accepted_input_datatypes says so).
            response.inputs.add(name=codec.INPUT_NAME, datatype="FP32", shape=[-1, spec.cin, -1, -1, -1])
            response.outputs.add(name=codec.OUTPUT_NAME, datatype="FP32", shape=[-1, spec.cout])
        return response

    async def ModelConfig(self, request, context):
        spec = await self._check_model(request.name, request.version, context)
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

    async def ModelStatistics(self, request, context):
        if request.name:
            await self._check_model(request.name, request.version, context)
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

    async def SystemSharedMemoryRegister(self, request, context):
        await self._shm_call(context, self.shm.register, request.name, request.key, request.offset,
                             request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        await self._shm_call(context, self.shm.unregister, request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def SystemSharedMemoryStatus(self, request, context):
        regions = await self._shm_call(context, self.shm.status, request.name)
        response = pb.SystemSharedMemoryStatusResponse()
        for r in regions:
            response.regions[r.name].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(
                name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size))
        return response

    async def _shm_call(self, context, fn, *args):
        if self.shm is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server does not offer system shared memory")
        try:
            return fn(*args)
        except ServingError as exc:
            await abort(context, exc)

    async def _check_model(self, name: str, version: str, context, reveal: bool = True) -> ModelSpec | None:
        try:
            codec.check_model(self.model_name, self.model_version, name, version, reveal)
        except ServingError as exc:
            await abort(context, exc)
        return self.state.spec

"""The descriptor pool that holds voxserve's protocol messages, apart from protobuf's default pool.

tritonclient (and any other Open Inference Protocol client) registers its own ``model_config.proto`` and
``grpc_service.proto``, with the same package (``inference``) and message names, in protobuf's default pool;
two different files of one name cannot both go there, so whichever of the two was imported second failed
with ``TypeError: duplicate file name``. Our generated modules add their files to ``POOL`` instead
(``generate.py`` makes that one change to protoc's output). The full names are the protocol's
(``inference.ModelInferRequest``, the ``/inference.GRPCInferenceService/ModelInfer`` method path), so nothing
changes on the wire; only a lookup in the default pool does not find them: server reflection describes them
from ``reflection_pool``.
"""

from __future__ import annotations

from google.protobuf import descriptor, descriptor_pool

POOL = descriptor_pool.DescriptorPool()


def reflection_pool(*others: descriptor.FileDescriptor) -> descriptor_pool.DescriptorPool:
    """A new pool with the protocol's files and ``others`` (with their dependencies): every file a server's
    reflection service describes, whichever pool each came from."""
    from . import grpc_service_pb2

    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file: descriptor.FileDescriptor) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        pool.AddSerializedFile(file.serialized_pb)
        added.add(file.name)

    for file in (grpc_service_pb2.DESCRIPTOR, *others):
        add(file)
    return pool

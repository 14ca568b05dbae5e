"""CUDA shared memory: the protocol's messages, the region registry's rules with a fake device layer, and the three
RPCs over real gRPC (our stubs and tritonclient's) against an in-process server given that fake layer."""

from __future__ import annotations

import random

import pytest

from voxserve.proto import pb

CUDA_MESSAGES = ("CudaSharedMemoryStatusRequest", "CudaSharedMemoryStatusResponse", "CudaSharedMemoryRegisterRequest",
                 "CudaSharedMemoryRegisterResponse", "CudaSharedMemoryUnregisterRequest",
                 "CudaSharedMemoryUnregisterResponse")
CUDA_RPCS = ("CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister")


# --- the protocol ---------------------------------------------------------------------------------------------------

def _fields(descriptor) -> list:
    """A message's fields, nested messages included, as (name, number, type, repeated) rows."""
    rows = [(f.name, f.number, f.type, f.is_repeated) for f in descriptor.fields]
    for nested in descriptor.nested_types:
        rows.append((nested.name, _fields(nested)))
    return rows


@pytest.mark.parametrize("name", CUDA_MESSAGES)
def test_messages_match_tritonclients_descriptor(name):
    from tritonclient.grpc import service_pb2 as triton

    assert _fields(pb.DESCRIPTOR.message_types_by_name[name]) == _fields(triton.DESCRIPTOR.message_types_by_name[name])


def test_messages_serialise_byte_identically_to_tritonclients():
    from tritonclient.grpc import service_pb2 as triton

    rnd = random.Random()
    for _ in range(50):
        name = "".join(rnd.choices("abcxyz_-.0", k=rnd.randint(0, 20)))
        handle = rnd.randbytes(rnd.choice((0, 63, 64, 65)))
        device_id, byte_size = rnd.randint(-(1 << 63), (1 << 63) - 1), rnd.randint(0, (1 << 64) - 1)
        ours = pb.CudaSharedMemoryRegisterRequest(name=name, raw_handle=handle, device_id=device_id,
                                                  byte_size=byte_size)
        theirs = triton.CudaSharedMemoryRegisterRequest(name=name, raw_handle=handle, device_id=device_id,
                                                        byte_size=byte_size)
        assert ours.SerializeToString(deterministic=True) == theirs.SerializeToString(deterministic=True)
        status_ours, status_theirs = pb.CudaSharedMemoryStatusResponse(), triton.CudaSharedMemoryStatusResponse()
        for i in range(rnd.randint(0, 3)):
            region = (f"{name}{i}", rnd.randint(0, (1 << 64) - 1), byte_size)
            status_ours.regions[region[0]].CopyFrom(status_ours.RegionStatus(
                name=region[0], device_id=region[1], byte_size=region[2]))
            status_theirs.regions[region[0]].CopyFrom(status_theirs.RegionStatus(
                name=region[0], device_id=region[1], byte_size=region[2]))
        assert status_ours.SerializeToString(deterministic=True) == status_theirs.SerializeToString(deterministic=True)
        for request in ("CudaSharedMemoryStatusRequest", "CudaSharedMemoryUnregisterRequest"):
            assert (getattr(pb, request)(name=name).SerializeToString()
                    == getattr(triton, request)(name=name).SerializeToString())


def test_rpc_paths_are_tritonclients():
    from tritonclient.grpc import service_pb2 as triton

    ours = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for rpc in CUDA_RPCS:
        mine, triton_method = ours.methods_by_name[rpc], theirs.methods_by_name[rpc]
        assert (ours.full_name, mine.input_type.full_name, mine.output_type.full_name) == (
            theirs.full_name, triton_method.input_type.full_name, triton_method.output_type.full_name)

"""tritonclient and voxserve.client in one process, in either order of import, each calling the server; and server
reflection describing every service it lists, as grpcurl does (our messages live in a descriptor pool of their own).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool

from ..conftest import REPO

BOTH = """
import sys
import numpy as np
{imports}
from voxserve.client import Client
x = np.random.default_rng(0).standard_normal((2, 3, 4, 5, 6), dtype=np.float32)
with Client(sys.argv[1]) as ours:
    mine = ours.infer(x)
theirs = tc.InferenceServerClient(sys.argv[1])
inp = tc.InferInput("input", list(x.shape), "FP32")
inp.set_data_from_numpy(x)
other = theirs.infer("voxnet", [inp]).as_numpy("output")
assert mine.shape == (2, 16) and np.array_equal(mine, other), (mine, other)
print("both answered")
"""
ORDERS = {
    "tritonclient first": "import tritonclient.grpc as tc\nimport voxserve.client",
    "voxserve.client first": "import voxserve.client\nimport tritonclient.grpc as tc",
}


@pytest.mark.parametrize("order", ORDERS)
def test_tritonclient_and_our_client_in_one_process(server, order):
    if importlib.util.find_spec("tritonclient") is None:
        pytest.skip("tritonclient[grpc] (a test dependency) is not installed")
    proc = subprocess.run([sys.executable, "-c", BOTH.format(imports=ORDERS[order]), server.url], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "both answered" in proc.stdout


def _reflect(channel: grpc.Channel, method: str, **request) -> list:
    from grpc_reflection.v1alpha import reflection_pb2

    call = channel.stream_stream(method, request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    return list(call(iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=10))


def _pool_from(reply) -> descriptor_pool.DescriptorPool:
    """A fresh pool of the files in a reflection reply (a file, then its dependencies), each added after those
    it imports."""
    assert reply.WhichOneof("message_response") == "file_descriptor_response", reply
    files = {f.name: f for f in map(descriptor_pb2.FileDescriptorProto.FromString,
                                    reply.file_descriptor_response.file_descriptor_proto)}
    pool, added = descriptor_pool.DescriptorPool(), set()

    def add(name: str) -> None:
        if name not in added:
            for dependency in files[name].dependency:
                add(dependency)
            pool.Add(files[name])
            added.add(name)

    for name in files:
        add(name)
    return pool


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_describes_every_listed_service(server, version):
    """What `grpcurl describe` does: list the services, fetch the file holding each (with its dependencies),
    build them into a pool and find the service and its methods' messages, under the protocol's full names."""
    method = f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo"
    with grpc.insecure_channel(server.url) as ch:
        [listed] = _reflect(ch, method, list_services="")
        names = {s.name for s in listed.list_services_response.service}
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names
        # v1 is served as v1alpha under another name: it has no file of its own to describe.
        for name in sorted(names - {"grpc.reflection.v1.ServerReflection"}):
            [reply] = _reflect(ch, method, file_containing_symbol=name)
            service = _pool_from(reply).FindServiceByName(name)
            assert service.methods, name
        [reply] = _reflect(ch, method, file_containing_symbol="inference.ModelInferRequest")
    infer = _pool_from(reply).FindMethodByName("inference.GRPCInferenceService.ModelInfer")
    assert infer.input_type.full_name == "inference.ModelInferRequest"
    assert infer.output_type.full_name == "inference.ModelInferResponse"
    assert infer.input_type.fields_by_name["raw_input_contents"].number == 7

"""The Open Inference Protocol messages and stubs (generated from the .proto files here)."""

from . import grpc_service_pb2 as pb
from . import grpc_service_pb2_grpc as pb_grpc
from . import model_config_pb2 as config_pb

__all__ = ["config_pb", "pb", "pb_grpc"]

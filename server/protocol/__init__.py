"""The protocol room: the Open Inference Protocol over gRPC, and the only part of the server that imports
grpc or protobuf.

``wire`` (request bytes to tensor views), ``codec`` (validation, encoding), ``shm`` (system shared-memory
registry), ``security`` (TLS, tokens), ``admission`` (the RPC limit and its fair share), ``health``
(grpc.health.v1), ``service`` (the KServe v2 servicer: inference and control RPCs), ``server`` (the gRPC
server of one process) and ``status`` (the one map from ``core.errors.Status`` to gRPC's codes).
"""

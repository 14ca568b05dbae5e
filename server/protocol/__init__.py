"""The protocol room: the Open Inference Protocol over gRPC, and the only part of the server that imports
grpc or protobuf.

``wire`` (request bytes to tensor views), ``codec`` (validation, encoding), ``shm`` (system shared-memory
registry), ``security`` (TLS, tokens), ``admission`` (the RPC limit and its fair share), ``health``
(grpc.health.v1), the KServe v2 service in two servicers, ``control`` (health, metadata, configuration,
statistics, shared-memory registration) and ``inference`` (ModelInfer, ModelStreamInfer), registered by
``service``; ``server`` (the gRPC server of one process) and ``status`` (the one map from
``core.errors.Status`` to gRPC's codes).
"""

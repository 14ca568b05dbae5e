"""The execution room: what runs a request once the protocol has decoded it. Nothing here imports a transport.

``executor`` (the contract the protocol layer relies on), ``batching`` (the dynamic batcher: bounded queue,
deadlines, shape groups, the large-request lane, and its configuration), ``runner`` (the in-process executor:
a worker per device), ``model`` (the weights on a device and the op), ``pipeline`` (the CUDA path: pinned
staging, copy and compute streams, graphs), ``inprocess`` (reading the weights and building warmed-up
models), ``weights`` (safetensors), ``stats`` (the statistics extension's counters), ``errors`` (failures and
their statuses) and ``heap`` (garbage-collector settings for serving).
"""

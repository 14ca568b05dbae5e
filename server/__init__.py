"""The voxserve server: ``app`` (one process's lifecycle), ``settings``, ``metrics``, and three rooms:
``protocol`` (gRPC and the Open Inference Protocol), ``core`` (execution, no transport) and ``topology``
(which process runs what). README.md, "How the code is laid out", follows a request through them.

Import ``voxserve.server.app`` for the server itself; this package stays light so that the CLI can read the
settings without importing torch.
"""

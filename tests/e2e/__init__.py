"""Tests of whole servers over real gRPC and HTTP: the service, lifecycle, overload, metrics, CLI, clients."""

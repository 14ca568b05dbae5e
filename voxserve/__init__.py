"""voxserve: a gRPC (Open Inference Protocol) service for one fused conv3d model."""

__version__ = "0.1.0"

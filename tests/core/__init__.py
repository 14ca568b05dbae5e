"""Tests of the execution room (server/core/): batching, the runner, the CPU and CUDA paths, failures."""

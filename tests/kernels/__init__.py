"""Tests of kernels/: the build, the fused kernel against float64, the reference."""

"""Tests of the GPU kernels of inductor_ext/kernels (Triton interpreter on CPU, compiled on CUDA)."""

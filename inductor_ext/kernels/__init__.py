"""GPU kernels and the glue that calls third-party kernels. Imported lazily, CUDA only."""

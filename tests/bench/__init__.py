"""Tests of the benchmarks package, ``inductor_ext.bench`` (CPU: errors, formatting, dry runs)."""

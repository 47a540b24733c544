"""Tests of the GLM-5.3 layers and model (graphs/): parity, compile, signatures, decode."""

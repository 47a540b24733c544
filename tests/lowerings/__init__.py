"""Tests of the Inductor decompositions (lowerings/): fusion, layouts, numerics."""

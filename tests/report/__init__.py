"""Tests of the report package, ``inductor_ext.report`` (the report and the mismatch ablation)."""

"""Tests of the command line, ``python -m inductor_ext``."""

"""Tests of the op families (inductor_ext/ops): references, fakes, autograd, opcheck, compile."""

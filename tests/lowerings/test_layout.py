"""The ops that stay opaque (KDA chunk forward/backward, the KPool scorer) carry the layout tag
their kernels need: the FLA glue and the MQA scorer read contiguous inputs, so Inductor must
have the producers write contiguous buffers instead of the kernels copying a strided view."""

import re

import torch

import inductor_ext
from inductor_ext import ops
from lowerings._compat import inductor_config, run_and_get_code

OPAQUE = ("kda_chunk", "kda_chunk_bwd", "kpool_logits")


def test_opaque_ops_carry_the_contiguous_layout_tag():
    """Each opaque op's overload is tagged needs_contiguous_strides (not the exact-strides default)."""
    inductor_ext.enable()
    for name in OPAQUE:
        tags = getattr(torch.ops.glm53, name).default.tags
        assert torch.Tag.needs_contiguous_strides in tags, f"glm53::{name} tags: {tags}"


def test_kda_chunk_receives_contiguous_buffers_from_a_transposed_producer():
    """q, k come from a transpose (a strided view in eager); Inductor's fused producer writes
    them contiguous, so the buffers passed to the extern kda_chunk call are dense [B,T,H,K]."""
    inductor_ext.enable()
    B, H, T, K = 1, 2, 32, 16
    x = torch.randn(B, H, T, K)
    v, g, beta = torch.randn(B, T, H, K), -torch.rand(B, T, H, K), torch.rand(B, T, H)

    def f(x, v, g, beta):
        q = (x * 2).transpose(1, 2)
        return ops.kda_chunk(q, q + 1, v, g, beta)[0]

    with inductor_config.patch(fx_graph_cache=False):
        out, codes = run_and_get_code(torch.compile(f, fullgraph=True), x, v, g, beta)
    code = "\n".join(codes)
    call = re.search(r"torch\.ops\.glm53\.kda_chunk\.default\((\w+), (\w+),", code)
    assert call, "kda_chunk is no longer an extern call"
    for buf in call.groups():
        alloc = re.search(rf"^\s*{buf} = empty_strided_cpu\((\(.*?\)), (\(.*?\))", code, flags=re.M)
        assert alloc and alloc.group(2) == f"({T * H * K}, {H * K}, {K}, 1)", (buf, alloc and alloc.groups())
    torch.testing.assert_close(out, f(x, v, g, beta), msg="kda_chunk output")

"""The KDA glue's own Triton kernel (zeroing Aqk above each chunk's diagonal), on CPU through
``TRITON_INTERPRET=1`` and on CUDA; the expected matrix is built from positions in plain torch."""

import os

import pytest
import torch

pytest.importorskip("triton")

from inductor_ext.kernels.kda_fla.mask import zero_above_chunk_diagonal  # noqa: E402

DEVICES = ["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []
if torch.cuda.is_available():
    DEVICES.append("cuda")
if not DEVICES:
    pytest.skip("needs TRITON_INTERPRET=1 (CPU) or CUDA", allow_module_level=True)


def _expected(a, lengths):
    pos = torch.cat([torch.arange(n) % 64 for n in lengths])
    keep = torch.arange(64)[None, :] <= pos[:, None]  # [T, 64]
    return torch.where(keep[None, :, None, :].to(a.device), a, torch.zeros((), dtype=a.dtype, device=a.device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [3, 32])  # head blocks of 1 and of 16
@pytest.mark.parametrize("lengths", [[130], [37, 28], [64, 1, 70]], ids=["single", "packed", "boundaries"])
def test_zeroes_exactly_the_upper_chunk_triangles(device, lengths, heads):
    from inductor_ext.ops.kda_reference import CHUNK

    T, H = sum(lengths), heads
    B = 2 if len(lengths) == 1 else 1
    a = torch.full((B, T, H, CHUNK), float("nan"), device=device).bfloat16()
    a.view(torch.int16).random_(-30000, 30000)
    a = a.nan_to_num(0.5)
    want = _expected(a.clone(), lengths)
    if len(lengths) > 1:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
        chunks = [(n, c) for n, L in enumerate(lengths) for c in range(-(-L // CHUNK))]
        slots = chunks + [(-1, 0)] * 2  # the fixed-shape list has unused trailing slots
        got = zero_above_chunk_diagonal(a, torch.tensor(slots, device=device), cu)
    else:
        got = zero_above_chunk_diagonal(a, None, None)
    assert torch.equal(got, want)

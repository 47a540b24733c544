"""The matmul FLOPs of the h200 DSA layer's forward + backward (T = 8192, two packed
documents, ``serving_aligned``), by op and dtype, counted on fake tensors (CPU, no GPU, ~1 min):
``python docs/experiments/dsa_layer_flops.py`` from the repository root. ``aten._grouped_mm``
calls (the routed experts) are counted by their shapes; the sparse MLA's FLOPs are
``inductor_ext.bench.attn.sparse_flop`` of the visible pairs."""
import collections
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
sys.path.insert(0, ".")
import inductor_ext  # noqa: E402
from graphs import GLM53Config
from inductor_ext import PrecisionConfig
from inductor_ext.bench.inputs import cu_seqlens, decoder_layer, two_documents

class ByDtype(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.flops = collections.Counter()
        self.ops = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func._overloadpacket)
        self.ops[name] += 1
        ts = [x for x in args if isinstance(x, torch.Tensor)]
        f = 0
        if name == "aten.mm":
            f = 2 * ts[0].shape[0] * ts[0].shape[1] * ts[1].shape[1]
        elif name == "aten.addmm":
            f = 2 * ts[1].shape[0] * ts[1].shape[1] * ts[2].shape[1]
        elif name == "aten.bmm":
            f = 2 * ts[0].shape[0] * ts[0].shape[1] * ts[0].shape[2] * ts[1].shape[2]
        elif "grouped_mm" in name:  # [M, K] x [E, K, N] (rows grouped) or [M, R] x [R, N] (R grouped)
            a, b = ts[0].shape, ts[1].shape
            f = 2 * a[0] * a[1] * (b[2] if len(b) == 3 else b[1])
        if f:
            self.flops[(name, str(ts[0].dtype), str(ts[1].dtype))] += f
        return out

inductor_ext.enable()
cfg = GLM53Config.h200(attn_impl="flex")
cu = cu_seqlens(two_documents(8192))
with FakeTensorMode(allow_non_fake_inputs=True):
    layer = decoder_layer(cfg, "dsa", "cpu")
    x = torch.randn(8192, cfg.hc_mult, cfg.hidden_size).bfloat16()
    with inductor_ext.precision(PrecisionConfig.serving_aligned()):
        m = ByDtype()
        with m:
            leaf = x.detach().requires_grad_(True)
            loss = layer(leaf, cu)[0].float().square().flatten(1).mean(1).mean()
            loss.backward()
for k, v in sorted(m.flops.items(), key=lambda kv: -kv[1]):
    print(k, f"{v/1e12:.4f} TFLOP")
print(f"total {sum(m.flops.values()) / 1e12:.4f} TFLOP; ops:", {k: v for k, v in m.ops.items() if "glm53" in k})

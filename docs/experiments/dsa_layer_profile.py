"""Where the compiled h200 DSA layer's forward + backward spends its kernel time (no CUDA graphs,
T = 8192, serving_aligned): every kernel by device time, and the matmul ops by input shape. On an
H200, from the repository root: ``python docs/experiments/dsa_layer_profile.py``."""
import torch
from torch.profiler import ProfilerActivity, profile

import inductor_ext
from inductor_ext.bench.layer import CONFIGS, _build, _compile, _Setup, _step_fn

inductor_ext.enable()
setup = _Setup(mode=None)
with inductor_ext.precision(CONFIGS["serving_aligned"]):
    layer, x, _, cu = _build("dsa", 8192, setup)
    params = [p for p in layer.parameters() if p.requires_grad]
    step = _step_fn(_compile(layer, "fwd_bwd", setup, "none"), cu, params, "fwd_bwd", False)
    for _ in range(2):
        step(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(3):
            step(x)
        torch.cuda.synchronize()
kern = [(e.key, e.device_time_total / 3e3, e.count // 3) for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0]
kern.sort(key=lambda r: -r[1])
print(f"total {sum(r[1] for r in kern):.2f} ms of kernels per step")
for name, ms, n in kern[:60]:
    print(f"  {ms:8.3f} ms x{n:<4d} {name[:150]}")
print("== matmul ops by input shape (device time per step)")
ops = [e for e in prof.key_averages(group_by_input_shape=True)
       if e.key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm", "aten::baddbmm", "aten::matmul",
                    "aten::linear", "aten::_scaled_mm")]
ops.sort(key=lambda e: -e.device_time_total)
for e in ops[:40]:
    print(f"  {e.device_time_total / 3e3:8.3f} ms x{e.count // 3:<3d} {e.key} {e.input_shapes}")

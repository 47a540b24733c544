"""Graph signatures: the op sequence of a compiled GLM-5.3 graph, forward and backward.

:func:`recording_backend` is ``aot_eager`` that also keeps the AOTAutograd forward and backward
FX graphs; :func:`signature` turns one into text, one op a line, with the literal (non-tensor)
arguments of ``glm53`` ops (where the precision lives), so a change that breaks a graph or swaps a
precision path shows up as a diff of the recorded files in ``tests/graphs/signatures/``.
"""

from __future__ import annotations

import torch
from torch._dynamo.backends.common import aot_autograd
from torch.fx import GraphModule, Node

__all__ = ["recording_backend", "signature", "glm53_calls"]


def _boxed(gm: GraphModule):
    from torch._functorch.aot_autograd import make_boxed_func

    return make_boxed_func(gm.forward)


def recording_backend(store: dict):
    """An ``aot_eager``-equivalent backend that stores ``store["forward"]`` / ``store["backward"]``
    (the latest AOTAutograd graphs) and counts compiled frames in ``store["frames"]``."""

    def fw(gm, example_inputs):
        store["forward"] = gm
        return _boxed(gm)

    def bw(gm, example_inputs):
        store["backward"] = gm
        return _boxed(gm)

    inner = aot_autograd(fw_compiler=fw, bw_compiler=bw)

    def backend(gm, example_inputs):
        store["frames"] = store.get("frames", 0) + 1
        return inner(gm, example_inputs)

    return backend


def _op_name(target) -> str:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return getattr(target, "__name__", str(target))


def _literal(a) -> bool:
    return isinstance(a, (str, bool, int, float)) or a is None


def glm53_calls(gm: GraphModule) -> list[tuple[str, tuple]]:
    """``(op name, literal args)`` of every ``glm53`` op call in ``gm``, in graph order."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and _op_name(node.target).startswith("glm53."):
            out.append((_op_name(node.target), tuple(a for a in node.args if _literal(a))))
    return out


def signature(gm: GraphModule) -> str:
    """One line per op call: ``aten.mm.default``; ``glm53`` ops also list their literal args."""
    lines = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = _op_name(node.target)
        if name.startswith("glm53."):
            lits = [repr(a) for a in node.args if not isinstance(a, Node) and _literal(a)]
            name += "(" + ", ".join(lits) + ")"
        lines.append(name)
    return "\n".join(lines) + "\n"

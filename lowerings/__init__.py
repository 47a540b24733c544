"""Inductor lowering / decomposition rules for the ``glm53`` ops that should fuse with their
neighbours. Every private ``torch._inductor`` import lives in :mod:`lowerings._compat`."""

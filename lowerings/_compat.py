"""The one place that imports private ``torch._inductor`` names (a torch upgrade edits this file)."""

from __future__ import annotations

from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

__all__ = ["CustomGraphPass", "get_hash_for_files", "inductor_config"]

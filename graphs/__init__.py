"""GLM-5.3 layers and the reduced model, written to compile whole (issue: layers; not built yet)."""

__all__: list[str] = []

"""torch.nn building blocks that train with a recipe: ``fp4gen.nn.Linear``, and
``fp4gen.nn.MultiheadAttention`` (torch's attention with its projections as linear layers, which
``fp4gen.convert`` then converts)."""

from fp4gen.runtime.attention import MultiheadAttention
from fp4gen.runtime.linear import Linear

__all__ = ["Linear", "MultiheadAttention"]

"""torch.nn building blocks that train with a recipe: ``fp4gen.nn.Linear``."""

from fp4gen.runtime.linear import Linear

__all__ = ["Linear"]

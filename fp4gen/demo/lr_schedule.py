"""The learning-rate schedule of ``fp4gen demo`` and ``fp4gen sweep``, written once so the two
train alike. No torch: the sweep's command line imports it and stays light."""

from __future__ import annotations

import math


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of the peak."""
    warmup = max(steps // 20, 1)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


__all__ = ["lr_at"]

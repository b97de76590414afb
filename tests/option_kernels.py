"""A fixture for tests of the block-scale option kernels' routing: the runtime keeps those
kernels off until their GPU tests pass (``fp4gen.runtime.cute_backend.set_option_kernels``);
a test that checks what the runtime does with them on takes ``option_kernels_on``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def option_kernels_on() -> Iterator[None]:
    from fp4gen.runtime import cute_backend

    previous = cute_backend.set_option_kernels(True)
    yield
    cute_backend.set_option_kernels(previous)


__all__ = ["option_kernels_on"]

"""A fixture for tests of the block-scale option kernels' routing: they are on by default
(``fp4gen.runtime.cute_backend.set_option_kernels``); a test that checks what the runtime does
with them on takes ``option_kernels_on``, so that a test before it in the worker that turned
them off does not decide its result."""

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

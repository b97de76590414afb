"""Fixtures for tests of the block-scale option kernels' routing: they are on by default
(``fp4gen.runtime.cute_backend.set_option_kernels``, and ``set_tile_option_kernels`` for 2D
tiles); a test that checks what the runtime does with them on takes ``option_kernels_on`` /
``tile_options_on``, so that a test before it in the worker that turned them off does not
decide its result, and one that checks the path with the tile variants off takes
``tile_options_off``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def option_kernels_on() -> Iterator[None]:
    from fp4gen.runtime import cute_backend

    previous = cute_backend.set_option_kernels(True)
    yield
    cute_backend.set_option_kernels(previous)


def _tile_options(enabled: bool) -> Iterator[None]:
    from fp4gen.runtime import cute_backend

    previous = cute_backend.set_tile_option_kernels(enabled)
    yield
    cute_backend.set_tile_option_kernels(previous)


@pytest.fixture
def tile_options_on() -> Iterator[None]:
    yield from _tile_options(True)


@pytest.fixture
def tile_options_off() -> Iterator[None]:
    yield from _tile_options(False)


__all__ = ["option_kernels_on", "tile_options_off", "tile_options_on"]

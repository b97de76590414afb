"""An input whose shape the quantize kernels do not take (K not whole blocks or not the
kernel's K multiple; M not the tile kernel's M multiple) is zero-padded to those multiples,
quantized by one launch and each copy's codes and scales cut back to the real shape
(``cute_backend._zero_padded``, ``_unpadded``), where that is exact: deterministic rounding of
1D blocks and 2D tiles, because the reference pads a partial block or tile with zeros itself.
On the CPU the generated kernels (the rowwise one of ``quantize_cute`` and the tile one of
``quantize_tile_cute``) are stood in for by the reference itself, laid out as a kernel writes
its outputs, and refusing a shape that is not a multiple of the kernel's: each cut copy must be
the reference's of the unpadded input, bit for bit. The GPU tests run the real kernels
(tests/test_quantize_padding_gpu.py)."""

from __future__ import annotations

import dataclasses
import logging
import types

import pytest
import torch
from log_records import fresh_log_records

from fp4gen.errors import TensorError
from fp4gen.formats import BUILTIN_FORMATS, E4M3, BlockFormat, ScaleSpec
from fp4gen.numerics.layout import pack
from fp4gen.numerics.quantize import quantize as reference
from fp4gen.runtime import cute_backend

FP8_1X128 = BlockFormat("fp8_block", E4M3, (1, 128), ScaleSpec(None, "nearest"), False)


def _layout(q, prefix: str) -> dict[str, torch.Tensor]:
    """A copy's outputs as a kernel writes them: packed codes, scale codes (fp32 scale values
    for formats without a scale element), S_dec; keys ``prefix`` + name."""
    bits = q.format.element.bits
    coded = q.format.scale.element is not None
    return {
        prefix + "data": q.codes if bits == 8 else pack(q.codes, bits),
        prefix + "scales": q.scale_codes if coded else q.scales,
        prefix + "global_scale": q.global_scale,
    }


def _stand_in(monkeypatch, k_multiple: int, m_multiple: int = 1) -> list[tuple[int, int]]:
    """Kernels that take K in multiples of ``k_multiple`` and M in multiples of ``m_multiple``
    and compute the reference's outputs in a kernel's layout, for one rowwise copy
    (``kernels.run``, as quantize_cute calls it) or a tile kernel's copies (``module.run``: a
    rowwise copy quantizes x, a columnwise one x.t() with 1D blocks and is the transpose of
    x's with 2D tiles); returns the shape of the input each launch got."""
    launched: list[tuple[int, int]] = []

    def launch(fmt, copies, x):
        def run_tile(fns, x, *, seed=0, offset=0):
            launched.append(tuple(x.shape))
            offsets = offset if isinstance(offset, tuple) else (offset,) * len(copies)
            out: dict[str, torch.Tensor] = {}
            for (direction, rounding, rht), off in zip(copies, offsets, strict=True):
                source = x if direction == "rowwise" or fmt.is_2d else x.t().contiguous()
                q = reference(source, fmt, rounding=rounding, hadamard=rht, seed=seed, offset=off)
                if direction == "columnwise" and fmt.is_2d:
                    q = q.transpose()
                out.update(_layout(q, "" if direction == "rowwise" else "col_"))
            return out

        def run(x, *, seed=0, offset=0):
            return run_tile(None, x, seed=seed, offset=offset)

        module = types.SimpleNamespace(K_MULTIPLE=k_multiple, M_MULTIPLE=m_multiple, run=run_tile)
        refused = None
        if x.shape[1] % k_multiple:
            refused = f"K must be a multiple of {k_multiple}"
        elif x.shape[0] % m_multiple:
            refused = f"M must be a multiple of {m_multiple}"
        kernels = types.SimpleNamespace(module=module, run=run, fns=None)
        spec = types.SimpleNamespace(name=f"stand-in {fmt.name} {len(copies)}")
        return cute_backend._Launch(spec, kernels, refused, True)

    monkeypatch.setattr(cute_backend, "not_cuda", lambda x: None)
    monkeypatch.setattr(cute_backend, "_launch", launch)
    return launched


def _quantize(x, fmt, rounding="nearest", rht=None):
    return cute_backend.quantize_cute(
        x, fmt, rounding=rounding, rht=rht, seed=7, offset=3, required=True
    )


@pytest.mark.parametrize(
    ("fmt", "k_multiple", "cols"),
    [
        (FP8_1X128, 128, 576),  # a 64-value last block
        (FP8_1X128, 128, 40),  # K below one block: the reference's block is K long
        (BUILTIN_FORMATS["nvfp4"], 16, 200),  # global amax, e4m3 scale codes, packed codes
        (BUILTIN_FORMATS["nvfp4"], 32, 208),  # whole blocks, a wider kernel multiple
        (BUILTIN_FORMATS["mxfp4"], 32, 100),
        (BUILTIN_FORMATS["mxfp8_e4m3"], 32, 70),
        (BUILTIN_FORMATS["mxfp6_e2m3"], 32, 36),  # 6-bit codes: packed bytes past the row end
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_refused_k_is_zero_padded_and_gives_the_reference_bits(
    monkeypatch, fmt, k_multiple, cols, dtype
) -> None:
    launched = _stand_in(monkeypatch, k_multiple)
    x = (torch.randn(12, cols, generator=torch.Generator().manual_seed(cols)) * 3).to(dtype)
    got = _quantize(x, fmt)
    want = reference(x, fmt)
    assert launched == [(12, -(-cols // k_multiple) * k_multiple)]  # the kernels ran, padded
    assert got.shape == want.shape == x.shape
    assert torch.equal(got.codes, want.codes)
    assert torch.equal(got.scales, want.scales)
    assert torch.equal(got.global_scale, want.global_scale)
    assert got.packed is None or got.packed.data.is_contiguous()


def test_an_rht_that_divides_k_is_padded_and_one_that_does_not_is_refused(monkeypatch) -> None:
    """An RHT along K: padded where its size divides K (the padding's chunks transform to
    zeros), refused where it does not, as the reference refuses it."""
    from fp4gen.dsl.model import RHTSpec

    _stand_in(monkeypatch, 128)
    x = torch.randn(8, 48 * 4)  # K 192: three 64-point chunks; not whole 128-blocks
    fmt = BUILTIN_FORMATS["nvfp4"]
    rht = RHTSpec(64, sign_source="none", signs=None, seed=None)
    got = _quantize(x, fmt, rht=rht)
    want = reference(x, fmt, hadamard=rht)
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
    with pytest.raises(TensorError, match="K must be a multiple of 128"):
        _quantize(torch.randn(8, 200), fmt, rht=RHTSpec(16))  # 200 = 12.5 x 16


@pytest.mark.parametrize("rounding", ["stochastic", "stochastic16"])
def test_stochastic_rounding_is_not_padded(monkeypatch, rounding) -> None:
    """A value's random bits follow its position in the row: the padded row's differ, so a
    stochastic copy of a refused K is refused (the reference quantizes it under "auto")."""
    launched = _stand_in(monkeypatch, 32)
    with pytest.raises(TensorError, match="K must be a multiple of 32"):
        _quantize(torch.randn(4, 40), BUILTIN_FORMATS["nvfp4"], rounding=rounding)
    assert launched == []


NVFP4_2D = dataclasses.replace(BUILTIN_FORMATS["nvfp4"], name="nvfp4_16x16", block=(16, 16))
FP8_128X128 = BlockFormat("fp8_128x128", E4M3, (128, 128), ScaleSpec(None, "nearest"), False)
ROW_COL = ("rowwise", "columnwise")


def _quantize_tile(x, fmt, directions, rounding="nearest", rht=None):
    """quantize_tile_cute's copies ``directions`` of x, each with its own Philox offset; an RHT
    only on the columnwise copy (the tile kernel's only one)."""
    outputs = tuple(
        (d, rounding, rht if d == "columnwise" else None, 11 + i) for i, d in enumerate(directions)
    )
    return cute_backend.quantize_tile_cute(x, fmt, outputs, seed=5)


def _want(x, fmt, direction, offset, rht=None):
    """The reference's copy: x's, x.t()'s (1D) or the transpose of x's (2D tiles)."""
    if direction == "rowwise":
        return reference(x, fmt, seed=5, offset=offset)
    if fmt.is_2d:
        return reference(x, fmt, seed=5, offset=offset).transpose()
    return reference(x.t().contiguous(), fmt, hadamard=rht, seed=5, offset=offset)


@pytest.mark.parametrize(
    ("fmt", "directions", "multiples", "shape"),
    [
        (FP8_1X128, ROW_COL, (128, 16), (200, 576)),  # SmolLM's width, 200 tokens
        (FP8_1X128, ROW_COL, (128, 16), (200, 40)),  # K below one block
        (FP8_1X128, ("columnwise",), (128, 16), (200, 40)),
        (NVFP4_2D, ROW_COL, (16, 16), (200, 72)),  # 2D tiles, a global amax, packed codes
        (NVFP4_2D, ROW_COL, (32, 32), (200, 72)),  # padded past the last tile: whole tiles cut
        (FP8_128X128, ROW_COL, (128, 8), (576, 1000)),  # an fp8 weight: K only
        (FP8_128X128, ROW_COL, (128, 128), (1000, 576)),  # partial tiles both ways
        (BUILTIN_FORMATS["mxfp8_e4m3"], ROW_COL, (32, 32), (48, 70)),
        (BUILTIN_FORMATS["mxfp6_e2m3"], ROW_COL, (32, 32), (70, 36)),  # 6-bit rows of 52.5 bytes
    ],
    ids=[
        "fp8-1x128-200x576",
        "fp8-1x128-200x40",
        "fp8-1x128-col-200x40",
        "nvfp4-16x16-200x72",
        "nvfp4-16x16-200x72-by-32",
        "fp8-128x128-576x1000",
        "fp8-128x128-1000x576",
        "mxfp8-48x70",
        "mxfp6-70x36",
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_refused_tile_shape_is_zero_padded_once_and_each_copy_gives_the_reference_bits(
    monkeypatch, fmt, directions, multiples, shape, dtype
) -> None:
    k_multiple, m_multiple = multiples
    launched = _stand_in(monkeypatch, k_multiple, m_multiple)
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    got = _quantize_tile(x, fmt, directions)
    rows, cols = shape
    padded = (-(-rows // m_multiple) * m_multiple, -(-cols // k_multiple) * k_multiple)
    assert padded != shape and launched == [padded]  # one launch, on the padded input
    assert got is not None and len(got) == len(directions)
    for i, (q, direction) in enumerate(zip(got, directions, strict=True)):
        want = _want(x, fmt, direction, 11 + i)
        assert q.shape == want.shape == (shape if direction == "rowwise" else shape[::-1])
        assert torch.equal(q.codes, want.codes), direction
        assert torch.equal(q.scales, want.scales), direction
        assert torch.equal(q.global_scale, want.global_scale), direction
        assert q.packed is None or q.packed.data.is_contiguous()


def test_a_column_rht_that_divides_m_is_padded_and_one_that_does_not_is_refused(
    monkeypatch,
) -> None:
    """The columnwise copy's RHT runs along x's columns (the rows of x.t()): padded where its
    size divides M (the padding's chunks transform to zeros), not where it does not."""
    from fp4gen.dsl.model import RHTSpec

    launched = _stand_in(monkeypatch, 32, 32)
    fmt = BUILTIN_FORMATS["nvfp4"]
    rht = RHTSpec(16, sign_source="none", signs=None, seed=None)
    x = torch.randn(48, 70)  # M 48: three 16-point chunks, padded to 64
    got = _quantize_tile(x, fmt, ROW_COL, rht=rht)
    assert launched == [(64, 96)] and got is not None
    want = _want(x, fmt, "columnwise", 12, rht)
    assert torch.equal(got[1].codes, want.codes) and torch.equal(got[1].scales, want.scales)
    assert torch.equal(got[1].global_scale, want.global_scale)
    assert _quantize_tile(torch.randn(40, 70), fmt, ROW_COL, rht=rht) is None  # 40 = 2.5 x 16
    assert launched == [(64, 96)]


@pytest.mark.parametrize("rounding", ["stochastic", "stochastic16"])
def test_stochastic_tile_copies_are_not_padded(monkeypatch, caplog, rounding) -> None:
    """A value's random bits follow its position in x (x.t() for the columnwise copy, whose
    rows are M long): a padded launch would draw others, so the copies run one by one."""
    fresh_log_records(monkeypatch)
    launched = _stand_in(monkeypatch, 32, 32)
    x = torch.randn(48, 70)
    outputs = (("rowwise", "nearest", None, 1), ("columnwise", rounding, None, 2))
    with caplog.at_level(logging.INFO, logger="fp4gen"):
        got = cute_backend.quantize_tile_cute(x, BUILTIN_FORMATS["mxfp8_e4m3"], outputs, seed=5)
    assert got is None and launched == []
    assert any("the copies run one by one" in r.getMessage() for r in caplog.records)


def test_a_2d_rowwise_launch_of_quantize_cute_is_padded(monkeypatch) -> None:
    """quantize (one rowwise copy) pads a 2D format's input too: the reference's partial tiles
    are zero-padded like the kernel's padded input."""
    launched = _stand_in(monkeypatch, 32)
    x = torch.randn(200, 72) * 3
    got = _quantize(x, NVFP4_2D)
    want = reference(x, NVFP4_2D)
    assert launched == [(200, 96)]
    assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
    assert torch.equal(got.global_scale, want.global_scale)


def test_block_targets_on_a_tile_wider_than_k_are_not_padded(monkeypatch) -> None:
    """The reference's tile is then K wide: its error sum adds the values in another order
    than a padded tile's, so the kernels are not handed the padded input."""
    fmt = dataclasses.replace(NVFP4_2D, targets=(6.0, 4.0), global_bound=256.0)
    assert cute_backend.padding_is_exact(fmt, "nearest", 16)
    assert not cute_backend.padding_is_exact(fmt, "nearest", 8)
    assert cute_backend.padding_is_exact(NVFP4_2D, "nearest", 8)  # amaxes only: any order
    launched = _stand_in(monkeypatch, 16)
    with pytest.raises(TensorError, match="K must be a multiple of 16"):
        _quantize(torch.randn(32, 8), fmt)
    got = _quantize(torch.randn(32, 24), fmt)  # K 24: the reference's tiles are 16 wide
    assert launched == [(32, 32)] and got.shape == (32, 24)


def test_padding_is_logged_once_per_kernel_and_k_whatever_the_rows(monkeypatch, caplog) -> None:
    fresh_log_records(monkeypatch)
    _stand_in(monkeypatch, 128, 16)
    with caplog.at_level(logging.INFO, logger="fp4gen"):
        for rows in (200, 232, 200):
            assert _quantize_tile(torch.randn(rows, 576), FP8_1X128, ROW_COL) is not None
    lines = [r.getMessage() for r in caplog.records if "zero-padded" in r.getMessage()]
    assert lines == [
        "quantize(backend='auto'): stand-in fp8_block 2 takes K in multiples of 128 and M in "
        "multiples of 16: an input is zero-padded (K 576 to 640, M to a multiple of 16) and the "
        "padding's codes and scales dropped (exact)"
    ]

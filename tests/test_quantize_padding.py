"""An input whose K the quantize kernels do not take (not whole blocks, or not the kernel's K
multiple) is zero-padded to that multiple, quantized by the kernels and the padding's codes and
scales dropped (``cute_backend._zero_padded``), where that is exact: 1D blocks rounded
deterministically, because the reference pads a row's last partial block with zeros itself.
On the CPU the generated kernels are stood in for by the reference itself, laid out as a
kernel writes its outputs, and refusing a K that is not a multiple of the kernel's: the
unpadded result must be the reference's of the unpadded input, bit for bit. The GPU test
runs the real kernels (tests/test_quantize_kernels_gpu.py)."""

from __future__ import annotations

import types

import pytest
import torch

from fp4gen.errors import TensorError
from fp4gen.formats import BUILTIN_FORMATS, E4M3, BlockFormat, ScaleSpec
from fp4gen.numerics.layout import pack
from fp4gen.numerics.quantize import quantize as reference
from fp4gen.runtime import cute_backend

FP8_1X128 = BlockFormat("fp8_block", E4M3, (1, 128), ScaleSpec(None, "nearest"), False)


def _stand_in(monkeypatch, k_multiple: int) -> list[int]:
    """Kernels that take K in multiples of ``k_multiple`` and compute the reference's outputs
    in a kernel's layout; returns the list of K each launch got."""
    launched: list[int] = []

    def launch(fmt, copies, x):
        rounding, rht = copies[0][1], copies[0][2]

        def run(x, *, seed=0, offset=0):
            launched.append(x.shape[1])
            q = reference(x, fmt, rounding=rounding, hadamard=rht, seed=seed, offset=offset)
            bits = fmt.element.bits
            coded = fmt.scale.element is not None
            return {
                "data": q.codes if bits == 8 else pack(q.codes, bits),
                "scales": q.scale_codes if coded else q.scales,
                "global_scale": q.global_scale,
            }

        module = types.SimpleNamespace(K_MULTIPLE=k_multiple)
        refused = None if x.shape[1] % k_multiple == 0 else f"K must be a multiple of {k_multiple}"
        kernels = types.SimpleNamespace(module=module, run=run)
        spec = types.SimpleNamespace(name=f"stand-in {fmt.name}")
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
    assert launched == [-(-cols // k_multiple) * k_multiple]  # the kernels ran, padded
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

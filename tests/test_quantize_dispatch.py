"""The oracle has no backend; ``fp4gen.runtime.quantize_dispatch`` chooses (CPU tests).

``fp4gen.numerics.quantize.quantize`` and ``fp4gen.numerics.mor.mor_quantize`` always run the
torch reference. ``quantize_dispatch.quantize`` / ``mor_quantize`` (``fp4gen.quantize`` is the
first) take ``backend=``: with "reference", and with "auto" on a CPU tensor, they return what the
oracle returns, bit for bit, and they reject bad arguments with the oracle's errors.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import fp4gen
import fp4gen.numerics
from fp4gen.dsl.model import RHTSpec
from fp4gen.errors import ArgumentError, FP4GenError, TensorError
from fp4gen.numerics import QuantizedTensor
from fp4gen.numerics.mor import MoRTensor, partition_block
from fp4gen.numerics.mor import mor_quantize as oracle_mor_quantize
from fp4gen.numerics.quantize import quantize as oracle_quantize
from fp4gen.runtime import quantize_dispatch


def test_the_oracle_has_no_backend_argument() -> None:
    for fn in (oracle_quantize, oracle_mor_quantize, fp4gen.numerics.quantize):
        assert "backend" not in inspect.signature(fn).parameters, fn
        assert "backend" not in (fn.__doc__ or "")
    assert not hasattr(fp4gen.numerics, "BACKENDS")


def test_the_public_quantize_is_the_backend_layers() -> None:
    assert fp4gen.quantize is quantize_dispatch.quantize
    params = inspect.signature(quantize_dispatch.quantize).parameters
    assert params["backend"].default == "auto"
    assert inspect.signature(quantize_dispatch.mor_quantize).parameters["backend"].default == "auto"
    assert quantize_dispatch.BACKENDS == ("auto", "reference", "cute")


def bits(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_same_quantized(a: QuantizedTensor, b: QuantizedTensor) -> None:
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(bits(a.scales), bits(b.scales))
    if b.scale_codes is None:
        assert a.scale_codes is None
    else:
        assert torch.equal(a.scale_codes, b.scale_codes)
    assert torch.equal(bits(a.global_scale), bits(b.global_scale))
    assert (a.format, a.rounding, a.rht, a.seed, a.offset) == (
        b.format,
        b.rounding,
        b.rht,
        b.seed,
        b.offset,
    )
    assert (a.shape, a.dtype, a.transposed) == (b.shape, b.dtype, b.transposed)


CASES = [
    ("nvfp4", None, "nearest", None),
    ("nvfp4", (16, 16), "stochastic", None),
    ("nvfp4", None, "stochastic8", 16),
    ("mxfp4", None, "stochastic16", RHTSpec(32, "seeded", None, 0)),
    ("mxfp8_e4m3", None, "zero", None),
    ("nvfp4", None, "nearest", 8),
]


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize(("fmt", "block", "rounding", "hadamard"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_backend_is_the_oracle_bit_for_bit(
    backend: str, fmt: str, block, rounding: str, hadamard, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 20, 64, generator=g) * 5).to(dtype)
    x[0, 0, :16] = 0.0
    x[1, 2, 3] = -1e-30
    kw = dict(block=block, rounding=rounding, hadamard=hadamard, seed=11, offset=3)
    got = quantize_dispatch.quantize(x, fmt, backend=backend, **kw)
    assert_same_quantized(got, oracle_quantize(x, fmt, **kw))
    assert torch.equal(got.dequantize(), oracle_quantize(x, fmt, **kw).dequantize())


def test_both_detach_their_input() -> None:
    x = torch.randn(4, 32, requires_grad=True)
    for q in (
        quantize_dispatch.quantize(x, "nvfp4", backend="reference"),
        oracle_quantize(x, "nvfp4"),
    ):
        assert q.codes.grad_fn is None and q.dequantize().grad_fn is None
    rule = fp4gen.load_recipe("mor_subtensor_2way").mors[0]
    mt = quantize_dispatch.mor_quantize(x, rule, backend="reference")
    assert mt.dequantize().grad_fn is None


def assert_same_mor(a: MoRTensor, b: MoRTensor) -> None:
    for name in ("choice", "codes", "high", "error_sum", "nonzero"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for sa, sb in zip(a.scales, b.scales, strict=True):
        if sb is None:
            assert sa is None
            continue
        assert torch.equal(sa.encode, sb.encode) and torch.equal(sa.decode, sb.decode)
    assert (a.spec, a.unit, a.rounding, a.rht, a.seed, a.offset, a.shape, a.dtype) == (
        b.spec,
        b.unit,
        b.rounding,
        b.rht,
        b.seed,
        b.offset,
        b.shape,
        b.dtype,
    )
    assert torch.equal(a.dequantize(), b.dequantize())


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("recipe", ["mor_tensor", "mor_subtensor_2way", "mor_subtensor_3way"])
@pytest.mark.parametrize(
    "kw",
    [{}, {"rounding": "stochastic", "seed": 5, "offset": 2}, {"hadamard": 16}, {"group": True}],
    ids=["nearest", "stochastic", "rht", "group"],
)
def test_mor_reference_backend_is_the_oracle_bit_for_bit(backend: str, recipe: str, kw) -> None:
    rule = fp4gen.load_recipe(recipe).mors[0]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 256, generator=g) * torch.exp2(torch.randint(-8, 9, (4, 1), generator=g))
    if "group" in kw:  # one block per GAM group
        kw = {"group": partition_block(rule.scale, *x.shape)}
    got = quantize_dispatch.mor_quantize(x, rule, backend=backend, **kw)
    assert_same_mor(got, oracle_mor_quantize(x, rule, **kw))


BAD_CALLS = [
    ({"rounding": "up"}, ArgumentError, "rounding must be one of"),
    ({"rounding": "up", "seed": -1}, ArgumentError, "rounding must be one of"),
    ({"seed": -1}, ArgumentError, "seed must be an integer"),
    ({"offset": 2**64}, ArgumentError, "offset must be an integer"),
    ({"fmt": "nvfp5", "seed": -1}, ArgumentError, "seed must be an integer"),
    ({"fmt": "nvfp5", "hadamard": 3}, ArgumentError, "unknown format 'nvfp5'"),
    ({"fmt": "bf16"}, TensorError, "high-precision dtype"),
    ({"block": (2, 16), "hadamard": 3}, ArgumentError, "blocks are 1xN or NxN"),
    ({"hadamard": 3}, ArgumentError, "the RHT size must be"),
]


@pytest.mark.parametrize("backend", ["reference", "auto", "cute"])
@pytest.mark.parametrize(("kw", "error", "message"), BAD_CALLS)
def test_bad_arguments_raise_the_oracles_error_first(backend: str, kw, error, message) -> None:
    """Every backend checks the arguments in the oracle's order before any kernel is tried."""
    kw = dict(kw)
    fmt = kw.pop("fmt", "nvfp4")
    x = torch.ones(2, 32)
    with pytest.raises(error, match=message) as want:
        oracle_quantize(x, fmt, **kw)
    with pytest.raises(error, match=message) as got:
        quantize_dispatch.quantize(x, fmt, backend=backend, **kw)
    assert str(got.value) == str(want.value)


def test_the_backend_is_checked_first() -> None:
    x = torch.ones(2, 32)
    rule = fp4gen.load_recipe("mor_tensor").mors[0]
    for bad in ("triton", "", None, 1):
        with pytest.raises(ArgumentError, match=r"backend must be one of \('auto', 'reference'"):
            quantize_dispatch.quantize(x, "nvfp5", rounding="up", backend=bad)  # type: ignore[arg-type]
        with pytest.raises(ArgumentError, match="backend must be one of"):
            quantize_dispatch.mor_quantize(x, rule, rounding="up", backend=bad)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="rounding must be one of"):
        quantize_dispatch.mor_quantize(x, rule, rounding="up", backend="cute")


def test_cute_needs_cuda_tensors() -> None:
    x = torch.ones(4, 32)
    with pytest.raises(FP4GenError, match="'cute' backend .* runs on CUDA tensors"):
        quantize_dispatch.quantize(x, "nvfp4", backend="cute")
    rule = fp4gen.load_recipe("mor_tensor").mors[0]
    with pytest.raises(FP4GenError, match="generated MoR kernels.*CUDA tensors"):
        quantize_dispatch.mor_quantize(x, rule, backend="cute")

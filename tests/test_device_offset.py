"""The Philox offset read from device memory (fp4gen.device_offset.DeviceOffset), CPU only: the
type, how generated modules turn it into kernel arguments, and the cross-compiled kernels' PTX
(one predicated 64-bit load of the counter). The GPU behaviour (bit equality with int offsets,
CUDA graph replays) is in test_device_offset_gpu.py."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from test_codegen_quantize import ALL_SPECS, TILE_SPECS  # noqa: E402

from fp4gen.codegen import import_source
from fp4gen.codegen.quantize import ARCHS, render
from fp4gen.device_offset import DeviceOffset

SPECS = ALL_SPECS | TILE_SPECS
ROW_SR = "quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8"
TILE_SR = "quant_e2m1_1x16_e4m3rn_g_bf16_row_sr8_col_sr8_rht16"
TILE_2D_SR = "nvfp4_2d_sr_swizzled"
ROW_RNE = "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne"
TILE_RNE = "quant_e2m1_1x16_e4m3rn_g_bf16_row_rne_col_rne_rht16"


def counter(value: int = 0) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64)


def words(value: int) -> list[int]:
    """(lo, hi) of a u64 as the int32 kernel scalars."""
    out = []
    for w in (value & 0xFFFFFFFF, value >> 32):
        out.append(w - (1 << 32) if w >= 1 << 31 else w)
    return out


def test_device_offset_type() -> None:
    c = counter(3)
    d = DeviceOffset(c, 8, (1, 2))
    assert d.slots == (1, 2) and d.stride == 8 and d.counter is c
    assert DeviceOffset(c, 8, 5).slots == (5,)
    assert d.offsets() == (25, 26)
    assert DeviceOffset(c, 8, 5).offsets(2) == (29, 29)
    # mod 2^64, the counter read as unsigned
    big = DeviceOffset(counter(-1), 3, (7,))
    assert big.offsets() == ((((1 << 64) - 1) * 3 + 7) % (1 << 64),)
    for bad in (
        lambda: DeviceOffset(torch.tensor([1], dtype=torch.int32), 8, 0),
        lambda: DeviceOffset(counter(), -1, 0),
        lambda: DeviceOffset(counter(), 1 << 64, 0),
        lambda: DeviceOffset(counter(), 8, ()),
        lambda: DeviceOffset(counter(), 8, (1 << 64,)),
        lambda: DeviceOffset(counter(), True, 0),
        lambda: DeviceOffset([0], 8, 0),
        lambda: DeviceOffset(torch.zeros(0, dtype=torch.int64), 8, 0),
    ):
        with pytest.raises(ValueError):
            bad()


@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp("device-offset")
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = import_source(render(SPECS[name]), directory)
        return cache[name]

    return get


def test_rowwise_offset_arguments(modules) -> None:
    """Kernel scalars (offset, counter address, stride; (lo, hi) each): an int offset has
    address 0 (the kernel reads nothing); a DeviceOffset its counter's address and its slot."""
    mod = modules(ROW_SR)
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    offset = (5 << 32) + 9
    assert mod._offset_args(offset, x) == [*words(offset), 0, 0, 0, 0]
    c = counter(2)
    stride = (1 << 33) + 8
    got = mod._offset_args(DeviceOffset(c, stride, 7), x)
    assert got == [*words(7), *words(c.data_ptr()), *words(stride)]
    with pytest.raises(ValueError, match="one DeviceOffset slot"):
        mod._offset_args(DeviceOffset(c, 8, (1, 2)), x)
    with pytest.raises(ValueError):
        mod._offset_args(-1, x)
    with pytest.raises(ValueError, match="counter is on"):
        mod._offset_args(DeviceOffset(c, 8, 1), torch.zeros(4, 32, device="meta"))


def test_tile_offset_arguments(modules) -> None:
    mod = modules(TILE_SR)
    x = torch.zeros(32, 32, dtype=torch.bfloat16)
    c = counter()
    assert mod._offsets(DeviceOffset(c, 8, (3, 4))) == (3, 4)
    assert mod._offsets(DeviceOffset(c, 8, 3)) == (3, 3)
    with pytest.raises(ValueError, match="one offset per output"):
        mod._offsets(DeviceOffset(c, 8, (1, 2, 3)))
    assert mod._counter_args(5, x) == [0, 0, 0, 0]
    assert mod._counter_args((5, 6), x) == [0, 0, 0, 0]
    stride = (3 << 32) + 1
    assert mod._counter_args(DeviceOffset(c, stride, 0), x) == [
        *words(c.data_ptr()),
        *words(stride),
    ]


def test_modules_without_stochastic_rounding_accept_a_device_offset(modules) -> None:
    """They ignore it (the kernels take no offset), but still check it."""
    mod = modules(ROW_RNE)
    assert "ctr_lo" not in render(SPECS[ROW_RNE])
    mod._check_offset(DeviceOffset(counter(), 8, 1))
    mod._check_offset(5)
    with pytest.raises(ValueError):
        mod._check_offset(-1)
    tile = modules(TILE_RNE)
    assert "ctr_lo" not in render(SPECS[TILE_RNE])
    assert tile._offsets(DeviceOffset(counter(), 8, (1, 2))) == (1, 2)


def test_run_signature_names_the_device_offset(modules) -> None:
    for name in (ROW_SR, TILE_SR, ROW_RNE):
        offset = inspect.signature(modules(name).run).parameters["offset"]
        assert "DeviceOffset" in str(offset.annotation) and offset.default == 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "name", [ROW_SR, TILE_SR, TILE_2D_SR, "quant_e2m1_1x32_ue8m0ru_nog_bf16_row_sr"]
)
def test_kernels_read_the_counter(name: str, arch: str, modules, tmp_path: Path) -> None:
    """One predicated 64-bit load of the counter (no access for an int offset: address 0) and a
    64-bit multiply-add; the Philox calls take the result."""
    mod = modules(name)
    fn = mod.compile_kernel("quantize", arch, dump_dir=str(tmp_path))
    ptx = "\n".join(line for line in fn.__ptx__.splitlines() if not line.lstrip().startswith("//"))
    assert ptx.count("@p ld.global.u64") == 1
    assert "mul.lo.s64" in ptx or "mul.lo.u64" in ptx or "mad.lo.s64" in ptx or "mad.lo.u64" in ptx
    assert "mul.wide.u32" in ptx  # Philox
    assert ".local" not in ptx


def test_tile_copies_join_into_one_device_offset() -> None:
    """The copies of one tile launch each bring a one-slot DeviceOffset; the launch takes one
    offset with every slot, made once per set of parts (a per-call build would cost host time)."""
    from fp4gen.errors import FP4GenError
    from fp4gen.runtime.cute_backend import _joined_offset

    counter = torch.zeros(1, dtype=torch.int64)
    row = DeviceOffset(counter, 8, (2,))
    col = DeviceOffset(counter, 8, (4,))
    joined = _joined_offset((row, col))
    assert joined.counter is counter and joined.stride == 8 and joined.slots == (2, 4)
    assert _joined_offset((row, col)) is joined
    other = DeviceOffset(torch.zeros(1, dtype=torch.int64), 8, (4,))
    with pytest.raises(FP4GenError, match="share one Philox counter"):
        _joined_offset((row, other))

"""The Philox offset read from device memory (``fp4gen.device_offset.DeviceOffset``), on a CUDA
GPU: a generated quantize module's ``run(fns, x, seed=, offset=DeviceOffset(counter, stride,
slots))`` gives, with counter[0] == c, every output bit for bit as the int offsets
c * stride + slots[i]; inside a captured CUDA graph that also advances the counter, two replays
draw different bits and each equals the eager call with its int offsets. Kernels without
stochastic rounding ignore the offset.

The kernels are called directly (``kernels_for``), as in test_quantize_kernels_gpu.py. Skipped
without a CUDA GPU (marker ``gpu``).
"""

from __future__ import annotations

import pytest
import torch
from gpu_kernel_cache import compiled_cache

from fp4gen.codegen.quantize import is_rowwise, render
from fp4gen.compiler.cache import KernelCache
from fp4gen.compiler.spec import QuantKernelSpec, QuantOutput
from fp4gen.device_offset import DeviceOffset
from fp4gen.dsl.model import RHTSpec
from fp4gen.formats import E2M1, E4M3, E5M2, UE8M0, BlockFormat, ScaleSpec
from fp4gen.numerics import quantize
from fp4gen.runtime.kernels import kernels_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NV = ScaleSpec(E4M3, "nearest")
MX = ScaleSpec(UE8M0, "up")
TE16 = RHTSpec(16)
SEEDED32 = RHTSpec(32, "seeded", None, 0)
ROW, COL = "rowwise", "columnwise"
SR, SR8, SR16 = "stochastic", "stochastic8", "stochastic16"
U64 = 1 << 64


def out(direction, rounding="nearest", rht=None, layout="compact"):
    return QuantOutput(direction, rounding, rht, layout)  # type: ignore[arg-type]


# kind -> (element, block, scale, global scale, outputs, M, K)
KINDS = {
    # rowwise template: 8, 16 and 32 random bits, with and without an RHT and a global scale
    "nvfp4_row_sr8": (E2M1, (1, 16), NV, True, (out(ROW, SR8),), 1000, 304),
    "nvfp4_row_sr": (E2M1, (1, 16), NV, True, (out(ROW, SR),), 272, 2048),
    "nvfp4_row_rht16_sr8": (E2M1, (1, 16), NV, True, (out(ROW, SR8, TE16),), 7, 2048),
    "mxfp4_row_rht32_sr": (E2M1, (1, 32), MX, False, (out(ROW, SR, SEEDED32),), 272, 608),
    "mxfp4_row_sr16": (E2M1, (1, 32), MX, False, (out(ROW, SR16),), 128, 1024),
    # tile template: two stochastically rounded copies with their own slots
    "nvfp4_dy_sr8": (E2M1, (1, 16), NV, True, (out(ROW, SR8), out(COL, SR8, TE16)), 272, 1024),
    "nvfp4_dy": (E2M1, (1, 16), NV, True, (out(ROW, SR), out(COL, SR, TE16)), 1008, 304),
    "mxfp4_dy": (E2M1, (1, 32), MX, False, (out(ROW, SR), out(COL, SR, SEEDED32)), 1024, 256),
    "nvfp4_2d_sr_swizzled": (
        E2M1,
        (16, 16),
        NV,
        True,
        (out(ROW, SR, None, "swizzled"), out(COL, SR, None, "swizzled")),
        1000,
        304,
    ),
    # one stochastic copy of two (not prepared constants, 4 warps per column block)
    "e5m2_1x128_row_sr": (
        E5M2,
        (1, 128),
        ScaleSpec(None),
        False,  # fp32 block scales take no global scale (numerics.md 2.1)
        (out(ROW, SR), out(COL)),
        256,
        512,
    ),
    # no stochastic rounding: the offset is ignored
    "nvfp4_row": (E2M1, (1, 16), NV, True, (out(ROW),), 1000, 304),
    "nvfp4_x": (E2M1, (1, 16), NV, True, (out(ROW), out(COL, rht=TE16)), 272, 304),
}
SR_KINDS = [k for k, v in KINDS.items() if any(o.rounding != "nearest" for o in v[4])]
PLAIN_KINDS = [k for k in KINDS if k not in SR_KINDS]
SEED = (0x5EED << 32) | 17
STRIDE = 8  # fp4gen.runtime.linear.STREAMS_PER_CALL: a stream per operand slot and call


def make_spec(kind: str) -> QuantKernelSpec:
    element, block, scale, global_scale, outputs, _, _ = KINDS[kind]
    return QuantKernelSpec(element, block, scale, global_scale, "bf16", outputs)


@pytest.fixture(scope="session")
def arch() -> str:
    major, _ = torch.cuda.get_device_capability()
    if major not in (9, 10):
        pytest.skip(f"no sm_90a/sm_100a kernels for compute capability {major}.x")
    return {9: "sm_90a", 10: "sm_100a"}[major]


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory, arch: str) -> KernelCache:
    """Every kernel of this file, compiled up front by worker processes (kept across sessions in
    $FP4GEN_GPU_TEST_CACHE when that is set)."""
    cache = compiled_cache(
        tmp_path_factory, "offset-cache", [make_spec(kind) for kind in KINDS], render, arch
    )
    return cache


@pytest.fixture(scope="module")
def kernels(kernel_cache: KernelCache, arch: str):
    def get(kind: str):
        spec = make_spec(kind)
        return spec, kernels_for(spec, arch, cache=kernel_cache)

    return get


def make_input(kind: str, salt: int = 1) -> torch.Tensor:
    *_, rows, cols = KINDS[kind]
    g = torch.Generator(device="cuda").manual_seed(salt)
    x = torch.randn(rows, cols, generator=g, device="cuda")
    x = x * torch.exp2(torch.randint(-6, 7, (rows, 1), generator=g, device="cuda").float())
    return x.to(torch.bfloat16).contiguous()


def slots_of(spec: QuantKernelSpec) -> tuple[int, ...]:
    """One slot per copy, both words with their top bits set (every counter word of Philox is
    exercised, and the kernel must zero-extend the low word)."""
    return tuple(((3 << 32) | 0xFFFFFF00) + 5 + i for i in range(len(spec.outputs)))


def int_offset(spec: QuantKernelSpec, count: int, stride: int, slots: tuple[int, ...]):
    """The int offset(s) equal to a DeviceOffset with counter value ``count``."""
    offsets = tuple((count * stride + s) % U64 for s in slots)
    return offsets[0] if is_rowwise(spec) else offsets


def run(loaded, x: torch.Tensor, offset) -> dict[str, torch.Tensor]:
    return loaded.module.run(loaded.fns, x, seed=SEED, offset=offset)


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if x.dtype == torch.float32:  # compare fp32 by bits (a NaN S_dec would equal itself)
            x, y = x.contiguous().view(torch.int32), y.contiguous().view(torch.int32)
        assert torch.equal(x, y), f"{what}: {key} differs"


def sr_keys(spec: QuantKernelSpec) -> list[str]:
    """The code outputs that stochastic rounding draws for."""
    return [
        ("" if o.direction == ROW else "col_") + "data"
        for o in spec.outputs
        if o.rounding != "nearest"
    ]


@pytest.mark.parametrize("kind", SR_KINDS)
def test_device_offset_equals_int_offsets(kind: str, kernels) -> None:
    spec, loaded = kernels(kind)
    x = make_input(kind)
    slots = slots_of(spec)
    # counter values: 0, small, past 2^32, negative (read as unsigned); strides: the runtime's,
    # one with only a high word, one with the top bit of both words set
    for count in (0, 5, (1 << 33) + 7, -3):
        for stride in (STRIDE, (1 << 61) + 3, 0x9E3779B97F4A7C15):
            counter = torch.tensor([count], dtype=torch.int64, device="cuda")
            got = run(loaded, x, DeviceOffset(counter, stride, slots))
            want = run(loaded, x, int_offset(spec, count, stride, slots))
            torch.cuda.synchronize()
            assert_same(got, want, f"{spec.name}, counter {count}, stride {stride}")
    # and the int offsets are the reference's (docs/numerics.md 5)
    counter = torch.tensor([9], dtype=torch.int64, device="cuda")
    got = run(loaded, x, DeviceOffset(counter, STRIDE, slots))
    fmt = BlockFormat("test", spec.element, spec.block, spec.scale, spec.global_scale)
    for o, slot in zip(spec.outputs, slots, strict=True):
        if spec.block[0] != 1 and o.direction == COL:
            continue  # a 2D columnwise copy is the rowwise codes transposed
        src = x if o.direction == ROW else x.t().contiguous()
        ref = quantize(
            src,
            fmt,
            rounding=o.rounding,
            hadamard=o.rht,
            seed=SEED,
            offset=(9 * STRIDE + (slot if spec.block[0] == 1 else slots[0])) % U64,
        )
        key = ("" if o.direction == ROW else "col_") + "data"
        assert torch.equal(got[key], ref.data), f"{spec.name}: {key} differs from the reference"


@pytest.mark.parametrize("kind", ["nvfp4_row_sr8", "nvfp4_dy_sr8"])
def test_one_slot_and_a_counter_view(kind: str, kernels) -> None:
    """A single slot serves every copy (as an int offset does); the counter may be an element
    of a larger tensor (its address, not its storage's, is read)."""
    spec, loaded = kernels(kind)
    x = make_input(kind, 2)
    storage = torch.arange(10, 20, dtype=torch.int64, device="cuda")
    counter = storage[3:4]  # holds 13
    got = run(loaded, x, DeviceOffset(counter, STRIDE, 6))
    want = run(loaded, x, 13 * STRIDE + 6)  # an int offset: every copy's
    torch.cuda.synchronize()
    assert_same(got, want, spec.name)


@pytest.mark.parametrize("kind", PLAIN_KINDS)
def test_kernels_without_stochastic_rounding_ignore_it(kind: str, kernels) -> None:
    spec, loaded = kernels(kind)
    x = make_input(kind, 3)
    counter = torch.tensor([123], dtype=torch.int64, device="cuda")
    got = run(loaded, x, DeviceOffset(counter, STRIDE, slots_of(spec)[:1]))
    assert_same(got, run(loaded, x, 0), spec.name)


@pytest.mark.parametrize("kind", SR_KINDS)
def test_cuda_graph_replays_draw_fresh_bits(kind: str, kernels) -> None:
    """A graph capturing run() with a DeviceOffset and counter.add_(1): every replay reads the
    counter the previous one advanced, so two replays differ, and replay i equals the eager
    call with the int offsets of counter value c0 + i."""
    spec, loaded = kernels(kind)
    x = make_input(kind, 4)
    slots = slots_of(spec)
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    offset = DeviceOffset(counter, STRIDE, slots)
    # warm up outside the capture (lazy loading, allocator), on a side stream as torch asks
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(loaded, x, offset)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(loaded, x, offset)
        counter.add_(1)
    c0 = 41
    counter.fill_(c0)
    replays = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        replays.append({k: v.clone() for k, v in captured.items()})
    assert int(counter.item()) == c0 + 3
    for key in sr_keys(spec):
        assert not torch.equal(replays[0][key], replays[1][key]), f"{key}: same bits twice"
        assert not torch.equal(replays[1][key], replays[2][key]), f"{key}: same bits twice"
    for i, got in enumerate(replays):
        want = run(loaded, x, int_offset(spec, c0 + i, STRIDE, slots))
        torch.cuda.synchronize()
        assert_same(got, want, f"{spec.name}, replay {i}")

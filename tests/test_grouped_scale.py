"""The grouped experts' epilogue (``fp4gen.runtime.grouped_scale``): round(fp32(c[rows]) *
alpha) in one pass. On the CPU: the torch path's arithmetic, the argument checks, and the
kernel's cross-compilation for both archs (no GPU needed). On a GPU: the kernel against the
torch path bit for bit (bf16, fp16 and fp32 outputs, with and without the row gather, odd
shapes, subnormal and huge values), and an MoE layer's output and gradients with the kernel
on and off."""

from __future__ import annotations

import pytest
import torch

import fp4gen
from fp4gen.errors import TensorError
from fp4gen.kernels.grouped_scale import ScaleRowsParams
from fp4gen.runtime import grouped_scale
from fp4gen.runtime.grouped_scale import compile_scale_rows, scale_rows, set_scale_kernel

OUT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def product(rows: int, cols: int, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    """A bf16 product with every kind of value the epilogue meets: normal values over many
    binades, bf16 subnormals, signed zeros, the largest finite values."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(rows, cols, generator=g) * torch.exp2(
        torch.randint(-20, 20, (rows, cols), generator=g)
    )
    flat = c.view(-1)
    if flat.numel() >= 8:
        flat[:4] = torch.tensor([2.0**-130, -(2.0**-133), -0.0, 3.0e38])
    return c.to(torch.bfloat16).to(device)


def alphas(rows: int, device: str = "cpu", seed: int = 1) -> torch.Tensor:
    """Per-row S_dec(A) S_dec(B) from tiny (subnormal results) to large (overflow to inf in
    16 bits), a few groups' worth of repeats."""
    g = torch.Generator().manual_seed(seed)
    groups = torch.exp2(torch.randint(-30, 30, (max(-(-rows // 5), 1),), generator=g).float())
    groups *= torch.rand(groups.shape, generator=g) + 0.5
    return (
        groups.repeat_interleave(5)[:rows].contiguous().to(device)
        if rows
        else groups[:0].to(device)
    )


def oracle(c: torch.Tensor, alpha: torch.Tensor, out: torch.dtype, rows=None) -> torch.Tensor:
    taken = c if rows is None else c[rows.long()]
    return (taken.float() * alpha[:, None]).to(out)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtypes, shapes and bytes (NaN-free inputs; -0.0 and +0.0 told apart)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("out", sorted(OUT_DTYPES))
@pytest.mark.parametrize("gather", [False, True])
def test_the_torch_path_is_one_fp32_multiply_and_one_rounding(out: str, gather: bool) -> None:
    c = product(37, 24)
    rows = torch.tensor([36, 0, 5, 5, 17], dtype=torch.int32) if gather else None
    alpha = alphas(5 if gather else 37)
    got = scale_rows(c, alpha, OUT_DTYPES[out], rows=rows)
    assert same_bits(got, oracle(c, alpha, OUT_DTYPES[out], rows))


def test_an_fp32_product_is_scaled_in_place() -> None:
    c = product(9, 16).float()
    alpha = alphas(9)
    want = c * alpha[:, None]
    got = scale_rows(c, alpha, torch.float32)
    assert got.data_ptr() == c.data_ptr() and torch.equal(got, want)


def test_bad_arguments_name_the_rule() -> None:
    c = product(4, 8)
    with pytest.raises(TensorError, match="fp32 \\[rows\\] alphas"):
        scale_rows(c, alphas(4).double(), torch.bfloat16)
    with pytest.raises(TensorError, match="4 output rows need as many alphas"):
        scale_rows(c, alphas(3), torch.bfloat16)
    with pytest.raises(TensorError, match="2-D product"):
        scale_rows(c[None], alphas(4), torch.bfloat16)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_the_kernel_cross_compiles(arch: str, tmp_path) -> None:
    """Every variant compiles without a GPU; the PTX loads and stores 16 bytes at a time and
    rounds with cvt.rn (the bits of torch's conversion)."""
    for out in OUT_DTYPES:
        for gather in (False, True):
            dump = tmp_path / f"{out}-{gather}"
            compile_scale_rows(ScaleRowsParams(out=out, gather=gather), arch, dump_dir=str(dump))
            (ptx,) = dump.glob("*.ptx")
            text = ptx.read_text()
            assert "ld.global.v4.b32" in text and "st.global.v4.b32" in text
            assert "fma" not in text
            if out != "fp32":
                assert "cvt.rn." in text


# ---- on a GPU


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from fp4gen.compiler.jit import detect_arch

    if detect_arch(torch.device("cuda")) not in ("sm_90a", "sm_100a"):
        pytest.skip("the kernel is compiled for sm_90a and sm_100a")


@pytest.mark.gpu
@pytest.mark.parametrize("out", sorted(OUT_DTYPES))
@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize(("rows", "cols"), [(0, 8), (1, 8), (7, 24), (1000, 2048), (4099, 768)])
def test_the_kernel_gives_the_torch_paths_bits(
    out: str, gather: bool, rows: int, cols: int
) -> None:
    _cuda()
    c = product(rows + 3, cols, "cuda", seed=rows)
    g = torch.Generator().manual_seed(cols)
    index = (
        torch.randint(0, rows + 3, (rows,), generator=g, dtype=torch.int32).cuda()
        if gather
        else None
    )
    n = rows if gather else rows + 3
    alpha = alphas(n, "cuda")
    assert grouped_scale._kernel(c, alpha, OUT_DTYPES[out], index) is not None
    got = scale_rows(c, alpha, OUT_DTYPES[out], rows=index)
    previous = set_scale_kernel(False)
    try:
        want = scale_rows(c, alpha, OUT_DTYPES[out], rows=index)
    finally:
        set_scale_kernel(previous)
    assert same_bits(got, want)
    assert same_bits(got, oracle(c, alpha, OUT_DTYPES[out], index))


@pytest.mark.gpu
def test_layouts_the_kernel_does_not_take_run_torch() -> None:
    _cuda()
    c = product(16, 12, "cuda")  # 12 columns: not whole 16-byte units
    assert grouped_scale._kernel(c, alphas(16, "cuda"), torch.bfloat16, None) is None
    assert same_bits(
        scale_rows(c, alphas(16, "cuda"), torch.bfloat16),
        oracle(c, alphas(16, "cuda"), torch.bfloat16),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["nvfp4_small", "mxfp4", "nvfp4_no_bf16"])
def test_an_moe_layer_trains_the_same_with_the_kernel(recipe: str) -> None:
    """The grouped path's fprop, dgrad (the real rows gathered) and wgrad (bf16, fp16 and fp32
    models: the kernel's three outputs) with the epilogue kernel and with torch's ops: the
    same bits."""
    _cuda()
    pytest.importorskip("transformers")
    from test_moe import build, experts_of, routing, run
    from test_moe_grouped import unequal_routing

    results = []
    for enabled in (True, False):
        previous = set_scale_kernel(enabled)
        try:
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                model = fp4gen.convert(build("qwen3_moe", dtype).cuda(), recipe, seed=3)
                experts = experts_of(model)
                experts.grouped = True
                for index, weights in (routing(70, empty=None), unequal_routing()):
                    hidden = torch.randn(index.shape[0], 64).to(dtype).cuda()
                    out, dx, dw_routing, grads = run(
                        experts, hidden, index.cuda(), weights.to(dtype).cuda()
                    )
                    results.append([out, dx, dw_routing, *grads.values()])
        finally:
            set_scale_kernel(previous)
    half = len(results) // 2
    for got, want in zip(results[:half], results[half:], strict=True):
        for a, b in zip(got, want, strict=True):
            assert same_bits(a, b)

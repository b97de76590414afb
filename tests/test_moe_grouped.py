"""Grouped GEMMs of the experts (fp4gen.runtime.grouped) on the CPU: the grouped path quantizes
every expert's operands exactly as the per-expert loop does (the same bits, the same epilogue),
so with the same per-group products it equals the loop bit for bit; torch._grouped_mm's product
is within the fp32 summation-order bound of the float64 product (docs/numerics.md 6), and the
BF16 product the CUDA kernel writes within one more bf16 rounding of it."""

from __future__ import annotations

import logging

import pytest
import torch

import fp4gen
import fp4gen.runtime.grouped as grouped
import fp4gen.runtime.linear as linear_module
from fp4gen.dsl import parse_recipe
from fp4gen.gemm_dispatch import gemm
from fp4gen.runtime.grouped import GroupedProjection, Groups

transformers = pytest.importorskip("transformers")

from test_moe import ARCHS, RNE, build, experts_of, routing, run  # noqa: E402

U32 = 2.0**-24  # fp32 unit roundoff


def unequal_routing(tokens: int = 70) -> tuple[torch.Tensor, torch.Tensor]:
    """top-2 over 4 experts with very unequal groups: expert 0 gets every token (slot 0),
    expert 1 one token, expert 2 none, expert 3 the rest (slot 1)."""
    index = torch.zeros(tokens, 2, dtype=torch.long)
    index[:, 1] = 3
    index[5, 1] = 1
    weights = torch.softmax(torch.randn(tokens, 2, generator=torch.Generator().manual_seed(4)), 1)
    return index, weights


@pytest.fixture
def dequant_loop(monkeypatch):
    """The per-expert loop's GEMMs on the dequantize path (block values, an fp32 torch GEMM,
    the shared epilogue) instead of the CPU's float64 reference, and the grouped path's
    products a torch.mm per group: the two paths then sum every product in the same order."""
    monkeypatch.setattr(
        linear_module, "gemm", lambda a, b, **kw: gemm(a, b, backend="dequant", **kw)
    )
    monkeypatch.setattr(grouped, "grouped_mm_available", lambda: False)


def pair(arch: str, dtype: torch.dtype, recipe: str = "nvfp4_no_bf16", device: str = "cpu"):
    """Two converted copies of one model's first experts module: the loop and the grouped."""
    loop, group = (
        experts_of(fp4gen.convert(build(arch, dtype).to(device), recipe, seed=5)) for _ in range(2)
    )
    loop.grouped, group.grouped = False, True
    return loop, group


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("routed", ["top2", "unequal", "every"])
def test_grouped_equals_the_loop_bit_for_bit(arch, dtype, routed, dequant_loop) -> None:
    """The full NVFP4 recipe (stochastic rounding of the gradients, RHT on wgrad), biases
    (gpt-oss), an expert without tokens, very unequal groups, and every expert routed: output,
    dx, the routing weights' gradient and every parameter's gradient are the loop's bits."""
    loop, group = pair(arch, dtype)
    if routed == "unequal":
        index, weights = unequal_routing()
    else:
        index, weights = routing(40, empty=1 if routed == "top2" else None)
    hidden = torch.randn(index.shape[0], 64).to(dtype)
    want = run(loop, hidden, index, weights.to(dtype))
    got = run(group, hidden, index, weights.to(dtype))
    for a, b in zip(got[:3], want[:3], strict=True):
        assert torch.equal(a, b)
    empty = {"top2": 1, "unequal": 2}.get(routed)
    for name, grad in want[3].items():
        assert torch.equal(got[3][name], grad), name
        if not name.endswith("bias"):
            assert grad.abs().sum() > 0
            assert all(grad[e].any() != (e == empty) for e in range(grad.shape[0])), name
    assert got[0].abs().sum() > 0
    # both paths counted the same calls (the next step's random streams)
    for pl, pg in zip(loop.gemms, group.gemms, strict=True):
        for a, b in zip(pl, pg, strict=True):
            assert (a._forward_calls, a._backward_calls) == (b._forward_calls, b._backward_calls)


@pytest.fixture
def grouped_quantize_on_the_cpu(monkeypatch):
    """The grouped path's grouped quantize on CPU tensors (the kernels' launch sites, with the
    groups quantized one by one by the reference, the definition the kernels are held to),
    and a record of the products of S_dec taken for every group at once."""
    from fp4gen.runtime import grouped_quantize, grouped_tile

    monkeypatch.setattr(grouped, "_serves", lambda t: grouped._grouped_quantize[0])
    for module, name in (
        (grouped_quantize, "quantize_groups"),
        (grouped_tile, "quantize_groups_tile"),
    ):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _real=real, **kw: _real(*a, **{**kw, "backend": "reference"})
        )
    taken: list[int] = []
    real_alphas = grouped._group_alphas

    def group_alphas(a, b):
        got = real_alphas(a, b)
        if got is not None:
            taken.append(got.numel())
        return got

    monkeypatch.setattr(grouped, "_group_alphas", group_alphas)
    return taken


@pytest.mark.parametrize("arch", ARCHS)
def test_every_groups_global_scales_at_once_are_the_loops_bits(
    arch, dequant_loop, grouped_quantize_on_the_cpu
) -> None:
    """Where every group's operands come from one grouped quantize, the grouped GEMMs scale by
    S_dec(a_e) S_dec(b_e) of every group as one product (fprop, dgrad, wgrad): the loop's bits,
    an expert without tokens and very unequal groups included."""
    loop, group = pair(arch, torch.float32)
    for index, weights in (routing(40, empty=1), unequal_routing()):
        hidden = torch.randn(index.shape[0], 64, generator=torch.Generator().manual_seed(7))
        want, got = run(loop, hidden, index, weights), run(group, hidden, index, weights)
        assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True))
        assert all(torch.equal(got[3][n], want[3][n]) for n in want[3])
    # both projections' three GEMMs, both routings: the groups' alphas were taken at once
    assert len(grouped_quantize_on_the_cpu) == 12
    assert set(grouped_quantize_on_the_cpu) <= {2, 3}


def test_an_int32_routing_index_is_the_int64_one(dequant_loop) -> None:
    """The grouped path counts each expert's tokens from the routing index whatever its integer
    type (a model's own router may give int32): the same output and gradients."""
    _, group = pair("qwen3_moe", torch.float32)
    index, weights = routing(24, empty=1)
    index[::5, 1] = 4  # an expert-parallel sentinel among them
    hidden = torch.randn(24, 64, generator=torch.Generator().manual_seed(3))
    want = run(group, hidden, index, weights)
    _, again = pair("qwen3_moe", torch.float32)
    got = run(again, hidden, index.to(torch.int32), weights)
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True))
    assert all(torch.equal(got[3][n], want[3][n]) for n in want[3])


def test_a_second_step_draws_the_loops_streams(dequant_loop) -> None:
    loop, group = pair("mixtral", torch.float32)
    index, weights = routing(40, empty=1)
    for step in range(2):
        hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(step))
        want, got = run(loop, hidden, index, weights), run(group, hidden, index, weights)
        assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True)), step
        assert all(torch.equal(got[3][n], want[3][n]) for n in want[3]), step


def test_sentinel_experts_and_no_tokens(dequant_loop) -> None:
    """An expert-parallel sentinel (an index outside [0, E)) is another rank's expert: skipped
    as the loop skips it; a batch with no tokens, or only sentinels, gives zeros."""
    loop, group = pair("qwen3_moe", torch.float32)
    index, weights = routing(24, empty=2)
    index[::3, 1] = 4  # the sentinel transformers' expert parallelism writes (num_experts)
    hidden = torch.randn(24, 64)
    want, got = run(loop, hidden, index, weights), run(group, hidden, index, weights)
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True))
    assert torch.equal(group(hidden, torch.full((24, 2), 4), weights), torch.zeros(24, 64))
    out = group(torch.randn(0, 64), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 64)


def sum_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Entry-wise bound of an fp32 sum of K exact products against the float64 sum rounded
    once (docs/numerics.md 6): (K + 8) u sum_k |a_k b_k|, in float64."""
    k = a.shape[-1]
    return (k + 8) * U32 * (a.double().abs() @ b.double().abs().transpose(-1, -2))


def recorded_products(
    monkeypatch, arch: str, device: str = "cpu"
) -> list[tuple[str, torch.Tensor, torch.Tensor, list]]:
    """The block values every grouped GEMM of one training step of the experts is given."""
    calls: list[tuple[str, torch.Tensor, torch.Tensor, list]] = []
    rows, k = grouped.group_rows, grouped.group_k

    def record_rows(a, b, ends, offs=None):
        calls.append(("rows", a.clone(), b.clone(), list(ends)))
        return rows(a, b, ends, offs)

    def record_k(a, b, ends, offs=None):
        calls.append(("k", a.clone(), b.clone(), list(ends)))
        return k(a, b, ends, offs)

    monkeypatch.setattr(grouped, "group_rows", record_rows)
    monkeypatch.setattr(grouped, "group_k", record_k)
    _, group = pair(arch, torch.bfloat16, device=device)
    index, weights = unequal_routing()
    hidden = torch.randn(70, 64).to(torch.bfloat16)
    run(group, hidden.to(device), index.to(device), weights.to(torch.bfloat16).to(device))
    monkeypatch.undo()
    assert [c[0] for c in calls] == ["rows", "rows", "rows", "k", "rows", "k"]
    return calls


def per_group(kind: str, a: torch.Tensor, b: torch.Tensor, ends: list) -> list:
    """(exact float64 product, its summation bound) per group."""
    starts = [0, *ends[:-1]]
    out = []
    for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
        ga, gb = (a[s:e], b[g]) if kind == "rows" else (a[:, s:e], b[:, s:e])
        out.append((ga.double() @ gb.double().t(), sum_bound(ga, gb)))
    return out


def pieces(kind: str, c: torch.Tensor, ends: list) -> list:
    starts = [0, *ends[:-1]]
    return [
        c[s:e] if kind == "rows" else c[g]
        for g, (s, e) in enumerate(zip(starts, ends, strict=True))
    ]


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_grouped_mm_is_within_the_summation_bound(monkeypatch, arch) -> None:
    """torch._grouped_mm on the CPU (fp32 block values: exact) against the float64 product of
    each group: within (K + 8) u sum |a b| entry-wise, the bound of any fp32 summation order.
    (The BF16 product of the CUDA kernel is checked on the GPU: the CPU's bf16 GEMM does not
    accumulate as the kernel does.)"""
    assert grouped.grouped_mm_available()  # torch 2.9+ has it for CPU tensors
    for kind, a, b, ends in recorded_products(monkeypatch, arch):
        fn = grouped.group_rows if kind == "rows" else grouped.group_k
        c = fn(a, b, ends)
        assert c.dtype == torch.float32
        for got, (exact, bound) in zip(
            pieces(kind, c, ends), per_group(kind, a, b, ends), strict=True
        ):
            assert ((got.double() - exact).abs() <= bound).all()


def test_without_grouped_mm_a_loop_of_mm_gives_the_same_product(monkeypatch, caplog) -> None:
    """Both branches: torch._grouped_mm where torch has it, else a loop of torch.mm (logged
    once at INFO); on fp32 block values both are within the summation bound, and here equal."""
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(48, 32, generator=g), torch.randn(3, 16, 32, generator=g)
    at, bt = torch.randn(16, 48, generator=g), torch.randn(24, 48, generator=g)
    ends = [16, 16, 48]  # an empty group in the middle
    with_mm = grouped.group_rows(a, b, ends), grouped.group_k(at, bt, ends)
    monkeypatch.setattr(grouped, "grouped_mm_available", lambda: False)
    grouped._logged.clear()
    with caplog.at_level(logging.INFO, logger="fp4gen.runtime.grouped"):
        loop = grouped.group_rows(a, b, ends), grouped.group_k(at, bt, ends)
        grouped.group_rows(a, b, ends)
    assert [r.getMessage() for r in caplog.records].count(
        "this torch has no torch._grouped_mm: the expert GEMMs run a loop of torch.mm"
    ) == 1
    assert with_mm[0].shape == loop[0].shape == (48, 16)
    assert with_mm[1].shape == loop[1].shape == (3, 16, 24)
    assert not loop[1][1].any()  # the empty group: a zero product
    for kind, (pa, pb), c_mm, c_loop in zip(
        ("rows", "k"), ((a, b), (at, bt)), with_mm, loop, strict=True
    ):
        exact = per_group(kind, pa, pb, ends)
        for c in (c_mm, c_loop):
            for got, (want, bound) in zip(pieces(kind, c, ends), exact, strict=True):
                assert ((got.double() - want).abs() <= bound).all()


def test_the_path_chosen(caplog) -> None:
    """Who runs grouped: never on the CPU's float64 reference by default (the dense layer's
    numerics), wherever the formats allow with grouped=True; the loop, with the reason, for a
    format whose values are not exact in bf16 and no block-scaled FP8 pair, MoR, telemetry, or
    grouped=False. FP8 with fp32 block scales (fp8_blockwise) runs grouped: its products are
    the dense layer's block-scaled FP8 GEMMs (fp4gen.runtime.fp8_grouped; per expert on the
    CPU)."""
    cpu = torch.device("cpu")
    module = experts_of(fp4gen.convert(build("mixtral"), "nvfp4_no_bf16"))
    assert "CPU tensors" in module.loop_reason(module.operands, cpu)
    module.grouped = True
    assert module.loop_reason(module.operands, cpu) is None
    fp4gen.runtime.convert.enable_telemetry(module, 1)
    assert "telemetry" in module.loop_reason(module.operands, cpu)
    fp4gen.runtime.convert.enable_telemetry(module, 0)
    module.grouped = False
    assert "turned off" in module.loop_reason(module.operands, cpu)
    module = experts_of(fp4gen.convert(build("mixtral"), "mor_tensor"))
    module.grouped = True
    assert "not a block" in module.loop_reason(module.operands, cpu)
    module = experts_of(fp4gen.convert(build("mixtral"), "fp8_blockwise"))
    module.grouped = True
    assert module.loop_reason(module.operands, cpu) is None
    ref = experts_of(fp4gen.convert(build("mixtral"), "nvfp4_no_bf16", backend="reference"))
    assert "reference backend" in ref.loop_reason(ref.operands, cpu)


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_a_forced_grouped_path_on_an_fp8_recipe_is_the_loop(caplog, arch) -> None:
    """grouped=True with fp8_blockwise on the CPU: the grouped path quantizes as the loop does
    and runs each expert's dense FP8 GEMM with its bias (the grouped and K-grouped kernels
    need CUDA: said once per projection and GEMM at INFO), the same bits as grouped=False."""
    from fp4gen.runtime import fp8_grouped

    fp8_grouped._logged.clear()
    loop, group = pair(arch, torch.float32, "fp8_blockwise")  # gpt-oss: biases, [E, in, out]
    index, weights = routing(24, empty=0)
    hidden = torch.randn(24, 64)
    previous = fp8_grouped.set_grouped_fp8(True)  # on, so the reason said is the CPU's
    try:
        with caplog.at_level(logging.INFO, logger="fp4gen.runtime.fp8_grouped"):
            want, got = run(loop, hidden, index, weights), run(group, hidden, index, weights)
    finally:
        fp8_grouped.set_grouped_fp8(previous)
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True))
    assert all(torch.equal(got[3][n], want[3][n]) for n in want[3])
    lines = sorted(r.getMessage() for r in caplog.records if r.name.endswith("fp8_grouped"))
    assert lines == sorted(
        f"model.layers.0.mlp.experts.{proj}: the experts' {gemm} GEMMs run per expert: CPU "
        "tensors: the dense GEMM per expert"
        for proj in ("gate_up_proj", "down_proj")
        for gemm in ("fprop", "dgrad", "wgrad")  # wgrad: the K-grouped kernel's
    ), lines


def test_rne_grouped_training_step_against_the_reference(dequant_loop) -> None:
    """A converted model whose experts run grouped trains (a loss that goes down over a few
    steps at a fixed batch), with the RNE recipe."""
    model = fp4gen.convert(build("qwen3_moe"), parse_recipe(RNE, base_dir=None))
    for layer in model.model.layers:
        layer.mlp.experts.grouped = True
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    losses = []
    for step in range(4):
        fp4gen.set_step(model, step)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


def test_double_backward_is_refused() -> None:
    module = experts_of(fp4gen.convert(build("mixtral"), "nvfp4_no_bf16"))
    groups = Groups([0], [4], [module.gemms[0][1]], False, torch.float32, "experts.down_proj")
    x = torch.randn(4, 32, requires_grad=True)
    y = GroupedProjection.apply(x, module.down_proj, None, groups)
    with pytest.raises(fp4gen.FP4GenError, match="double backward"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


def test_under_autocast_the_grouped_product_keeps_fp32_values(dequant_loop) -> None:
    """bf16 autocast (fp32 weights): each GEMM's output is bf16, but the block values are
    multiplied as given (autocast would round them to bf16 inside torch._grouped_mm): the
    grouped path equals the loop bit for bit, as without autocast."""
    loop, group = pair("qwen3_moe", torch.float32)
    index, weights = unequal_routing(40)
    hidden = torch.randn(40, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = run(loop, hidden, index, weights), run(group, hidden, index, weights)
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True))
    assert all(torch.equal(got[3][n], want[3][n]) for n in want[3])


def test_non_finite_inputs_as_the_loop(dequant_loop) -> None:
    """A NaN in one token's hidden state: propagated as the loop propagates it (the same
    outputs, NaN where the loop has NaN) by default; with the raise mode a TensorError, as the
    loop raises, naming the projection and its input as given."""
    from fp4gen.runtime import finite

    loop, group = pair("mixtral", torch.float32)
    index, weights = routing(24, empty=1)
    hidden = torch.randn(24, 64)
    hidden[5, 3] = float("nan")
    with torch.no_grad():
        want, got = loop(hidden, index, weights), group(hidden, index, weights)
    assert torch.isnan(want).any()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    previous = finite.layer_mode()
    finite.set_layer_mode("raise")
    try:
        with pytest.raises(fp4gen.errors.TensorError) as grouped_error:
            group(hidden, index, weights)
        with pytest.raises(fp4gen.errors.TensorError) as loop_error:
            loop(hidden, index, weights)
    finally:
        finite.set_layer_mode(previous)
    assert "model.layers.0.mlp.experts.gate_up_proj: the input of shape (48, 64)" in str(
        grouped_error.value
    )
    assert "non-finite" in str(loop_error.value)


@pytest.mark.parametrize(("arch", "grouped"), [("sm_90a", True), ("sm_100a", False)])
def test_the_cuda_default(monkeypatch, caplog, arch: str, grouped: bool) -> None:
    """The automatic choice on CUDA (pure logic, no GPU: the arch is given): grouped on sm_90a,
    where the dense GEMM takes the dequantize path; per expert on sm_100a (the native MMA),
    said once at INFO."""
    import fp4gen.compiler.jit as jit
    import fp4gen.runtime.experts as experts_module

    monkeypatch.setattr(jit, "detect_arch", lambda device=None: arch)
    module = experts_of(fp4gen.convert(build("mixtral"), "nvfp4_no_bf16"))
    experts_module._logged.clear()
    cuda = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger="fp4gen.runtime.experts"):
        reasons = [module.loop_reason(module.operands, cuda) for _ in range(2)]
    assert (reasons[0] is None) == grouped and reasons[0] == reasons[1]
    lines = [r.getMessage() for r in caplog.records]
    if grouped:
        assert not lines
    else:
        assert lines == [
            "model.layers.0.mlp.experts: the experts' GEMMs run per expert: "
            "sm_100a: the native block-scaled MMA reads the codes, per expert"
        ]


def test_the_grouped_product_setting() -> None:
    """set_grouped_product: "bf16" (default) or "fp32", process-wide, the previous returned;
    anything else an FP4GenError naming the choices. The CPU's products are fp32 either way."""
    assert grouped.set_grouped_product("fp32") == "bf16"
    try:
        assert grouped.product_dtype(torch.device("cpu")) == torch.float32
        assert grouped.product_dtype(torch.device("cuda")) == torch.float32
        a, b = torch.randn(20, 32), torch.randn(2, 8, 32)
        fp32_mode = grouped.group_rows(a, b, [5, 20])
    finally:
        assert grouped.set_grouped_product("bf16") == "fp32"
    assert grouped.product_dtype(torch.device("cuda")) == torch.bfloat16
    assert torch.equal(grouped.group_rows(a, b, [5, 20]), fp32_mode)
    with pytest.raises(fp4gen.FP4GenError, match=r"unknown grouped product 'fp16'.*'bf16', 'fp32'"):
        grouped.set_grouped_product("fp16")


@pytest.mark.parametrize(
    ("counts", "padded"),
    [([3, 0, 5], [16, 0, 16]), ([1], [128]), ([37, 5, 60, 300], [64, 16, 64, 304]), ([], [])],
)
def test_real_rows_are_each_groups_first_rows_of_its_padded_ones(counts, padded) -> None:
    """real_rows (dgrad's real tokens among the padded ones): group g's counts[g] rows from the
    sum of the padded counts before it, the per-group aranges it replaces, on a few launches."""
    want, start = [], 0
    for count, pad in zip(counts, padded, strict=True):
        want += range(start, start + count)
        start += pad
    got = grouped.real_rows(counts, padded, torch.device("cpu"))
    assert got.dtype == torch.int32 and got.tolist() == want  # the epilogue kernel's index


ROWSCALED = """recipe rowscaled_experts "per-token global scales, every block quantized"
extends "nvfp4_no_bf16.fp4r"
format nvfp4_row = nvfp4 global row
operands {
    fprop.activation : nvfp4_row
}
"""


def test_per_row_global_scales_run_per_expert(dequant_loop) -> None:
    """A recipe with per-row global scales (per token on the fprop activation, as
    nvfp4_rowscaled) runs its experts through Linear's op one by one, which applies each row's
    scale: the grouped products and the grouped kernels keep one global scale per expert, so
    they refuse it with the reason, and the groups' reference quantization has no single S_dec
    per group either. Forced grouped, the experts take the loop's bits."""
    import dataclasses

    import fp4gen.runtime.grouped_quantize as gq
    import fp4gen.runtime.grouped_tile as gt
    from fp4gen.formats import BUILTIN_FORMATS
    from fp4gen.numerics.quantize import quantize as reference_quantize

    loop, group = pair("qwen3_moe", torch.float32, parse_recipe(ROWSCALED))
    reason = grouped.pass_reason(group.operands)
    assert reason is not None and "per-row global scales" in reason
    assert group.loop_reason(group.operands, torch.device("cuda")) == reason
    index, weights = routing(40, empty=1)
    hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    want, got = run(loop, hidden, index, weights), run(group, hidden, index, weights)
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True))
    assert all(torch.equal(got[3][n], want[3][n]) for n in want[3])
    per_row = dataclasses.replace(BUILTIN_FORMATS["nvfp4"], global_rows=True)
    x = torch.randn(8, 32)
    assert "per-row global scales" in gq._kernel_reason(x, per_row, "nearest", None)
    assert "per-row global scales" in gt._kernel_reason(x, per_row, (("rowwise", "nearest", None),))
    groups = [reference_quantize(x[:3], per_row), None, reference_quantize(x[3:], per_row)]
    assert gq.stacked_scales(groups) is None


def test_routing_tables_hold_the_groups_rows_ends_offsets_and_shifts() -> None:
    """``RoutingTables.of``: one copy holding each group's rows, their running ends, the
    offsets (0, then the ends) and the shift of each group's padded rows from its real ones;
    ``real_rows`` gives the same index from them as from the host lists."""
    cpu = torch.device("cpu")
    padded, real = [16, 0, 32, 16], [3, 0, 20, 16]
    t = grouped.RoutingTables.of(padded, real, cpu)
    assert t.counts.tolist() == padded and t.counts.dtype == torch.int32
    assert t.ends.tolist() == [16, 16, 48, 64]
    assert t.offsets.tolist() == t.host_offsets == [0, 16, 16, 48, 64]
    assert t.shifts.tolist() == [0, 13, 13, 25]  # padded first row - real first row
    counts = grouped.RoutingTables.of(real, real, cpu).counts
    assert torch.equal(
        grouped.real_rows(real, padded, cpu, (t.shifts, counts)),
        grouped.real_rows(real, padded, cpu),
    )


def test_grouped_fp8_launches_take_the_routings_offsets_only_where_they_are_theirs() -> None:
    from fp4gen.runtime.fp8_grouped import offsets_tensor

    cpu = torch.device("cpu")
    t = grouped.RoutingTables.of([16, 0, 32], [16, 0, 32], cpu)
    assert offsets_tensor([16, 0, 32], t.for_launch(), cpu) is t.offsets
    other = offsets_tensor([16, 16, 16], t.for_launch(), cpu)  # not these groups
    assert other is not t.offsets and other.tolist() == [0, 16, 32, 48]
    assert offsets_tensor([8], None, cpu).tolist() == [0, 8]


def test_both_projections_of_a_routing_share_its_tables(monkeypatch) -> None:
    """The experts' grouped path copies the routing's tables once per layer pass: one set for
    the forward's counts, one for the backward's padded rows, whatever the projections."""
    made = []
    real_of = grouped.RoutingTables.of.__func__

    def counted(cls, rows, real, device):
        made.append(tuple(rows))
        return real_of(cls, rows, real, device)

    monkeypatch.setattr(grouped.RoutingTables, "of", classmethod(counted))
    _, group = pair("mixtral", torch.bfloat16)
    index, weights = unequal_routing()
    hidden = torch.randn(70, 64).to(torch.bfloat16)
    run(group, hidden, index, weights.to(torch.bfloat16))
    assert len(made) == 2 and made[0] != made[1]  # the routing's counts, then padded

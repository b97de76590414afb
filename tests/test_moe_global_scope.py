"""The global scale's scope of the experts' operands (``global per expert|tensor``, docs/numerics.md
13): the recipe language (parse, print, errors are in test_recipe_errors.py), the grouped
quantize's per-tensor definition, the per-expert loop and the grouped path giving the same bits
for both scopes, and the scope changing the result where the experts' amaxes differ. All on
the CPU; the kernels' GPU tests are at the end."""

from __future__ import annotations

import pytest
import torch

import fp4gen
import fp4gen.runtime.grouped as grouped
from fp4gen.dsl import parse_recipe, print_recipe
from fp4gen.dsl.model import Operand
from fp4gen.formats import BUILTIN_FORMATS
from fp4gen.numerics.hadamard import rht
from fp4gen.runtime.grouped_quantize import quantize_groups
from fp4gen.runtime.grouped_scope import quantize_scoped

transformers = pytest.importorskip("transformers")

from test_moe import ARCHS, build, experts_of, routing, run  # noqa: E402
from test_moe_grouped import dequant_loop, unequal_routing  # noqa: E402, F401

NVFP4 = BUILTIN_FORMATS["nvfp4"]
PER_TENSOR = 'extends "nvfp4_no_bf16"\noperands {\n    * : global per tensor\n}\n'
FE4M3_MAX_X_E2M1_MAX = 448.0 * 6.0  # what the global scale maps the amax onto (nvfp4)


def s_dec(amax: float) -> torch.Tensor:
    """S_dec = 1 / fp32(fp32(448 * 6) / A), as docs/numerics.md 2.1 defines it (fp32)."""
    s_enc = torch.tensor(FE4M3_MAX_X_E2M1_MAX, dtype=torch.float32) / torch.tensor(
        amax, dtype=torch.float32
    )
    return 1.0 / s_enc


# --- the recipe language -------------------------------------------------------------------------


def test_the_scope_parses_prints_and_carries_over_format_changes() -> None:
    text = (
        "operands {\n    * : nvfp4 global per tensor\n    weight : nvfp4 block 16x16\n"
        "    gradient : global per expert\n}\n"
    )
    recipe = parse_recipe(text)
    scopes = {op: spec.global_scope for op, spec in recipe.operands.items()}
    assert scopes == {
        Operand.FPROP_ACTIVATION: "tensor",
        Operand.FPROP_WEIGHT: "tensor",  # a later format keeps it, as rounding and RHT
        Operand.DGRAD_GRADIENT: "expert",
        Operand.DGRAD_WEIGHT: "tensor",
        Operand.WGRAD_GRADIENT: "expert",
        Operand.WGRAD_ACTIVATION: "tensor",
    }
    printed = print_recipe(recipe)
    assert "fprop.weight     : nvfp4 block 16x16 round nearest rht none global per tensor" in (
        printed
    )
    assert "dgrad.gradient   : nvfp4 block 1x16 round nearest rht none\n" in printed
    assert parse_recipe(printed) == recipe


def test_the_default_is_per_expert_and_prints_as_before() -> None:
    plain = parse_recipe("operands {\n    * : nvfp4\n}\n")
    explicit = parse_recipe("operands {\n    * : nvfp4 global per expert\n}\n")
    assert plain == explicit
    assert all(spec.global_scope == "expert" for _, spec in plain.operands.items())
    assert "global per" not in print_recipe(plain)
    # a shipped recipe's canonical text is unchanged
    assert "global per" not in print_recipe(fp4gen.load_recipe("nvfp4"))


def test_extends_and_a_later_bf16_rule_with_the_scope() -> None:
    recipe = parse_recipe(PER_TENSOR)
    assert all(spec.global_scope == "tensor" for _, spec in recipe.operands.items())
    assert recipe.layers == fp4gen.load_recipe("nvfp4_no_bf16").layers


# --- the grouped quantize's definition ----------------------------------------------------------


@pytest.mark.parametrize("rht_size", [None, 16])
def test_per_tensor_groups_are_the_rows_of_the_whole_tensor(rht_size) -> None:
    """Round to nearest, 1x16 blocks: with one amax over every group, each group's codes,
    block scales and S_dec are those rows of quantizing the whole tensor at once (an independent
    definition: fp4gen.quantize of the concatenation), empty and one-row groups included; per
    expert each group has its own S_dec."""
    g = torch.Generator().manual_seed(3)
    counts = [5, 0, 1, 26]
    x = torch.randn(sum(counts), 64, generator=g).to(torch.bfloat16)
    x[6:] *= 40  # the last group holds the amax
    spec_rht = None if rht_size is None else fp4gen.dsl.model.RHTSpec(16)
    whole = fp4gen.quantize(x, NVFP4, hadamard=spec_rht)
    seeds, offsets = [1, 2, 3, 4], [0, 7, 0, 3]
    got = quantize_groups(x, counts, NVFP4, rht=spec_rht, seeds=seeds, offsets=offsets,
                          scope="tensor")  # fmt: skip
    assert got[1] is None
    start = 0
    for q, count in zip(got, counts, strict=True):
        if count == 0:
            continue
        rows = slice(start, start + count)
        assert torch.equal(q.codes, whole.codes[rows])
        assert torch.equal(q.scale_codes, whole.scale_codes[rows])
        assert torch.equal(q.global_scale, whole.global_scale)
        assert q.rht == spec_rht and q.shape == (count, 64) and q.dtype == torch.bfloat16
        start += count
    values = x.float() if rht_size is None else rht(x, spec_rht)
    assert torch.equal(whole.global_scale, s_dec(values.abs().max().item()))
    own = quantize_groups(x, counts, NVFP4, rht=spec_rht, seeds=seeds, offsets=offsets)
    assert not torch.equal(own[0].global_scale, got[0].global_scale)
    assert torch.equal(own[3].global_scale, got[3].global_scale)  # it holds the amax


def test_per_tensor_stochastic_rounding_keeps_each_groups_stream() -> None:
    """Stochastic rounding: group g draws from its own seed and offset, indexed from its first
    element, with the shared S_enc: ``quantize_scoped`` of its rows (the appended amax row
    comes last, so no real element's field moves)."""
    g = torch.Generator().manual_seed(5)
    counts = [3, 9]
    x = torch.randn(12, 32, generator=g)
    x[0] *= 30
    got = quantize_groups(x, counts, NVFP4, rounding="stochastic8", seeds=[11, 12],
                          offsets=[4, 9], scope="tensor")  # fmt: skip
    spec = fp4gen.dsl.model.OperandSpec(NVFP4, "stochastic8")
    amax = x.abs().max()
    want = quantize_scoped(x[3:], spec, amax, seed=12, offset=9)
    assert torch.equal(got[1].codes, want.codes)
    assert torch.equal(got[1].global_scale, s_dec(amax.item()))
    # the rows of the group alone, its own amax: the codes move, the stream does not
    alone = fp4gen.quantize(x[3:], NVFP4, rounding="stochastic8", seed=12, offset=9)
    assert not torch.equal(alone.codes, got[1].codes)


def test_quantize_scoped_with_2d_blocks_and_a_partial_block_row() -> None:
    """16x16 blocks, 24 rows: the rows are zero-padded to the block height before the amax
    row is appended, so the last (partial) block-row's scales are those of the rows alone."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(24, 32, generator=g)
    fmt = NVFP4.with_block((16, 16))
    spec = fp4gen.dsl.model.OperandSpec(fmt)
    own = fp4gen.quantize(w, fmt)
    same = quantize_scoped(w, spec, w.abs().max(), seed=0, offset=0)
    assert torch.equal(same.codes, own.codes) and torch.equal(same.scale_codes, own.scale_codes)
    assert torch.equal(same.global_scale, own.global_scale)
    larger = quantize_scoped(w, spec, w.abs().max() * 8, seed=0, offset=0)
    assert larger.scale_codes.shape == own.scale_codes.shape == (2, 2)
    assert torch.equal(larger.global_scale, s_dec(w.abs().max().item() * 8))


def test_the_scope_needs_one_global_amax() -> None:
    with pytest.raises(fp4gen.errors.FP4GenError, match="needs one global amax"):
        quantize_groups(torch.ones(4, 32), [4], BUILTIN_FORMATS["mxfp4"], seeds=[0],
                        offsets=[0], scope="tensor")  # fmt: skip


# --- the experts: loop and grouped, both scopes -------------------------------------------------


def pair(arch: str, dtype: torch.dtype, recipe):
    loop, group = (experts_of(fp4gen.convert(build(arch, dtype), recipe, seed=5)) for _ in range(2))
    loop.grouped, group.grouped = False, True
    return loop, group


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("routed", ["top2", "unequal"])
@pytest.mark.usefixtures("dequant_loop")
def test_per_tensor_grouped_equals_the_loop_bit_for_bit(arch, dtype, routed):
    """The full NVFP4 recipe per tensor (stochastic gradients, RHT 16 on wgrad, 16x16 weights
    whose dgrad copy is the transpose of the fprop codes), an expert without tokens and very
    unequal groups: output, dx, the routing weights' gradient and every parameter's gradient
    are the loop's bits, over two steps."""
    loop, group = pair(arch, dtype, parse_recipe(PER_TENSOR))
    index, weights = routing(40, empty=1) if routed == "top2" else unequal_routing()
    for step in range(2):
        hidden = torch.randn(index.shape[0], 64, generator=torch.Generator().manual_seed(step))
        want = run(loop, hidden.to(dtype), index, weights.to(dtype))
        got = run(group, hidden.to(dtype), index, weights.to(dtype))
        for a, b in zip(got[:3], want[:3], strict=True):
            assert torch.equal(a, b), step
        for name, grad in want[3].items():
            assert torch.equal(got[3][name], grad), (step, name)
        assert got[0].abs().sum() > 0


def global_scales(monkeypatch, module, hidden, index, weights):
    """One step of the grouped path (``run``'s results) and the S_dec of every expert GEMM's
    operands in it, by GEMM ("fprop", "dgrad", "wgrad") and side (a: the activation or
    gradient, b: the other)."""
    seen: dict[str, list[torch.Tensor]] = {}
    observe = grouped.observe_pair

    def record(layer, gemm, call, a, b):
        seen.setdefault(f"{gemm}.a", []).append(a.global_scale.clone())
        seen.setdefault(f"{gemm}.b", []).append(b.global_scale.clone())

    monkeypatch.setattr(grouped, "observe_pair", record)
    results = run(module, hidden, index, weights)
    monkeypatch.setattr(grouped, "observe_pair", observe)
    return results, seen


def scaled_experts(arch: str, scope: str, grouped_gemms: bool):
    """The first experts module under the per-``scope`` recipe, expert 1's up weights x50."""
    text = PER_TENSOR.replace("tensor", scope)
    module = experts_of(fp4gen.convert(build(arch), parse_recipe(text), seed=5))
    module.grouped = grouped_gemms
    with torch.no_grad():
        getattr(module, module.layout.up)[1] *= 50
    return module


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.usefixtures("dequant_loop")
def test_the_scope_changes_the_result_where_the_amaxes_differ(arch, monkeypatch):
    """One expert's weights 50x larger, and that expert left without tokens: per expert every
    GEMM's global scales differ between the experts; per tensor each operand's S_dec is one
    value for all, the weights' from the amax of the whole parameter (the unrouted expert's
    too), and the outputs and gradients differ (the loop's equal the grouped path's for
    both)."""
    results, scales = {}, {}
    index, weights = routing(40, empty=1)
    hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(9))
    for scope in ("expert", "tensor"):
        module = scaled_experts(arch, scope, True)
        results[scope], scales[scope] = global_scales(monkeypatch, module, hidden, index, weights)
        loop = run(scaled_experts(arch, scope, False), hidden, index, weights)
        assert all(torch.equal(a, b) for a, b in zip(loop[:3], results[scope][:3], strict=True))
        up_amax = getattr(module, module.layout.up).detach().abs().max().item()
    for key in ("fprop.a", "fprop.b", "dgrad.a", "wgrad.a"):
        per_expert = torch.stack(scales["expert"][key])
        per_tensor = torch.stack(scales["tensor"][key])
        assert len(set(per_expert.tolist())) > 1, key
        assert len(set(per_tensor.tolist())) == 2, key  # the up and the down projection
    fprop_w = scales["tensor"]["fprop.b"][:3]  # the up projection's three routed experts
    assert all(torch.equal(s, s_dec(up_amax)) for s in fprop_w)
    for a, b in zip(results["expert"][:3], results["tensor"][:3], strict=True):
        assert not torch.equal(a, b)


# --- GPU: the grouped quantize kernels ----------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rounding", ["nearest", "stochastic8"])
@pytest.mark.parametrize("rht_size", [None, 16])
def test_kernels_per_tensor_bit_for_bit(rounding, rht_size) -> None:
    """The grouped kernels with scope "tensor" (the amax kernel over every row as one group,
    the quantize kernel reading that amax in every group's slot) give the reference's bits:
    unequal, one-row and empty groups, the amax in a middle group; a NaN in one group makes
    every group's S_dec NaN (one amax for all)."""
    g = torch.Generator().manual_seed(11)
    counts = [300, 0, 1, 17, 0, 1000]
    x = torch.randn(sum(counts), 256, generator=g)
    x[301:318] *= 64
    x = x.to(torch.bfloat16).cuda()
    spec_rht = None if rht_size is None else fp4gen.dsl.model.RHTSpec(16)
    args = dict(rounding=rounding, rht=spec_rht, seeds=[3, 1, 4, 1, 5, 9],
                offsets=[2, 6, 5, 3, 5, 8], scope="tensor")  # fmt: skip
    got = quantize_groups(x, counts, NVFP4, backend="cute", **args)
    want = quantize_groups(x, counts, NVFP4, backend="reference", **args)
    assert got.whole is not None
    for a, b, count in zip(got, want, counts, strict=True):
        if count == 0:
            assert a is None and b is None
            continue
        assert torch.equal(a.data, b.data)
        assert torch.equal(a.scale_codes, b.scale_codes)
        assert torch.equal(a.global_scale, b.global_scale)
    x[5, 3] = float("nan")  # in the first group
    got = quantize_groups(x, counts, NVFP4, backend="cute", **args)
    assert [q is None or bool(torch.isnan(q.global_scale)) for q in got] == [True] * 6


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_grouped_quantize_per_tensor_equals_per_expert_quantization(arch) -> None:
    """On CUDA the grouped path with the grouped quantize (the fprop activations and the
    batched weights of every expert in one launch each, per tensor: the weights' amax over
    every expert, one of which has no tokens) and without it (each expert's layer quantizes its
    operand with the scope's amax, ``quantize_scoped``) give the same operands, so the same
    outputs and gradients bit for bit (the same grouped products)."""
    recipe = parse_recipe(PER_TENSOR)
    results = []
    for served in (True, False):
        previous = grouped.set_grouped_quantize(served)
        try:
            module = experts_of(fp4gen.convert(build(arch, torch.bfloat16).cuda(), recipe, seed=5))
            module.grouped = True
            index, weights = unequal_routing()
            hidden = torch.randn(70, 64, generator=torch.Generator().manual_seed(1))
            hidden = hidden.to(torch.bfloat16).cuda()
            results.append(run(module, hidden, index.cuda(), weights.to(torch.bfloat16).cuda()))
        finally:
            grouped.set_grouped_quantize(previous)
    kernels, per_expert = results
    for a, b in zip(kernels[:3], per_expert[:3], strict=True):
        assert torch.equal(a, b)
    for name, grad in per_expert[3].items():
        assert torch.equal(kernels[3][name], grad), name


# --- export ---------------------------------------------------------------------------------------


def test_export_per_tensor_round_trips_the_training_operands(tmp_path) -> None:
    """Exported per tensor, every expert's layers carry the one global scale of its 3-D
    parameter (weight_scale_2, gate and up alike), and import_quantized gives each expert's
    fprop weight operand as training quantizes it (``quantize_scoped`` with the parameter's
    amax) bit for bit."""
    from safetensors.torch import load_file

    model = fp4gen.convert(build("qwen3_moe"), parse_recipe(PER_TENSOR), seed=5)
    fp4gen.export_quantized(model, tmp_path / "out")
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    state, _ = fp4gen.import_quantized(tmp_path / "out")
    module = experts_of(model)
    for proj, names in ((0, ("gate_proj", "up_proj")), (1, ("down_proj",))):
        weight = getattr(module, module.layout.weights[proj]).detach()
        amax = weight.abs().amax()
        scales = {
            tensors[f"model.layers.0.mlp.experts.{e}.{name}.weight_scale_2"].item()
            for e in range(4)
            for name in names
        }
        assert scales == {s_dec(amax.item()).item()}
        key = "gate_up_proj" if proj == 0 else "down_proj"
        for e in range(4):
            spec = module.gemms[e][proj].operands.fprop_weight
            want = quantize_scoped(weight[e], spec, amax, seed=0, offset=0).dequantize()
            assert torch.equal(state[f"model.layers.0.mlp.experts.{key}"][e], want), (proj, e)


# --- the grouped quantize in the experts, per tensor ---------------------------------------------

# 1x16 weights (so the weights and W^T are grouped too) and every operand per tensor
ONE_D_PER_TENSOR = (
    "operands {\n * : nvfp4 global per tensor\n gradient : round stochastic8\n"
    " wgrad.activation : rht 16 signs te\n wgrad.gradient : rht 16 signs te\n}\n"
)
ALL_SR_PER_TENSOR = "operands {\n * : nvfp4 round stochastic8 global per tensor\n}\n"


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("recipe", [ONE_D_PER_TENSOR, ALL_SR_PER_TENSOR])
@pytest.mark.usefixtures("dequant_loop")
def test_grouped_quantize_per_tensor_gives_the_loops_bits(monkeypatch, arch, recipe) -> None:
    """The grouped path with its grouped quantize per tensor (the reference definition standing
    in for the kernels, so this runs on the CPU): the tokens of the three experts with tokens in
    one call, the batched weights and W^T of all four experts (the weights' amax is over every
    expert; the one without tokens is quantized and left out), so the results equal the loop's
    bit for bit over two steps."""
    import fp4gen.runtime.grouped_quantize as gq

    calls: list[tuple[int, str]] = []
    real = gq.quantize_groups

    def definition(rows, counts, fmt, **kw):
        calls.append((len(counts), kw["scope"]))
        return real(rows, counts, fmt, **{**kw, "backend": "reference"})

    monkeypatch.setattr(grouped, "_serves", lambda t: True)
    monkeypatch.setattr(gq, "quantize_groups", definition)
    loop, group = pair(arch, torch.bfloat16, parse_recipe(recipe))
    index, weights = routing(40, empty=1)
    for step in range(2):
        hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(step))
        hidden = hidden.to(torch.bfloat16)
        want = run(loop, hidden, index, weights.to(torch.bfloat16))
        got = run(group, hidden, index, weights.to(torch.bfloat16))
        assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True)), step
        assert all(torch.equal(got[3][n], want[3][n]) for n in want[3]), step
    # per step: each projection's x (the 3 experts with tokens) and W (all 4) in the forward,
    # each one's W^T (all 4) in the backward
    forward, backward = [(3, "tensor"), (4, "tensor")] * 2, [(4, "tensor")] * 2
    assert calls == (forward + backward) * 2


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("recipe", [ONE_D_PER_TENSOR, ALL_SR_PER_TENSOR])
def test_cuda_grouped_quantize_per_tensor_is_the_loops(monkeypatch, arch, recipe) -> None:
    """On CUDA with the grouped kernels per tensor: every expert GEMM's operands are the
    per-expert loop's bit for bit (tests/moe_harness.py, products handed on), very unequal
    groups with an empty expert; the kernels served every grouped operand (none fell back)."""
    from moe_harness import harnessed_run, operand_differences, result_differences

    import fp4gen.runtime.grouped_quantize as gq

    calls: list[str] = []
    real = gq.quantize_groups

    def counted(*args, **kw):
        calls.append(kw["backend"])
        return real(*args, **kw)

    monkeypatch.setattr(gq, "quantize_groups", counted)
    loop, group = (
        experts_of(fp4gen.convert(build(arch, torch.bfloat16).cuda(), parse_recipe(recipe),
                                  seed=5))
        for _ in range(2)
    )  # fmt: skip
    loop.grouped, group.grouped = False, True
    index, weights = unequal_routing()
    hidden = torch.randn(70, 64).to(torch.bfloat16).cuda()
    args = (hidden, index.cuda(), weights.to(torch.bfloat16).cuda())
    want = harnessed_run(loop, *args, check=True)
    got = harnessed_run(group, *args, check=True)
    assert calls == ["cute"] * 6
    problems = want.harness.problems + got.harness.problems
    problems += operand_differences(got.harness, want.harness)
    problems += result_differences(got, want)
    assert not problems, "\n".join(problems)


def test_calibrated_export_per_tensor_gives_every_expert_the_widest_input_scale(tmp_path) -> None:
    """Calibrated per tensor, every expert's gate and up get the input scale of the amax over
    all experts' routed tokens (one amax over every expert, as training takes it); per expert
    (test_export_moe) each gets its own."""
    from safetensors.torch import load_file
    from test_export_moe import routed_amax

    from fp4gen.export import _global_decode_scale

    ids = [
        torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(s)) for s in (1, 2)
    ]
    model = build("qwen3_moe")
    recipe = parse_recipe(PER_TENSOR)
    fp4gen.export_quantized(model, tmp_path / "out", recipe, calibration=ids)
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = routed_amax(model, ids)
    widest = max(v for (e, proj), v in want.items() if proj == 0)
    assert len({v for (e, proj), v in want.items() if proj == 0}) > 1  # the experts differ
    for e in range(4):
        prefix = f"model.layers.0.mlp.experts.{e}"
        for name in ("gate_proj", "up_proj"):
            assert float(tensors[f"{prefix}.{name}.input_scale"]) == _global_decode_scale(widest)


def test_fp4gen_show_names_the_scope_where_it_is_per_tensor() -> None:
    from fp4gen.describe import operand_format_text, operand_json

    recipe = parse_recipe(PER_TENSOR.replace("}", "    gradient : global per expert\n}"))
    spec = recipe.operands[Operand.FPROP_WEIGHT]
    assert operand_format_text(spec) == "nvfp4, global per tensor"
    assert operand_json(spec)["global_scope"] == "tensor"
    grad = recipe.operands[Operand.DGRAD_GRADIENT]
    assert operand_format_text(grad) == "nvfp4" and "global_scope" not in operand_json(grad)


@pytest.mark.usefixtures("dequant_loop")
def test_the_wgrad_activation_amax_is_over_the_transformed_padded_copies(monkeypatch) -> None:
    """nvfp4's wgrad.activation has RHT 16 along the tokens: per tensor, its S_dec is that of
    the amax over the experts of rht(x_e zero-padded to 16 tokens, transposed), computed here
    by hand from each expert's routed tokens (an independent check of the operand the amax is
    taken of), for every expert of the up projection."""
    index, weights = routing(40, empty=1)
    hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(4))
    module = experts_of(fp4gen.convert(build("qwen3_moe"), parse_recipe(PER_TENSOR), seed=5))
    module.grouped = True
    _, scales = global_scales(monkeypatch, module, hidden, index, weights)
    spec = module.gemms[0][0].operands.wgrad_activation
    assert spec.rht is not None and spec.rht.size == 16
    amax = 0.0
    for e in (0, 2, 3):
        _, token_idx = torch.where((index == e).t())
        x = hidden[token_idx]
        padded = torch.zeros(-(-x.shape[0] // 16) * 16, 64)
        padded[: x.shape[0]] = x
        amax = max(amax, rht(padded.t().contiguous(), spec.rht).abs().max().item())
    up = scales["wgrad.b"][3:]  # the backward runs the down projection first
    assert all(torch.equal(s, s_dec(amax)) for s in up)


@pytest.mark.usefixtures("dequant_loop")
def test_a_nan_in_one_experts_tokens_reaches_every_expert_per_tensor() -> None:
    """Propagating non-finite inputs (the default): a NaN in one token makes the amax over
    every expert NaN, so every routed token's output is NaN per tensor (in the loop and the
    grouped path alike); per expert only the tokens of that token's experts are."""
    index = torch.tensor([[0, 1]] * 20 + [[2, 3]] * 20)  # two halves, two experts each
    weights = torch.softmax(torch.randn(40, 2, generator=torch.Generator().manual_seed(2)), 1)
    hidden = torch.randn(40, 64, generator=torch.Generator().manual_seed(6))
    hidden[7, 5] = float("nan")
    others = torch.arange(40) >= 20  # the tokens of the experts token 7 is not routed to
    for scope in ("expert", "tensor"):
        text = PER_TENSOR.replace("tensor", scope)
        outs = []
        for grouped_gemms in (False, True):
            module = experts_of(fp4gen.convert(build("qwen3_moe"), parse_recipe(text), seed=5))
            module.grouped = grouped_gemms
            with torch.no_grad():
                outs.append(module(hidden, index, weights))
        assert torch.equal(outs[0].isnan(), outs[1].isnan())
        nan_rows = outs[0].isnan().all(dim=1)
        if scope == "tensor":
            assert nan_rows.all()
        else:
            assert not nan_rows[others].any() and nan_rows[7]

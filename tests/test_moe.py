"""Mixture-of-Experts models under a recipe: fp4gen.convert replaces transformers' experts
modules (Mixtral, Qwen3-MoE, gpt-oss) by GroupedExperts, whose per-expert GEMMs run the
recipe's operand table (fp4gen.runtime.experts). Small configs: 2 layers, hidden 64, 4
experts, top-2, on the CPU."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import fp4gen
from fp4gen.dsl import parse_recipe
from fp4gen.numerics import gemm_reference, quantize
from fp4gen.runtime.convert import report
from fp4gen.runtime.experts import EXPERT_SEED_STRIDE, GroupedExperts, experts_layout

transformers = pytest.importorskip("transformers")

ARCHS = ("mixtral", "qwen3_moe", "gpt_oss")
# every GEMM operand NVFP4 rounded to nearest, weights in 16x16 tiles (no RHT, no random bits):
# the per-expert reference below is short
RNE = "operands {\n * : nvfp4\n weight : block 16x16\n}\n"
HIGH = "operands {\n * : bf16\n}\n"


def build(arch: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    common = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
    )
    if arch == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=32, num_local_experts=4, **common)
        model = transformers.MixtralForCausalLM(cfg)
    elif arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=32, num_experts=4, head_dim=16, **common
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif arch == "llama4":  # sliced experts (every expert its own rows): the fuzzers' fourth
        cfg = transformers.Llama4TextConfig(
            intermediate_size=32,
            intermediate_size_mlp=64,
            num_local_experts=4,
            head_dim=16,
            pad_token_id=0,
            **common,
        )
        model = transformers.Llama4ForCausalLM(cfg)
    else:
        cfg = transformers.GptOssConfig(
            intermediate_size=32, num_local_experts=4, head_dim=16, **common
        )
        model = transformers.GptOssForCausalLM(cfg)
        with torch.no_grad():  # transformers initializes the expert biases to zero
            for layer in model.model.layers:
                layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.5)
                layer.mlp.experts.down_proj_bias.normal_(0, 0.5)
    # the original experts' own forward (their eager loop), which GroupedExperts reproduces
    cfg._experts_implementation = "eager"
    return model.to(dtype)


def experts_of(model: nn.Module, layer: int = 0) -> nn.Module:
    block = model.model.layers[layer]
    return block.feed_forward.experts if hasattr(block, "feed_forward") else block.mlp.experts


def routing(tokens: int = 24, experts: int = 4, empty: int | None = 3) -> tuple[torch.Tensor, ...]:
    """top-2 routing over ``experts`` that leaves expert ``empty`` without tokens (None: every
    expert gets some)."""
    g = torch.Generator().manual_seed(1)
    used = [e for e in range(experts) if e != empty]
    scores = torch.rand(tokens, len(used), generator=g)
    top = scores.topk(2, dim=1)
    index = torch.tensor(used)[top.indices]
    weights = torch.softmax(top.values, dim=1)
    return index, weights


def attn_and_expert_params(model: nn.Module) -> int:
    """Elements of the attention projections' and the experts' parameters."""
    total = 0
    for name, module in model.named_modules():
        if name.endswith("experts") or (type(module) is nn.Linear and "self_attn" in name):
            total += sum(p.numel() for p in module.parameters(recurse=False))
    return total


@pytest.mark.parametrize("arch", ARCHS)
def test_convert_quantizes_the_experts(arch: str, caplog) -> None:
    model = build(arch)
    layer_total = attn_and_expert_params(model)
    with caplog.at_level("WARNING", logger="fp4gen.runtime"):
        fp4gen.convert(model, "nvfp4_no_bf16", report_min_elements=4000)
    for i in range(2):
        experts = experts_of(model, i)
        assert isinstance(experts, GroupedExperts)
        assert experts.layout.num_experts == 4 and experts.converted_by == "nvfp4_no_bf16"
    done = report(model)
    weights = sum(
        p.numel()
        for n, p in model.named_parameters()
        if n.endswith(("proj.weight", "gate_up_proj", "down_proj"))
        and "self_attn" in n
        or n.endswith(("gate_up_proj", "down_proj"))
    )
    assert done.quantized == weights  # every attention projection's and expert's weight
    assert done.quantized > 0.9 * layer_total
    (warning,) = [r.getMessage() for r in caplog.records if " left " in r.getMessage()]
    named = [line.split(" [")[0].strip() for line in warning.splitlines()[1:]]
    assert "model.layers.0.mlp.experts.gate_up_proj" not in named
    assert "lm_head.weight" in named and "model.embed_tokens.weight" in named


@pytest.mark.parametrize("arch", ARCHS)
def test_plan_lists_the_experts_and_layer_rules_match_them(arch: str) -> None:
    model = fp4gen.convert(build(arch), "nvfp4_no_bf16")
    plan = fp4gen.show_plan(model)
    row = next(line for line in plan.splitlines() if "model.layers.1.mlp.experts" in line)
    assert row.split()[:6] == [
        "9", "1", "model.layers.1.mlp.experts", "(4", "experts)", "recipe",
    ]  # fmt: skip
    text = RNE + 'layers {\n match "*layers.0.mlp.experts" : bf16\n last 1 blocks : mxfp8_e4m3\n}\n'
    model = build(arch)
    original = experts_of(model, 0)
    fp4gen.convert(model, parse_recipe(text, base_dir=None), report_min_elements=4096)
    assert experts_of(model, 0) is original  # kept as it is
    kept = experts_of(model, 1)
    assert (
        isinstance(kept, GroupedExperts) and kept.operands.fprop_weight.format.name == "mxfp8_e4m3"
    )
    plan = fp4gen.show_plan(model)
    assert "model.layers.0.mlp.experts.gate_up_proj  4x" in plan
    assert 'kept in bf16 by the rule match "*layers.0.mlp.experts"' in plan


class _Custom3D(nn.Module):
    """An experts module fp4gen does not know: 3-D weights under other names."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 32, 64))
        self.w2 = nn.Parameter(torch.randn(4, 64, 32))


class _PostNorm(nn.Module):
    """The grouped-experts shape with a norm after each expert, which GroupedExperts lacks."""

    has_post_expert_norm = True

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(4, 64, 64))
        self.down_proj = nn.Parameter(torch.randn(4, 64, 32))
        self.act_fn = nn.SiLU()


def test_unsupported_experts_modules_are_named(caplog) -> None:
    model = nn.Module()
    model.blocks = nn.ModuleList(
        nn.ModuleDict({"proj": nn.Linear(64, 64), "moe": cls()}) for cls in (_Custom3D, _PostNorm)
    )
    with caplog.at_level("WARNING", logger="fp4gen.runtime"):
        fp4gen.convert(model, parse_recipe(RNE, base_dir=None), report_min_elements=8192)
    (warning,) = [r.getMessage() for r in caplog.records if " left " in r.getMessage()]
    assert warning.splitlines()[1:] == [
        "  blocks.0.moe.w1 [4, 32, 64]: an unsupported experts module (_Custom3D): its 3-D "
        "parameters are not a grouped-experts layout convert recognises (docs/moe.md)",
        "  blocks.0.moe.w2 [4, 64, 32]: an unsupported experts module (_Custom3D): its 3-D "
        "parameters are not a grouped-experts layout convert recognises (docs/moe.md)",
        "  blocks.1.moe.gate_up_proj [4, 64, 64]: an unsupported experts module: _PostNorm "
        "applies a norm after each expert, which the grouped experts do not run (docs/moe.md)",
        "  blocks.1.moe.down_proj [4, 64, 32]: an unsupported experts module: _PostNorm "
        "applies a norm after each expert, which the grouped experts do not run (docs/moe.md)",
    ]
    assert isinstance(model.blocks[0]["proj"], fp4gen.nn.Linear)
    assert "blocks.0.moe.w1" in fp4gen.show_plan(model)


class _RefLinear(torch.autograd.Function):
    """x W^T + b with the three GEMMs of the RNE recipe, written from fp4gen.numerics alone:
    fprop Q(x) Q(W)^T, dgrad Q(dy) Q(W)^T^T (W's 16x16 codes transposed), wgrad
    Q(dy^T) Q(x^T)^T with the tokens zero-padded to the 1x16 blocks; fp32 sums rounded once."""

    @staticmethod
    def forward(ctx, x, w, b):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        y = gemm_reference(quantize(x, "nvfp4"), quantize(w, "nvfp4", block=(16, 16)))
        return (y if b is None else y + b.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x, w = ctx.saved_tensors
        w_col = quantize(w, "nvfp4", block=(16, 16)).transpose()
        dx = gemm_reference(quantize(dy, "nvfp4"), w_col).to(x.dtype)
        tokens = -(-x.shape[0] // 16) * 16
        dy_p = torch.cat([dy, dy.new_zeros(tokens - dy.shape[0], dy.shape[1])])
        x_p = torch.cat([x, x.new_zeros(tokens - x.shape[0], x.shape[1])])
        dw = gemm_reference(
            quantize(dy_p.t().contiguous(), "nvfp4"), quantize(x_p.t().contiguous(), "nvfp4")
        ).to(w.dtype)
        db = dy.sum(0, dtype=torch.float32).to(dy.dtype) if ctx.has_bias else None
        return dx, dw, db


def reference_experts(module: nn.Module, hidden, index, weights) -> torch.Tensor:
    """The experts' forward by hand: per expert with tokens, _RefLinear for each projection."""
    lay = experts_layout(module)
    out = torch.zeros_like(hidden)
    for e in range(lay.num_experts):
        pos, tok = torch.where((index == e).t())
        if tok.numel() == 0:
            continue
        h = hidden[tok]
        for proj, name in enumerate(lay.weights):
            w = getattr(module, name)[e]
            b = getattr(module, lay.biases[proj])[e] if lay.bias else None
            h = _RefLinear.apply(h, w.t() if lay.transposed else w, b)
            if proj == 0:
                h = module.source._apply_gate(h)
        out.index_add_(0, tok, (h * weights[tok, pos, None]).to(out.dtype))
    return out


def run(module: nn.Module, hidden: torch.Tensor, index, weights, fn=None):
    """Output and the gradients of hidden, the routing weights and every parameter."""
    hidden = hidden.detach().requires_grad_()
    weights = weights.detach().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = (fn or module)(hidden, index, weights)
    g = torch.Generator().manual_seed(2)
    out.backward(torch.randn(out.shape, generator=g).to(out.device, out.dtype))
    params = {n: p.grad for n, p in module.named_parameters()}
    return out.detach(), hidden.grad, weights.grad, params


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_and_backward_equal_a_per_expert_reference(arch: str) -> None:
    model = fp4gen.convert(build(arch, torch.bfloat16), parse_recipe(RNE, base_dir=None))
    module = experts_of(model)
    hidden = torch.randn(24, 64).to(torch.bfloat16)
    index, weights = routing()
    weights = weights.to(torch.bfloat16)
    got = run(module, hidden, index, weights)
    want = run(module, hidden, index, weights, lambda h, i, w: reference_experts(module, h, i, w))
    for a, b in zip(got[:3], want[:3], strict=True):
        assert torch.equal(a, b)
    assert got[3].keys() == want[3].keys()
    for name in got[3]:
        assert torch.equal(got[3][name], want[3][name]), name
        assert not got[3][name][3].any()  # expert 3 had no tokens: no gradient
        assert got[3][name][:3].abs().sum() > 0
    assert got[0].abs().sum() > 0


def dense_layers(module: GroupedExperts, seed: int, layer_index: int) -> list[list[nn.Module]]:
    """One fp4gen.nn.Linear (nvfp4) per expert and projection, holding a copy of the expert's
    weight slice (as [out, in]) and bias, with the seed convert gives that GEMM."""
    lay = module.layout
    dense = []
    for e in range(lay.num_experts):
        pair = []
        for proj, name in enumerate(lay.weights):
            w = getattr(module, name)[e]
            w = w.t() if lay.transposed else w
            b = getattr(module, lay.biases[proj])[e] if lay.bias else None
            linear = fp4gen.nn.Linear(
                w.shape[1],
                w.shape[0],
                bias=b is not None,
                recipe="nvfp4",
                seed=seed + layer_index + EXPERT_SEED_STRIDE * (1 + 2 * e + proj),
                device=w.device,
                dtype=w.dtype,
            )
            with torch.no_grad():
                linear.weight.copy_(w)
                if b is not None:
                    linear.bias.copy_(b)
            pair.append(linear)
        dense.append(pair)
    return dense


def dense_forward(module: GroupedExperts, dense: list[list[nn.Module]]):
    """The experts' forward with the dense layers in place of each expert's GEMMs."""

    def forward(hidden, index, weights):
        out = torch.zeros_like(hidden)
        for e in range(module.layout.num_experts):
            pos, tok = torch.where((index == e).t())
            if tok.numel():
                h = module.source._apply_gate(dense[e][0](hidden[tok]))
                y = dense[e][1](h) * weights[tok, pos, None]
                out.index_add_(0, tok, y.to(out.dtype))
        return out

    return forward


def check_dense(module: GroupedExperts, dense, hidden, index, weights, empty: int) -> None:
    """GroupedExperts equals the dense layers bit for bit: output, dx, the routing weights'
    gradient and every expert's weight gradient (none for the expert ``empty``)."""
    got = run(module, hidden, index, weights)
    want = run(module, hidden, index, weights, dense_forward(module, dense))
    for a, b in zip(got[:3], want[:3], strict=True):
        assert torch.equal(a, b)
    lay = module.layout
    for e in range(lay.num_experts):
        for proj, name in enumerate(lay.weights):
            grad = got[3][name][e]
            grad = grad.t() if lay.transposed else grad
            dw = dense[e][proj].weight.grad
            assert torch.equal(grad, torch.zeros_like(grad) if dw is None else dw), (e, name)
            assert (dw is None) == (e == empty)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_expert_is_a_dense_fp4gen_linear(arch: str) -> None:
    """Under the full NVFP4 recipe (stochastic rounding, RHT on wgrad) every expert's GEMMs are
    those of an fp4gen.nn.Linear with the expert's seed, bit for bit."""
    model = fp4gen.convert(build(arch, torch.bfloat16), "nvfp4_no_bf16", seed=5)
    module = experts_of(model)
    dense = dense_layers(module, 5, layer_index=4)  # q, k, v, o, then the experts
    index, weights = routing(40, empty=1)
    hidden = torch.randn(40, 64).to(torch.bfloat16)
    check_dense(module, dense, hidden, index, weights.to(torch.bfloat16), empty=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_high_precision_recipe_reproduces_the_original_module(arch: str) -> None:
    model = build(arch, torch.bfloat16)
    original = copy.deepcopy(experts_of(model))
    fp4gen.convert(model, parse_recipe(HIGH, base_dir=None))
    module = experts_of(model)
    assert isinstance(module, GroupedExperts)
    hidden = torch.randn(24, 64).to(torch.bfloat16)
    index, weights = routing(empty=2)
    got = run(module, hidden, index, weights.to(torch.bfloat16))
    want = run(original, hidden, index, weights.to(torch.bfloat16))
    for a, b in zip(got[:3], want[:3], strict=True):
        assert torch.equal(a, b)
    for name, grad in want[3].items():
        assert torch.equal(got[3][name], grad), name


@pytest.mark.parametrize("arch", ARCHS)
def test_state_dict_round_trip(arch: str) -> None:
    before = build(arch)
    saved = {k: v.clone() for k, v in before.state_dict().items()}
    shapes = {k: v.shape for k, v in saved.items()}
    model = fp4gen.convert(build(arch), "nvfp4_no_bf16")
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.load_state_dict(saved)  # a checkpoint from before the conversion
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    with torch.no_grad():
        experts_of(model).down_proj.mul_(2)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    fresh = build(arch)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))  # and back
    assert torch.equal(experts_of(fresh).down_proj, experts_of(model).down_proj)
    assert torch.equal(
        experts_of(fresh).down_proj, 2 * saved["model.layers.0.mlp.experts.down_proj"]
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_a_training_step_runs(arch: str) -> None:
    model = fp4gen.convert(build(arch), "nvfp4_no_bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    before = experts_of(model).gate_up_proj.detach().clone()
    losses = []
    for step in range(2):
        fp4gen.set_step(model, step)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        grad = experts_of(model).gate_up_proj.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
        opt.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(experts_of(model).gate_up_proj, before)
    assert fp4gen.runtime.convert.count_converted(model) == 2 * 5  # 4 projections + experts


def test_experts_without_tokens() -> None:
    """A batch routed to expert 0 only, and a batch of zero tokens: the other experts run
    nothing and get zero gradients; no token gives a zero output, as the original module."""
    model = fp4gen.convert(build("mixtral"), parse_recipe(RNE, base_dir=None))
    module = experts_of(model)
    index = torch.zeros(20, 2, dtype=torch.long)
    index[:, 1] = 0  # both slots on expert 0: weights summed
    out, _, _, grads = run(module, torch.randn(20, 64), index, torch.full((20, 2), 0.5))
    assert out.abs().sum() > 0
    for grad in grads.values():
        assert grad[0].abs().sum() > 0 and not grad[1:].any()
    empty = module(torch.randn(0, 64), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert empty.shape == (0, 64)


def test_amax_group_is_refused_for_experts() -> None:
    with pytest.raises(fp4gen.FP4GenError, match="amax_group is not supported for experts"):
        fp4gen.convert(build("mixtral"), "nvfp4_no_bf16", amax_group=object())


def test_bad_hidden_states_are_one_line_errors() -> None:
    module = experts_of(fp4gen.convert(build("mixtral"), parse_recipe(RNE, base_dir=None)))
    index, weights = routing()
    with pytest.raises(fp4gen.errors.TensorError, match=r"hidden_states of shape \(24, 32\)"):
        module(torch.randn(24, 32), index, weights)


@pytest.mark.parametrize("arch", ["gpt_oss"])
def test_export_writes_experts_in_high_precision_and_excludes_them(arch: str, tmp_path) -> None:
    """Experts without a per-expert checkpoint layout (gpt-oss: tests/test_export_moe.py has
    the others): their tensors go out in the export dtype, under their own keys, and
    exclude_modules names every experts module, so an inference engine never reads them as
    quantized."""
    import json

    from safetensors.torch import load_file

    model = build(arch)
    fp4gen.convert(model, "nvfp4_no_bf16")
    report_ = fp4gen.export_quantized(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())
    excluded = config["quantization"]["exclude_modules"]
    experts = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert all(name in excluded for name in experts)
    assert all(name in report_.excluded for name in experts)
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    original = experts_of(model, 0)
    for key in ("gate_up_proj", "down_proj"):
        got = tensors[f"model.layers.0.mlp.experts.{key}"]
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, getattr(original, key).detach().to(torch.bfloat16))
    assert "model.layers.0.self_attn.q_proj.weight_scale" in tensors  # the rest is quantized


def test_a_deep_copy_of_a_converted_moe_model_runs_its_own_expert_gemms() -> None:
    """Each expert GEMM of a copy is a layer of its own (its own op id), and the copy computes
    what the original does (same weights, same seeds)."""
    import gc

    model = build("mixtral")
    fp4gen.convert(model, "nvfp4_small")
    twin = copy.deepcopy(model)
    ours, theirs = experts_of(model), experts_of(twin)
    ids = {g._op_id for row in ours.gemms for g in row}
    assert not ids & {g._op_id for row in theirs.gemms for g in row}
    tokens = torch.randint(0, 128, (2, 8))
    want = model(tokens).logits
    del model, ours
    gc.collect()
    assert torch.equal(twin(tokens).logits, want)

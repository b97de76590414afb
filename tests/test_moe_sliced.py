"""Sliced experts (Llama 4's ``Llama4TextExperts``): the module takes the rows of every expert,
expert after expert ([E x T, H], already scaled by the router), and returns each row's
down(act(up(x))). ``GroupedExperts`` runs them under a recipe (fp4gen.runtime.experts, "the
forward's contract"): each expert's GEMMs are an fp4gen Linear's on its T rows, per expert or
grouped, and a table keeping every operand in the model's dtype runs the module's own forward.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import fp4gen
from fp4gen.dsl import parse_recipe
from fp4gen.errors import TensorError
from fp4gen.runtime.experts import GroupedExperts, experts_layout

transformers = pytest.importorskip("transformers")

from test_moe import HIGH, RNE, dense_layers  # noqa: E402
from test_moe_grouped import dequant_loop  # noqa: E402, F401

EXPERTS, TOKENS, HIDDEN = 4, 20, 64
MXFP4 = "operands {\n * : mxfp4\n}\n"
ON_GPU = torch.cuda.is_available()


def build(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Llama4TextConfig(
        vocab_size=128,
        hidden_size=HIDDEN,
        intermediate_size=32,
        intermediate_size_mlp=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=EXPERTS,
        num_experts_per_tok=1,
        pad_token_id=0,
    )
    return transformers.Llama4ForCausalLM(cfg).to(dtype)


def experts_of(model: torch.nn.Module) -> torch.nn.Module:
    return model.model.layers[0].feed_forward.experts


def run(module, hidden: torch.Tensor, fn=None):
    """Output, dx and every parameter's gradient of one forward and backward."""
    hidden = hidden.detach().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = (fn or module)(hidden)
    g = torch.Generator().manual_seed(2)
    out.backward(torch.randn(out.shape, generator=g).to(out.device, out.dtype))
    return out.detach(), hidden.grad, {n: p.grad for n, p in module.named_parameters()}


def rows(dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(EXPERTS * TOKENS, HIDDEN, generator=g).to(device=device, dtype=dtype)


def test_the_layout_is_sliced_and_transposed() -> None:
    layout = experts_layout(experts_of(build()))
    assert not isinstance(layout, str) and layout is not None
    assert layout.sliced and layout.transposed and layout.gated and not layout.bias
    assert (layout.num_experts, layout.hidden, layout.up_features, layout.inner) == (4, 64, 64, 32)
    model = fp4gen.convert(build(), "nvfp4_no_bf16")
    assert isinstance(experts_of(model), GroupedExperts)
    assert "model.layers.0.feed_forward.experts" in fp4gen.show_plan(model)


def test_a_high_precision_recipe_runs_the_modules_own_forward() -> None:
    model = build(torch.bfloat16)
    original = copy.deepcopy(experts_of(model))
    fp4gen.convert(model, parse_recipe(HIGH, base_dir=None))
    got = run(experts_of(model), rows(torch.bfloat16))
    want = run(original, rows(torch.bfloat16))
    for a, b in zip(got[:2], want[:2], strict=True):
        assert torch.equal(a, b)
    for name, grad in want[2].items():
        assert torch.equal(got[2][name], grad), name


def test_each_expert_is_a_dense_fp4gen_linear_on_its_rows() -> None:
    """Under the full NVFP4 recipe (stochastic rounding, RHT on wgrad), expert e's GEMMs are an
    fp4gen.nn.Linear's with the expert's seed on rows [e T, (e + 1) T), bit for bit."""
    model = fp4gen.convert(build(torch.bfloat16), "nvfp4_no_bf16", seed=5)
    module = experts_of(model)
    module.grouped = False
    dense = dense_layers(module, module.seed, layer_index=0)

    def reference(hidden: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, x in enumerate(hidden.split(TOKENS)):
            gate, up = dense[e][0](x).chunk(2, dim=-1)
            outs.append(dense[e][1](module.act_fn(gate) * up))
        return torch.cat(outs)

    got = run(module, rows(torch.bfloat16))
    want = run(module, rows(torch.bfloat16), reference)
    for a, b in zip(got[:2], want[:2], strict=True):
        assert torch.equal(a, b)
    for proj, name in enumerate(module.layout.weights):
        for e in range(EXPERTS):
            grad = got[2][name][e].t()  # transposed layout: [in, out] per expert
            assert torch.equal(grad, dense[e][proj].weight.grad), (name, e)
            assert grad.abs().sum() > 0


def routed_twin(module: GroupedExperts) -> GroupedExperts:
    """A copy of ``module`` read with the routed contract: the same weights, seeds and counts."""
    twin = copy.deepcopy(module)
    twin.layout = dataclasses.replace(module.layout, sliced=False)
    return twin


def identity_routing(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Row r to expert r // T with weight 1: the routed contract's form of the sliced one."""
    index = torch.arange(EXPERTS, device=device).repeat_interleave(TOKENS)[:, None]
    return index, torch.ones(index.shape, device=device)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliced_is_the_routed_contract_with_each_row_routed_to_its_expert(
    grouped,
    dtype,
    dequant_loop,  # noqa: F811
) -> None:
    """Per expert and grouped: the sliced forward equals the routed one whose routing sends
    row r to expert r // T with weight 1 (the same groups in the same order: equal values; a
    routed sum into zeros may turn -0.0 into +0.0)."""
    module = experts_of(fp4gen.convert(build(dtype), "nvfp4_no_bf16", seed=5))
    module.grouped = grouped
    twin = routed_twin(module)
    index, weights = identity_routing("cpu")
    got = run(module, rows(dtype))
    want = run(twin, rows(dtype), lambda h: twin(h, index, weights.to(dtype)))
    for a, b in zip(got[:2], want[:2], strict=True):
        assert torch.equal(a, b)
    for name, grad in want[2].items():
        assert torch.equal(got[2][name], grad), name


def test_the_grouped_path_is_the_loop(dequant_loop) -> None:  # noqa: F811
    loop, group = (
        experts_of(fp4gen.convert(build(torch.bfloat16), "nvfp4_no_bf16", seed=5)) for _ in range(2)
    )
    loop.grouped, group.grouped = False, True
    want, got = run(loop, rows(torch.bfloat16)), run(group, rows(torch.bfloat16))
    for a, b in zip(got[:2], want[:2], strict=True):
        assert torch.equal(a, b)
    for name, grad in want[2].items():
        assert torch.equal(got[2][name], grad), name


def test_bad_inputs_are_named() -> None:
    module = experts_of(fp4gen.convert(build(), parse_recipe(RNE, base_dir=None)))
    with pytest.raises(TensorError, match=r"expected \[4 x tokens, 64\]"):
        module(torch.randn(EXPERTS * TOKENS + 1, HIDDEN))
    index, weights = identity_routing("cpu")
    with pytest.raises(TensorError, match="take hidden_states alone"):
        module(rows(), index, weights)
    assert module(torch.zeros(0, HIDDEN)).shape == (0, HIDDEN)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["nvfp4_small", "fp8_blockwise", MXFP4])
def test_sliced_experts_on_cuda_are_the_routed_contract(recipe: str) -> None:
    """On CUDA (the grouped kernels where the table allows): the sliced forward equals the
    routed one with each row routed to its expert, output and every gradient."""
    if recipe == MXFP4:  # the shipped mxfp4 keeps its last 8 blocks, all of this model's
        recipe = parse_recipe(MXFP4, base_dir=None)
    module = experts_of(fp4gen.convert(build(torch.bfloat16).cuda(), recipe, seed=5))
    assert isinstance(module, GroupedExperts)
    twin = routed_twin(module)
    index, weights = identity_routing("cuda")
    got = run(module, rows(torch.bfloat16, "cuda"))
    want = run(twin, rows(torch.bfloat16, "cuda"), lambda h: twin(h, index, weights.bfloat16()))
    for a, b in zip(got[:2], want[:2], strict=True):
        assert torch.equal(a, b)
    for name, grad in want[2].items():
        assert torch.equal(got[2][name], grad), name
        assert grad.abs().sum() > 0

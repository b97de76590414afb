"""Every Mixture-of-Experts family of the installed transformers, converted: its experts run
under the recipe or are named as left in high precision, never silently.

The families are found by reading transformers' modeling sources for an experts class (a class
whose name ends in ``Experts``); each gets a tiny causal LM (2 layers, hidden 64, 4 experts,
top-2) from its own config class with the sizes shrunk. Then:

- ``convert`` replaces each experts module by a ``GroupedExperts`` (``experts_layout`` accepts
  it), or its parameters appear in convert's report with the reason;
- under a recipe that keeps every operand in bf16, the converted experts compute the original
  module's forward and backward bit for bit (output, the inputs' and the routing weights'
  gradients, every parameter's gradient): the layout, the activation, the routing and, for the
  sliced contract (Llama 4), the module's own forward are read correctly;
- a training step of the whole model under each of five shipped recipes (NVFP4, FP8 blockwise,
  MXFP8, MoR, a format of its own) gives a finite loss and a gradient for every expert weight
  that had tokens.

A family whose tiny config transformers itself cannot build (its config needs more than the
sizes shrunk here) is skipped with transformers' error; that is about this test's configs, not
about the conversion.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import logging
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import fp4gen
from fp4gen.dsl import parse_recipe
from fp4gen.runtime.convert import report
from fp4gen.runtime.experts import GroupedExperts, experts_layout

transformers = pytest.importorskip("transformers")

from test_moe import RNE  # noqa: E402
from test_moe_grouped import dequant_loop  # noqa: E402, F401

HIGH = "operands {\n * : bf16\n}\n"
# the shipped nvfp4 recipe's operand table (SR gradients, RHT on the wgrad operands, 2D weights)
# without its layer rules
NVFP4_OPERANDS = """operands {
    *                : nvfp4 round nearest
    weight           : block 16x16
    gradient         : round stochastic8
    wgrad.activation : rht 16 signs te
    wgrad.gradient   : rht 16 signs te
}
"""
# every config field a tiny model shrinks, where the family's config has it
SIZES = dict(
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    expert_ffn_hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    num_experts_per_token=2,
    n_shared_experts=1,
    first_k_dense_replace=0,
    moe_layer_freq=1,
    decoder_sparse_step=1,
    expert_interval=1,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    n_group=1,
    topk_group=1,
    max_position_embeddings=64,
    pad_token_id=0,
)


def experts_families() -> list[str]:
    """The model types whose modeling source defines an experts class."""
    root = Path(transformers.__file__).parent / "models"
    found = []
    for source in sorted(root.glob("*/modeling_*.py")):
        if source.stem == f"modeling_{source.parent.name}" and re.search(
            r"^class \w+Experts\(", source.read_text(), re.M
        ):
            found.append(source.parent.name)
    return found


FAMILIES = experts_families()


def tiny_model(family: str) -> nn.Module:
    """The family's causal LM at tiny sizes, in bf16 (skips where there is none or its config
    does not build at these sizes)."""
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    causal = [
        c for n, c in vars(modeling).items() if inspect.isclass(c) and n.endswith("ForCausalLM")
    ]
    if not causal:
        pytest.skip(f"{family} has no causal LM class (its experts run inside another model)")
    model_class = causal[0]
    try:
        config = model_class.config_class()
        for key, value in SIZES.items():
            if hasattr(config, key):
                setattr(config, key, value)
        if hasattr(config, "qk_rope_head_dim"):  # multi-head latent attention: rope's width
            config.head_dim = config.qk_rope_head_dim
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = config.layer_types[: config.num_hidden_layers]
        if hasattr(config, "mlp_only_layers"):
            config.mlp_only_layers = []
        torch.manual_seed(0)
        model = model_class(config)
    except Exception as err:  # noqa: BLE001 - transformers' own config checks, any type
        pytest.skip(f"{family}'s config does not build at tiny sizes: {type(err).__name__}: {err}")
    # the original experts' own forward (their eager loop: transformers' other experts
    # implementations sum in other orders), which GroupedExperts reproduces
    for cfg in (model.config, getattr(model.config, "text_config", None)):
        if cfg is not None:
            cfg._experts_implementation = "eager"
    with torch.no_grad():  # biases start at zero: give them values
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "experts" in name and "bias" in name:
                param.normal_(0, 0.5)
    return model.to(torch.bfloat16)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules holding 3-D parameters in an experts class (the candidates convert sees)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if type(module).__name__.endswith("Experts")
        and any(p.dim() == 3 for p in module.parameters(recurse=False))
    ]


def run(module: nn.Module, sliced: bool, experts: int):
    """A forward and backward of an experts module on seeded inputs: the output and the
    gradients of the hidden states, the routing weights and every parameter."""
    g = torch.Generator().manual_seed(1)
    tokens = 24
    rows = tokens * (experts if sliced else 1)  # sliced: no identity experts
    hidden = torch.randn(rows, module_hidden(module), generator=g).bfloat16().requires_grad_()
    index = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    weights = torch.softmax(torch.rand(tokens, 2, generator=g), 1).bfloat16().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(hidden) if sliced else module(hidden, index, weights)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).bfloat16())
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    return out.detach(), hidden.grad, weights.grad, grads


def module_hidden(module: nn.Module) -> int:
    layout = experts_layout(module) if not isinstance(module, GroupedExperts) else module.layout
    assert not isinstance(layout, str) and layout is not None
    return layout.hidden


def test_the_families_are_found() -> None:
    """The scan finds the families the MoE docs name (a transformers without them would make
    the tests below vacuous)."""
    for family in ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "llama4", "qwen2_moe"):
        assert family in FAMILIES


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_convert_or_are_reported(family: str, caplog, tmp_path) -> None:
    """Every experts module is replaced, or named in convert's report with its reason; where
    replaced, a table keeping every operand in bf16 computes the original's bits."""
    model = tiny_model(family)
    found = experts_modules(model)
    if not found:  # experts of nn.Linear layers: each converted as a dense layer
        linears = [
            name
            for name, m in model.named_modules()
            if type(m) is nn.Linear and "expert" in name and ".gate" not in name[-6:]
        ]
        fp4gen.convert(model, "nvfp4_small", report_min_elements=1)
        kept = {row.name.rsplit(".", 1)[0]: row.reason for row in report(model).kept}
        for name in linears:
            module = model.get_submodule(name)
            assert isinstance(module, fp4gen.nn.Linear) or "rule" in kept.get(name, ""), name
        return
    name, original = found[0]
    original = copy.deepcopy(original)
    layout = experts_layout(original)
    with caplog.at_level(logging.WARNING, logger="fp4gen.runtime"):
        fp4gen.convert(model, parse_recipe(HIGH, base_dir=None), report_min_elements=1)
    converted = model.get_submodule(name)
    named = {row.name: row.reason for row in report(model).kept}
    up = next(f"{name}.{p}" for p, v in original.named_parameters(recurse=False) if v.dim() == 3)
    if not isinstance(converted, GroupedExperts) and "outside the repeated blocks" in named[up]:
        # a block structure convert does not repeat (LongcatFlash): kept, and said so; a layer
        # rule naming the experts converts them
        (tmp_path / "high.fp4r").write_text(HIGH)
        ruled = HIGH + f'layers {{\n match "{name}" : recipe "high.fp4r"\n}}\n'
        model = tiny_model(family)
        fp4gen.convert(model, parse_recipe(ruled, base_dir=tmp_path))
        converted = model.get_submodule(name)
    if not isinstance(converted, GroupedExperts):
        # refused: the report names every 3-D parameter with the reason, once, at WARNING
        assert isinstance(layout, str) or layout is None
        for pname, param in original.named_parameters(recurse=False):
            if param.dim() == 3:
                why = named[f"{name}.{pname}"]
                assert "unsupported experts module" in why, why
        assert any(name in r.getMessage() for r in caplog.records)
        return
    assert converted.layout == layout
    # routed to the computing experts and to up to 4 identity experts (LongcatFlash's)
    experts = layout.num_experts + min(layout.identity_experts, 4)
    want = run(original, layout.sliced, experts)
    got = run(converted, layout.sliced, experts)
    for what, a, b in zip(("output", "dx", "routing grad"), got[:3], want[:3], strict=True):
        assert (a is None and b is None) or torch.equal(a, b), what
    assert got[3].keys() == want[3].keys()
    for pname, grad in want[3].items():
        assert torch.equal(got[3][pname], grad), pname


# shipped recipes whose layer rules leave a 2-block model's experts converted: NVFP4, FP8
# blockwise, MXFP8, MoR's per-tensor choice and a format of its own (E3M2, blocks of 8)
STEP_RECIPES = ["nvfp4_small", "fp8_blockwise", "mxfp8", "mor_tensor", "exotic_e3m2_b8"]
DEVICE_RECIPES = [("cpu", recipe) for recipe in STEP_RECIPES] + [
    pytest.param(
        "cuda",
        "nvfp4_small",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    )
]


@pytest.mark.parametrize(("device", "recipe"), DEVICE_RECIPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_training_step_under_a_recipe(family: str, device: str, recipe: str) -> None:
    """The whole tiny model converted with ``recipe`` trains a step: a finite loss, finite
    gradients, and a gradient in every converted experts module (on CUDA through the grouped
    kernels, the default there)."""
    model = tiny_model(family).to(device)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3)).to(device)
    try:
        with torch.no_grad():
            model(input_ids=ids, labels=ids, use_cache=False)
    except Exception as err:  # noqa: BLE001 - the unconverted model's own failure, any type
        pytest.skip(f"{family}'s tiny model does not run unconverted: {type(err).__name__}: {err}")
    fp4gen.convert(model, recipe)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    out = model(input_ids=ids, labels=ids, use_cache=False)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for module in experts:
        grads = [p.grad for p in module.parameters(recurse=False) if p.dim() == 3]
        assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
        assert any(g.abs().sum() > 0 for g in grads)


def test_identity_experts_grouped_are_the_loop(tmp_path, dequant_loop) -> None:  # noqa: F811
    """LongcatFlash's identity experts under an NVFP4 table (its experts converted through a
    layer rule naming them): the grouped path equals the per-expert loop bit for bit, tokens
    routed to computing and identity experts alike."""
    if "longcat_flash" not in FAMILIES:
        pytest.skip("this transformers has no LongcatFlash")
    modules = longcat_pair(RNE, RNE, tmp_path, lambda m: m.float())
    want, got = (run(m, False, 8) for m in modules)  # 4 computing, 4 identity experts
    for what, a, b in zip(("output", "dx", "routing grad"), got[:3], want[:3], strict=True):
        assert torch.equal(a, b), what
    for pname, grad in want[3].items():
        assert torch.equal(got[3][pname], grad), pname


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", ["rne", "nvfp4"])
def test_identity_experts_on_cuda_grouped_are_the_loop(tmp_path, recipe: str) -> None:
    """LongcatFlash's identity experts on CUDA (the grouped kernels, the sentinel rows, the
    identity sums) against the per-expert loop, as the recipe fuzzer compares
    (tests/moe_harness.py): every expert GEMM's operands bit for bit, and with the products
    handed on, the output and every gradient bit for bit; stochastic rounding included."""
    if "longcat_flash" not in FAMILIES:
        pytest.skip("this transformers has no LongcatFlash")
    inner = RNE if recipe == "rne" else NVFP4_OPERANDS
    loop, group = longcat_pair(HIGH, inner, tmp_path, lambda m: m.cuda())
    problems = harness_problems(loop, group, experts=8, rows=40)  # 4 computing, 4 identity
    assert not problems, "\n".join(problems)


def longcat_pair(base: str, inner: str, tmp_path: Path, place) -> list[GroupedExperts]:
    """Two copies of LongcatFlash's first experts module (``place`` puts the model on its
    device and dtype), converted under ``base`` with a layer rule giving the experts the table
    ``inner``: the per-expert loop, then the grouped path."""
    (tmp_path / "inner.fp4r").write_text(inner)
    ruled = base + 'layers {\n match "*mlp.experts" : recipe "inner.fp4r"\n}\n'
    modules = []
    for grouped in (False, True):
        model = place(tiny_model("longcat_flash"))
        fp4gen.convert(model, parse_recipe(ruled, base_dir=tmp_path), seed=5)
        module = model.model.layers[0].mlp.experts
        assert isinstance(module, GroupedExperts) and module.layout.identity_experts == 256
        module.grouped = grouped
        modules.append(module)
    return modules


def harness_problems(loop: GroupedExperts, group: GroupedExperts, experts: int, rows: int):
    """The differences between the loop's and the grouped path's fwd+bwd on CUDA, as the recipe
    fuzzer finds them (tests/moe_harness.py), for ``rows`` tokens routed top-2 among
    ``experts`` (a sliced module: each expert's ``rows`` rows)."""
    from moe_harness import harnessed_run, operand_differences, result_differences

    g = torch.Generator().manual_seed(1)
    hidden_rows = rows * (experts if group.layout.sliced else 1)
    hidden = torch.randn(hidden_rows, group.layout.hidden, generator=g).bfloat16()
    index = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(rows)])
    weights = torch.softmax(torch.rand(rows, 2, generator=g), 1).bfloat16()
    args = (hidden.cuda(), index.cuda(), weights.cuda())
    want, got = (harnessed_run(m, *args, check=True) for m in (loop, group))
    assert got.harness.checked > 0 and want.harness.checked > 0
    problems = want.harness.problems + got.harness.problems
    problems += operand_differences(got.harness, want.harness)
    return problems + result_differences(got, want)


def _converted_experts(family: str, tmp_path: Path, device: str) -> list[GroupedExperts]:
    """The family's tiny model on ``device``, its experts converted under the shipped nvfp4
    operand table (a layer rule naming them where convert does not repeat their blocks):
    its GroupedExperts modules (none where the family's experts are refused or nn.Linears)."""
    (tmp_path / "inner.fp4r").write_text(NVFP4_OPERANDS)
    found = experts_modules(tiny_model(family))
    if not found:
        return []
    ruled = NVFP4_OPERANDS + f'layers {{\n match "{found[0][0]}" : recipe "inner.fp4r"\n}}\n'
    model = tiny_model(family).to(device)
    fp4gen.convert(model, parse_recipe(ruled, base_dir=tmp_path), seed=5)
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_on_cuda_grouped_is_the_loop(family: str, tmp_path) -> None:
    """Each family's converted experts on CUDA under the nvfp4 table (stochastic rounding, RHT,
    2D weights): the grouped kernels against the per-expert loop, as the recipe fuzzer compares
    (tests/moe_harness.py): every expert GEMM's operands bit for bit, the products within their
    bounds, and with the products handed on, the output and every gradient bit for bit. The
    families' own pieces (biases, activations, clamps, sliced and identity experts) run through
    the grouped path on the GPU."""
    pair = [_converted_experts(family, tmp_path, "cuda") for _ in range(2)]
    if not pair[0]:
        pytest.skip(f"{family}: no experts module converted (nn.Linear experts or refused)")
    loop, group = pair[0][0], pair[1][0]
    loop.grouped, group.grouped = False, True
    experts = group.layout.num_experts + min(group.layout.identity_experts, 4)
    problems = harness_problems(loop, group, experts=experts, rows=40)
    assert not problems, "\n".join(problems)

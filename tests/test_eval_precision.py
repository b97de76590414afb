"""The recipe's eval statement: what the forward of a layer that is not training
(``module.eval()``) runs in. Parsing, printing, errors, the runtime (fp4gen.nn.Linear, converted
models, grouped experts), the kernel plan and what ``fp4gen show`` / ``show_plan`` print."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import fp4gen
from fp4gen.cli import show_text
from fp4gen.compiler.plan import plan_recipe
from fp4gen.demo.gpt import GPT, GPTConfig
from fp4gen.dsl import load_recipe, parse_recipe, print_recipe
from fp4gen.dsl.model import RecipeRef
from fp4gen.dsl.source import SHIPPED_RECIPES
from fp4gen.errors import RecipeError
from fp4gen.formats import BlockFormat, HighPrecision
from fp4gen.runtime import layer_groups
from fp4gen.settings import LAYER_GROUPS_VAR
from fp4gen.table import show_plan

NVFP4 = 'extends "nvfp4"\n'
SMALL = 'extends "nvfp4_small"\n'  # stochastic rounding on the gradients, RHT 16 on wgrad


# ------------------------------------------------------------------------------------------------
# language
# ------------------------------------------------------------------------------------------------


def test_each_action_parses_to_its_model_value() -> None:
    assert parse_recipe(NVFP4 + "eval : bf16\n").evaluation == HighPrecision("bf16")
    assert parse_recipe(NVFP4 + "eval : fprop\n").evaluation is None
    assert parse_recipe(NVFP4).evaluation is None  # the default
    fmt = parse_recipe(NVFP4 + "eval : mxfp8_e4m3\n").evaluation
    assert isinstance(fmt, BlockFormat) and fmt.name == "mxfp8_e4m3" and fmt.block == (1, 32)
    ref = parse_recipe(NVFP4 + 'eval : recipe "mxfp8"\n').evaluation
    assert isinstance(ref, RecipeRef) and ref.path == "mxfp8"
    assert ref.recipe is not None and ref.recipe.name == "mxfp8"
    # one line of text is recipe text too
    assert load_recipe("eval: fp16\noperands { * : nvfp4 }").evaluation == HighPrecision("fp16")


def test_shipped_recipes_keep_the_default_and_their_canonical_text() -> None:
    for path in sorted(SHIPPED_RECIPES.glob("*.fp4r")):
        recipe = load_recipe(path)
        assert recipe.evaluation is None, path.name
        assert "eval" not in print_recipe(recipe).split("operands {")[1], path.name


@pytest.mark.parametrize(
    "line", ["eval : bf16", "eval : fp32", "eval : mxfp4", 'eval : recipe "mxfp8"']
)
def test_printing_round_trips(line: str) -> None:
    recipe = parse_recipe(NVFP4 + line + "\n")
    text = print_recipe(recipe)
    assert text.rstrip("\n").endswith("\n" + line)
    assert parse_recipe(text) == recipe
    assert print_recipe(parse_recipe(text)) == text
    # eval : fprop is the default: printed as nothing, equal to no statement
    assert print_recipe(parse_recipe(NVFP4 + "eval : fprop\n")) == print_recipe(parse_recipe(NVFP4))


def test_extends_inherits_it_and_a_child_replaces_it(tmp_path: Path) -> None:
    (tmp_path / "parent.fp4r").write_text(NVFP4 + "eval : bf16\n")
    child = parse_recipe('extends "parent"\n', base_dir=tmp_path)
    assert child.evaluation == HighPrecision("bf16")
    back = parse_recipe('extends "parent"\neval : fprop\n', base_dir=tmp_path)
    assert back.evaluation is None
    other = parse_recipe('extends "parent"\neval : mxfp4\n', base_dir=tmp_path)
    assert isinstance(other.evaluation, BlockFormat) and other.evaluation.name == "mxfp4"


@pytest.mark.parametrize(
    ("text", "line", "column", "words"),
    [
        (NVFP4 + "eval : bf16\neval : fprop\n", 3, 1, "a second eval statement (the first is"),
        (NVFP4 + "eval : fprp\n", 2, 8, "unknown eval action 'fprp' (did you mean 'fprop'?)"),
        (NVFP4 + "eval : bogus\n", 2, 8, "unknown eval action 'bogus'"),
        (NVFP4 + "eval bf16\n", 2, 6, "expected ':' after 'eval'"),
        (NVFP4 + "eval :\n", 2, 7, "expected a name, 'fprop' or 'recipe'"),
        (NVFP4 + "eval : fprop bf16\n", 2, 14, "expected end of line after 'fprop'"),
        (
            NVFP4 + "format w = nvfp4 block 16x16\neval : w\n",
            3,
            8,
            "an eval statement's format applies to the fprop activation too",
        ),
        (NVFP4 + 'eval : recipe "no_such"\n', 2, 15, "cannot find recipe file 'no_such'"),
        (NVFP4 + "evl : bf16\n", 2, 1, "(did you mean 'eval'?)"),
    ],
    ids=[
        "second",
        "typo",
        "unknown",
        "no-colon",
        "no-action",
        "two-actions",
        "2d-format",
        "missing-recipe",
        "keyword-typo",
    ],
)
def test_misuse_is_an_error_at_line_and_column(text: str, line: int, column: int, words: str):
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, file="bad.fp4r")
    err = info.value
    assert (err.file, err.line, err.column) == ("bad.fp4r", line, column), str(err)
    assert words in str(err)
    assert str(err).startswith(f"bad.fp4r:{line}:{column}: ")


def test_fp4gen_show_says_it() -> None:
    text = show_text(parse_recipe(NVFP4 + "eval : bf16\n"), with_plan=False)
    assert "Evaluation (module.eval()): bf16 (both fprop operands)" in text
    default = show_text(load_recipe("nvfp4"), with_plan=False)
    assert "Evaluation (module.eval()): fprop (the forward's operands in force)" in default


# ------------------------------------------------------------------------------------------------
# kernel plan
# ------------------------------------------------------------------------------------------------


def test_a_high_precision_eval_adds_no_kernel() -> None:
    plain = plan_recipe(load_recipe("nvfp4"))
    plan = plan_recipe(parse_recipe(NVFP4 + "eval : bf16\n"))
    assert plan.specs == plain.specs
    assert ("recipe", "eval : bf16") in [(s.recipe, s.context) for s in plan.skipped]


def test_a_format_eval_plans_its_fprop_kernels() -> None:
    plan = plan_recipe(parse_recipe(NVFP4 + "eval : mxfp8_e4m3\n"))
    context = "eval : mxfp8_e4m3"
    for op in (fp4gen.Operand.FPROP_ACTIVATION, fp4gen.Operand.FPROP_WEIGHT):
        kernel = plan.kernel_for(op, context)
        assert kernel is not None
        assert kernel.spec.element.name == "e4m3" and kernel.spec.block == (1, 32)
    # the backward slots stay the training ones: their kernels are the operands context's
    wgrad = fp4gen.Operand.WGRAD_GRADIENT
    assert plan.kernel_for(wgrad, context).spec == plan.kernel_for(wgrad).spec


# ------------------------------------------------------------------------------------------------
# runtime: fp4gen.nn.Linear
# ------------------------------------------------------------------------------------------------


def _linears(*texts: str, seed: int = 1) -> list[fp4gen.nn.Linear]:
    """One Linear per recipe text, all with the same parameters and seed."""
    torch.manual_seed(0)
    first = fp4gen.nn.Linear(64, 48, recipe=parse_recipe(texts[0]), seed=seed)
    layers = [first]
    for text in texts[1:]:
        layer = fp4gen.nn.Linear(64, 48, recipe=parse_recipe(text), seed=seed)
        layer.load_state_dict(first.state_dict())
        layers.append(layer)
    return layers


def test_a_bf16_eval_is_the_high_precision_result_bit_for_bit() -> None:
    layer, high, plain = _linears(NVFP4 + "eval : bf16\n", "operands { * : bf16 }\n", NVFP4)
    x = torch.randn(32, 64)
    trained = layer(x)
    assert torch.equal(trained, plain(x))  # training: the nvfp4 forward, as without the statement
    assert not torch.equal(trained, high(x))
    layer.eval()
    with torch.no_grad():
        assert torch.equal(layer(x), high(x))
    assert torch.equal(layer(x), high(x))  # eval mode with grad enabled: the same forward
    # y = bf16(x) bf16(W)^T + b in fp32
    want = x.bfloat16().float() @ layer.weight.bfloat16().float().T + layer.bias
    torch.testing.assert_close(layer(x), want, rtol=0, atol=1e-5)
    layer.train()
    assert torch.equal(layer(x), trained)


def test_no_grad_in_training_mode_keeps_the_training_formats() -> None:
    """The condition is module.training, not grad mode: a reentrant activation checkpoint runs
    its first forward under no_grad and must match its recompute."""
    layer, plain = _linears(NVFP4 + "eval : bf16\n", NVFP4)
    x = torch.randn(32, 64)
    with torch.no_grad():
        assert torch.equal(layer(x), plain(x))


def test_eval_fprop_is_the_training_forward() -> None:
    layer, plain = _linears(NVFP4 + "eval : fprop\n", NVFP4)
    x = torch.randn(32, 64)
    want = plain(x)
    layer.eval()
    with torch.no_grad():
        assert torch.equal(layer(x), want)


def test_a_format_eval_runs_that_format_in_the_forward() -> None:
    layer, other = _linears(NVFP4 + "eval : mxfp8_e4m3\n", "operands { * : mxfp8_e4m3 }\n")
    x = torch.randn(32, 64)
    layer.eval()
    assert layer.operands.fprop_weight.format.name == "mxfp8_e4m3"
    assert layer.operands.wgrad_gradient.format.name == "nvfp4"  # backward slots unchanged
    with torch.no_grad():
        assert torch.equal(layer(x), other(x))


class Block(nn.Module):
    """q, k and v read one x (a layer group forms after two training forwards), then a
    projection."""

    def __init__(self, text: str, hidden: int = 64) -> None:
        super().__init__()
        recipe = parse_recipe(text)
        self.q, self.k, self.v, self.o = (
            fp4gen.nn.Linear(hidden, hidden, recipe=recipe, seed=i, name=name)
            for i, name in enumerate("qkvo")
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h * 1.5
        return self.o(self.q(x) * self.k(x) + self.v(x))


def _train(
    text: str, evaluate: bool, groups: bool, monkeypatch: pytest.MonkeyPatch, steps: int = 5
) -> tuple[Block, list[list[torch.Tensor]]]:
    """SGD steps; with ``evaluate`` an eval-mode forward (no_grad) before every step."""
    monkeypatch.setenv(LAYER_GROUPS_VAR, "1" if groups else "0")
    torch.manual_seed(0)
    model = Block(text)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(7)
    seen = []
    for _ in range(steps):
        h = torch.randn(32, 64, generator=gen)
        if evaluate:
            model.eval()
            with torch.no_grad():
                model(h)
            model.train()
        h = h.clone().requires_grad_(True)
        y = model(h)
        y.square().mean().backward()
        seen.append([y.detach(), h.grad, *(p.grad.clone() for p in model.parameters())])
        opt.step()
        opt.zero_grad(set_to_none=True)
    monkeypatch.delenv(LAYER_GROUPS_VAR)
    return model, seen


@pytest.mark.parametrize("groups", [True, False], ids=["groups", "no-groups"])
def test_training_steps_after_eval_steps_are_bit_exact(groups: bool, monkeypatch) -> None:
    """Stochastic rounding on the gradients and an RHT on wgrad: every output and gradient of
    a run with an eval forward before each step equals an uninterrupted run's (and a run of the
    recipe without the statement), with layer groups forming or not."""
    model, interrupted = _train(SMALL + "eval : bf16\n", True, groups, monkeypatch)
    _, plain = _train(SMALL + "eval : bf16\n", False, groups, monkeypatch)
    _, without = _train(SMALL, False, groups, monkeypatch)
    for got, want, base in zip(interrupted, plain, without, strict=True):
        for u, v, w in zip(got, want, base, strict=True):
            assert torch.equal(u, v) and torch.equal(u, w)
    if groups:  # the group formed and ran; the eval forwards did not break it
        group = layer_groups.group_of(model.q)
        assert group is not None and group.runs >= 1


def test_the_eval_table_is_a_table_of_its_own() -> None:
    """Layer graphs and layer groups key by table identity: the eval table is another object,
    one per phase, and the training table is the same object before and after."""
    (layer,) = _linears(NVFP4 + "eval : bf16\n")
    train_table = layer.operands
    layer.eval()
    eval_table = layer.operands
    assert eval_table is not train_table and eval_table is layer.operands
    assert layer._table_key(eval_table) != layer._table_key(train_table)
    layer.train()
    assert layer.operands is train_table


# ------------------------------------------------------------------------------------------------
# runtime: converted models
# ------------------------------------------------------------------------------------------------

CFG = GPTConfig(context=16, layers=3, heads=2, width=32)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def test_a_converted_model_evaluates_in_bf16_and_show_plan_says_so() -> None:
    ops = "operands {\n * : nvfp4\n}\n"
    model = fp4gen.convert(_gpt(), parse_recipe(ops + "eval : bf16\n"))
    high = fp4gen.convert(_gpt(), parse_recipe("operands {\n * : bf16\n}\n"))
    plain = fp4gen.convert(_gpt(), parse_recipe(ops))
    batch = torch.randint(0, CFG.vocab, (2, CFG.context + 1), generator=torch.Generator())
    x, y = batch[:, :-1], batch[:, 1:]
    assert torch.equal(model(x, y), plain(x, y))  # training mode: the recipe's formats
    model.eval()
    high.eval()
    with torch.no_grad():
        assert torch.equal(model(x, y), high(x, y))
    text = show_plan(model)
    assert "not training (model.eval()): the forward runs bf16 (both fprop operands)" in text
    assert "not training" not in show_plan(plain)


def test_grouped_experts_follow_the_model_mode() -> None:
    from fp4gen.runtime.experts import GroupedExperts

    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    fp4gen.convert(model, parse_recipe("operands {\n * : nvfp4\n}\neval : bf16\n"))
    experts = next(m for m in model.modules() if isinstance(m, GroupedExperts))
    assert experts.operands.fprop_weight.format.name == "nvfp4"
    model.eval()
    assert experts.operands.fprop_weight.format == HighPrecision("bf16")
    assert all(not g.training for pair in experts.gemms for g in pair)
    model.train()
    assert experts.operands.fprop_weight.format.name == "nvfp4"


# ------------------------------------------------------------------------------------------------
# GPU: layer graphs
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layer_graphs_train_step_after_eval_step_is_bit_exact(monkeypatch) -> None:
    """On CUDA with layer graphs: training steps with eval forwards in between give the bits of
    an uninterrupted run, and the eval forward is the high-precision one."""
    monkeypatch.setenv("FP4GEN_LAYER_GRAPHS", "1")
    text = SMALL + "eval : bf16\n"

    def run(evaluate: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layers = nn.Sequential(
            *(
                fp4gen.nn.Linear(256, 256, recipe=parse_recipe(text), seed=i, device="cuda")
                for i in range(2)
            )
        ).to(torch.bfloat16)
        opt = torch.optim.SGD(layers.parameters(), lr=1e-2)
        gen = torch.Generator(device="cuda").manual_seed(3)
        out = []
        for _ in range(4):
            x = torch.randn(512, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
            if evaluate:
                layers.eval()
                with torch.no_grad():
                    got = layers(x)
                    want = x
                    for layer in layers:
                        w, b = layer.weight.float(), layer.bias.float()
                        want = (want.float() @ w.T + b).to(torch.bfloat16)
                    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
                layers.train()
            x = x.requires_grad_(True)
            y = layers(x)
            y.float().square().mean().backward()
            out += [y.detach(), x.grad, *(p.grad.clone() for p in layers.parameters())]
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert all(layer._graphs is not None for layer in layers)  # the passes were graphable
        return out

    for a, b in zip(run(True), run(False), strict=True):
        assert torch.equal(a, b)

"""benchmarks/train.py's compiled rows on the CPU: each decoder block compiled on its own (as
torchtitan compiles a model) and the whole model, BF16 and a recipe in one table, with
dynamo's counts; a bad scope or mode is refused before anything runs. Timings are not asserted
(a benchmark's figures depend on the machine); what is asserted is what the run reports."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import train  # noqa: E402


def _args(**overrides) -> argparse.Namespace:
    values = dict(
        model="gpt",
        seq=16,
        tokens=32,
        steps=1,
        compile="blocks,model",
        compile_modes="default",
        compile_backend="eager",  # dynamo alone: inductor would take minutes on 2 cores
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def test_compiled_rows_time_bf16_and_a_recipe_per_scope(capsys, monkeypatch) -> None:
    monkeypatch.setattr(train, "WARMUP_STEPS", 1)
    recipes = ["bf16", "recipes/nvfp4_no_bf16.fp4r"]
    results = train.run_compiled_table(_args(), 32, 2, recipes, None, device="cpu")
    assert set(results) == {
        (scope, "default", recipe) for scope in ("blocks", "model") for recipe in recipes
    }
    for key, res in results.items():
        assert res.ms is not None and res.ms > 0, (key, res.note)
        assert res.breaks == 0, key  # neither BF16's nor the converted blocks break
        assert res.compiles >= 1, key  # dynamo compiled the model's frames
    # two converted blocks compiled one by one: their layers' op ids are graph inputs, so
    # they share a graph (tests/test_compile_recompiles.py: none of fp4gen's recompiles)
    assert results[("blocks", "default", recipes[1])].graphs == 1
    for scope in ("blocks", "model"):
        # the host breakdown: BF16 runs no fp4gen op; the recipe's 2 blocks x 4 layers run 8
        # forward and 8 backward passes per step, none from a layer graph on the CPU
        bf16, converted = (results[(scope, "default", r)].host for r in recipes)
        assert bf16 is not None and converted is not None
        assert (bf16.passes, bf16.forward_op_ms, bf16.backward_op_ms) == (0, 0, 0)
        got = (converted.passes, converted.from_graphs, converted.captured)
        assert got + (converted.timed_captures,) == (16, 0, 0, 0)
        assert 0 < converted.forward_op_ms < converted.forward_ms
        assert 0 < converted.backward_op_ms < converted.backward_ms
        assert converted.optimizer_ms > 0
    out = capsys.readouterr().out
    assert "x eager bf16" in out and "nvfp4_no_bf16" in out
    assert " blocks " in out and " model " in out
    assert "16: 0 from layer graphs (0 in place, 0 on static copies, 0 captured;" in out


def test_a_compiled_whole_model_trains_the_same_parameters(monkeypatch) -> None:
    """The optimizer of a compiled whole model updates the model's own parameters."""
    monkeypatch.setattr(train, "WARMUP_STEPS", 1)
    torch.manual_seed(0)
    model = train.build_model("gpt", 32, 2, 16, "cpu")
    before = [p.detach().clone() for p in model.parameters()]
    compiled = train.compile_model(model, "model", "default", "eager")
    tokens = torch.randint(0, train.VOCAB, (2, 17))
    train.make_step(compiled, train.loss_fn("gpt"), tokens, False, params=model)()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"compile": "layers"}, "compile scope 'layers'"),
        ({"compile_modes": "fastest"}, "compile mode 'fastest'"),
    ],
)
def test_a_bad_scope_or_mode_is_refused(overrides, message) -> None:
    with pytest.raises(SystemExit, match=message):
        train.run_compiled_table(_args(**overrides), 32, 1, ["bf16"], None, device="cpu")


def test_compiled_rounds_print_each_rows_median_and_range(capsys) -> None:
    """--rounds with compiled rows: each row's ratio to that round's compiled BF16, as the
    median and range over the rounds (a failed row leaves its round out)."""
    key = ("blocks", "reduce-overhead")
    rounds = [
        {
            (*key, "bf16"): train.CompiledResult(base, 1, 0, 1),
            (*key, "recipes/fp8_blockwise.fp4r"): train.CompiledResult(ms, 1, 0, 1),
        }
        for base, ms in ((10.0, 9.0), (10.0, 10.0), (20.0, 19.0), (10.0, None))
    ]
    train.print_compiled_rounds(rounds)
    out = capsys.readouterr().out
    assert "over 4 rounds" in out
    assert "fp8_blockwise                blocks reduce-overhead 0.95x (0.90x-1.00x)" in out
    assert "bf16 " not in out.split("\n", 1)[1]

"""MoR operands in the training runtime: Linear, convert, telemetry, and ``fp4gen report``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fp4gen
from fp4gen.cli import main
from fp4gen.demo.gpt import GPT, GPTConfig
from fp4gen.dsl import load_recipe, parse_recipe
from fp4gen.dsl.model import (
    Candidate,
    Metric,
    MoRRef,
    MoRSpec,
    OperandSpec,
    OperandTable,
    Partition,
)
from fp4gen.formats import E4M3, E5M2, HighPrecision
from fp4gen.numerics import quantize
from fp4gen.numerics.mor import HIST_BINS, MoRTensor, mor_quantize
from fp4gen.runtime.operands import operand_matmul

BF16 = HighPrecision("bf16")
BLOCKS = Partition("block", (16, 16))
# Three-way selection on 16x16 blocks, so that small test tensors mix representations.
RULE = MoRSpec(
    "three",
    BLOCKS,
    BLOCKS,
    "gam",
    (
        Candidate(E4M3, Metric("relerr_vs", versus=E5M2)),
        Candidate(E5M2, Metric("range")),
        Candidate(BF16),
    ),
)
TABLE = OperandTable.uniform(OperandSpec(MoRRef("three")))
PNG = b"\x89PNG\r\n\x1a\n"


def mixed(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Gaussian, with one 16x16 block of magnitudes over 2^20 (e5m2) and one over 2^34 (bf16)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    sign = torch.where(torch.rand(16, 16, generator=g) < 0.5, -1.0, 1.0)
    x[:16, :16] = sign * torch.exp2(-20 * torch.rand(16, 16, generator=g))
    x[16:32, 16:32] = sign * torch.exp2(-34 * torch.rand(16, 16, generator=g))
    x[0, 0], x[1, 1], x[16, 16], x[17, 17] = 1.0, 2.0**-20, 1.0, 2.0**-34
    return x


def mq(t: torch.Tensor) -> MoRTensor:
    return mor_quantize(t, RULE)


def exact_matmul(a: MoRTensor, b: MoRTensor) -> torch.Tensor:
    """Fake quantization written out: exact values, float64 sum, one rounding to fp32."""
    return (a.values() @ b.values().t()).float()


def test_linear_forward_backward_equal_fake_quant() -> None:
    torch.manual_seed(0)
    layer = fp4gen.nn.Linear(64, 48, operands=TABLE, mors=(RULE,), name="layer")
    with torch.no_grad():
        layer.weight.copy_(mixed(48, 64, seed=1) * 0.1)
    x = mixed(32, 64, seed=2).requires_grad_(True)
    dy = mixed(32, 48, seed=3)
    assert set(mq(x.detach()).choice.unique().tolist()) == {0, 1, 2}  # all three in play
    y = layer(x)
    y.backward(dy)

    w, b, xd = layer.weight.detach(), layer.bias.detach(), x.detach()
    assert torch.equal(y.detach(), exact_matmul(mq(xd), mq(w)) + b)
    assert torch.equal(x.grad, exact_matmul(mq(dy), mq(w.t().contiguous())))
    assert torch.equal(layer.weight.grad, exact_matmul(mq(dy.t().contiguous()), mq(xd.t())))
    assert torch.equal(layer.bias.grad, dy.sum(0))
    # and, to fp32 rounding, the plain fake-quant GEMM of the dequantized operands
    fake = mq(xd).dequantize() @ mq(w).dequantize().t() + b
    assert torch.allclose(y.detach(), fake, rtol=1e-5, atol=1e-6)


def test_fallback_everywhere_is_bf16() -> None:
    """A threshold no tensor meets keeps every operand in bf16: the layer then computes exactly
    what an all-bf16 operand table computes."""
    never = parse_recipe(
        "mor never {\n decide tensor\n scale tensor gam\n try e4m3 if relerr < 0.01%\n"
        " else bf16\n}\noperands {\n * : mor never\n}\n"
    )
    bf16 = parse_recipe("operands {\n * : bf16\n}\n")
    x, dy = torch.randn(16, 64), torch.randn(16, 48)
    grads = []
    for recipe in (never, bf16):
        torch.manual_seed(1)
        layer = fp4gen.nn.Linear(64, 48, recipe=recipe)
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(dy)
        grads.append((y.detach(), xi.grad, layer.weight.grad))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_operand_matmul_upcasts_mixed_operands() -> None:
    a = mq(mixed(32, 64, seed=4))
    other = torch.randn(24, 64).bfloat16()
    want = (a.values() @ other.double().t()).float()
    assert torch.equal(operand_matmul(a, other), want)
    assert torch.equal(operand_matmul(other, a), want.t())
    qt = quantize(torch.randn(24, 64), "nvfp4")
    assert torch.equal(operand_matmul(a, qt), (a.values() @ qt.dequantize().double().t()).float())
    # the same RHT on both sides cancels in the rotated space; a lone one is an error
    r1 = mor_quantize(torch.randn(8, 64), RULE, hadamard=16)
    r2 = mor_quantize(torch.randn(8, 64), RULE, hadamard=16)
    assert torch.equal(operand_matmul(r1, r2), (r1.values() @ r2.values().t()).float())
    with pytest.raises(fp4gen.FP4GenError, match="same RHT"):
        operand_matmul(r1, a)


def test_cute_backend_needs_cuda_for_mor() -> None:
    """backend "cute" requires the generated MoR kernels, which run on CUDA tensors only."""
    layer = fp4gen.nn.Linear(64, 48, operands=TABLE, mors=(RULE,), backend="cute")
    with pytest.raises(fp4gen.FP4GenError, match="generated MoR kernels.*CUDA tensors"):
        layer(torch.randn(4, 64))


CFG = GPTConfig(context=16, layers=2, heads=2, width=32)


def train(recipe, steps: int, telemetry_every: int = 0, autocast: bool = False):
    torch.manual_seed(0)
    model = fp4gen.convert(GPT(CFG), recipe, seed=0, total_steps=steps)
    fp4gen.enable_telemetry(model, telemetry_every)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 16, (64, CFG.context + 1), generator=torch.Generator().manual_seed(0))
    losses = []
    for step in range(steps):
        fp4gen.set_step(model, step)
        batch = data[(step * 4) % 60 : (step * 4) % 60 + 4]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses


@pytest.mark.parametrize("name", ["mor_tensor", "mor_subtensor_2way", "mor_subtensor_3way"])
def test_shipped_mor_recipes_train(name: str) -> None:
    model, losses = train(load_recipe(f"{name}.fp4r"), steps=10, telemetry_every=3)
    assert fp4gen.runtime.convert.count_converted(model) == 4 * CFG.layers
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5
    records = fp4gen.telemetry(model)
    ops = {r["operand"] for r in records}
    assert ops == {op.selector for op in fp4gen.Operand}  # all six operands are recorded
    for r in records:
        assert 0.0 <= r["fallback"] <= 1.0 and len(r["rel_error_hist"]) == HIST_BINS
        assert sum(r["rel_error_hist"]) <= r["units"] and 0 <= r["mean_rel_error"] < 0.1
        assert sum(r["formats"].values()) == pytest.approx(1.0)


def test_bf16_autocast_training_and_schedule_into_mor() -> None:
    recipe = parse_recipe(
        'operands {\n * : nvfp4\n}\nschedule {\n at step 2 : recipe "mor_subtensor_3way.fp4r"\n}\n'
    )
    model, losses = train(recipe, steps=4, autocast=True)
    layer = model.blocks[1].mlp.fc2
    assert isinstance(layer.operands.fprop_activation.format, MoRRef)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_conflicting_mor_names_are_an_error() -> None:
    other = MoRSpec("tensor_e4m3", BLOCKS, BLOCKS, "e8m0", RULE.candidates)
    with pytest.raises(fp4gen.FP4GenError, match="two different MoR rules"):
        fp4gen.nn.Linear(8, 8, recipe=load_recipe("mor_tensor.fp4r"), mors=(other,))


# ------------------------------------------------------------------------------------------------
# fp4gen report
# ------------------------------------------------------------------------------------------------


def layer_records() -> list[dict]:
    out = []
    for name, table, mors in (
        ("three", TABLE, (RULE,)),
        ("nvfp4", OperandTable.uniform(OperandSpec(fp4gen.BUILTIN_FORMATS["nvfp4"])), ()),
    ):
        layer = fp4gen.nn.Linear(64, 48, operands=table, mors=mors, name="l")
        layer.telemetry.every = 1
        for seed in range(2):
            layer(mixed(32, 64, seed=seed).requires_grad_(True)).sum().backward()
        out += [{"recipe": name, **r} for r in layer.telemetry.records]
    return out


def test_report_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "telemetry.json"
    path.write_text(json.dumps({"records": layer_records()}))
    assert main(["report", str(path), "--out", str(tmp_path / "h.png")]) == 0
    out = capsys.readouterr().out
    assert "three: l fprop.activation" in out and "nvfp4: l wgrad.gradient" in out
    assert (tmp_path / "h.png").read_bytes()[:8] == PNG

    assert main(["report", str(path), "--recipe", "three", "--json", "--no-png"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["operand"] for r in rows] == [op.selector for op in fp4gen.Operand]
    assert all(len(r["counts"]) == HIST_BINS and sum(r["counts"]) > 0 for r in rows)
    assert any(r["fallback"] > 0 for r in rows)

    (tmp_path / "bad.json").write_text("{")
    assert main(["report", str(tmp_path / "bad.json")]) == 1
    assert "not JSON" in capsys.readouterr().err


def test_demo_telemetry_then_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--recipes", "mor_subtensor_2way", "--steps", "2", "--batch", "2"]
    argv += ["--eval-every", "10", "--device", "cpu", "--telemetry", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    records = json.loads((tmp_path / "telemetry.json").read_text())["records"]
    assert records and all(r["recipe"] == "mor_subtensor_2way" for r in records)
    assert main(["report", str(tmp_path / "telemetry.json")]) == 0
    assert (tmp_path / "telemetry.png").read_bytes()[:8] == PNG
    capsys.readouterr()

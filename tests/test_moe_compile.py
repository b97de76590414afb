"""torch.compile of converted MoE models, block by block as torchtitan compiles them: the
experts run eagerly (``GroupedExperts._run_experts`` is ``torch.compiler.disable``d: their
shapes follow the routing), everything else of the block is traced, and training is bit for
bit the eager model's, per expert and grouped, with and without expert biases (gpt-oss)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fp4gen

sys.path.insert(0, str(Path(__file__).resolve().parent))

transformers = pytest.importorskip("transformers")

from test_checkpoint_streams import train_causal_lm  # noqa: E402
from test_moe import build  # noqa: E402


def converted(arch: str, grouped: bool) -> torch.nn.Module:
    model = fp4gen.convert(build(arch, torch.float32), "nvfp4_small", seed=1)
    for layer in model.model.layers:
        layer.mlp.experts.grouped = grouped
    return model


@pytest.mark.parametrize("grouped", [False, True], ids=["per-expert", "grouped"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_blocks_compiled_one_by_one_train_as_eager(arch: str, grouped: bool) -> None:
    want = train_causal_lm(converted(arch, grouped), checkpointed=False)
    model = converted(arch, grouped)
    torch._dynamo.reset()
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(layer, backend="aot_eager")
    got = train_causal_lm(model, checkpointed=False)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), i


def test_the_experts_are_the_only_graph_break() -> None:
    model = converted("qwen3_moe", grouped=True)
    layer = model.model.layers[0]
    hidden = torch.randn(2, 16, 64)
    embeddings = model.model.rotary_emb(hidden, torch.arange(16)[None])
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(hidden, position_embeddings=embeddings)
    assert explained.break_reasons
    for reason in explained.break_reasons:
        assert "torch.compiler.disable" in str(reason.reason)
        assert any("experts.py" in str(frame) for frame in reason.user_stack)

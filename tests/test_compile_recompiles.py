"""Recompiles of a converted transformers Llama compiled block by block (as torchtitan compiles a
model): how many graphs dynamo makes, and that none comes from fp4gen's own state.

A recompile per block costs compile time, and past dynamo's recompile limit (8) the blocks that
do not match a graph run eagerly (or, with fullgraph=True, fail). Two causes were found:

- fp4gen: ``Linear._linear`` read the non-finite mode (``finite.layer_mode()``) while dynamo
  traced; the first read stores the mode, so the graph's guard ``_layer_mode[0] is None`` failed
  on the next call and every compiled block compiled once more. The mode is now read only
  outside dynamo's tracing (the ops read it when they run).
- transformers: a forward with ``use_cache=True`` (the config's default) updates a KV cache at
  ``self_attn.layer_idx``, a module int dynamo specializes, so every block gets a graph of its
  own, with or without fp4gen (a training step passes ``use_cache=False``).
"""

from __future__ import annotations

import pytest
import torch

import fp4gen
from fp4gen.runtime import finite

transformers = pytest.importorskip("transformers")

# every layer quantized except the last block's and the head (as nvfp4_small), gradients
# rounded stochastically (compiled and eager draw the same bits)
LAST_BLOCK_BF16 = """
recipe last_block_bf16 "test: NVFP4, the last block and the head in BF16"
operands {
    *        : nvfp4 round nearest
    gradient : round stochastic8
}
layers {
    last 1 blocks    : bf16
    match "*lm_head" : bf16
}
"""


def llama(blocks: int, recipe: str | None) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=blocks,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    if recipe is not None:
        fp4gen.convert(model, fp4gen.parse_recipe(recipe) if "\n" in recipe else recipe)
    return model


def step(
    model: torch.nn.Module, tokens: torch.Tensor, *, compiled: bool, use_cache: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and gradients of one step; with ``compiled`` each decoder block compiled on its own
    with fullgraph=True (a recompile past the limit then raises)."""
    if compiled:
        for block in model.model.layers:
            block.compile(backend="aot_eager", fullgraph=True)
    loss = model(input_ids=tokens, labels=tokens, use_cache=use_cache).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.fixture
def fresh_dynamo(monkeypatch: pytest.MonkeyPatch):
    """dynamo's caches and counters emptied, and fp4gen's non-finite mode not read yet (as in a
    new process: the state whose first read caused a recompile)."""
    monkeypatch.setattr(finite, "_layer_mode", [None])
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    yield counters
    torch._dynamo.reset()


def test_converted_blocks_compiled_one_by_one_make_one_graph(fresh_dynamo) -> None:
    """4 converted blocks, a training step twice: one graph for all of them, no recompile
    (before the fix: 2 graphs, the second made when the non-finite mode had been read)."""
    model = llama(4, "nvfp4_no_bf16")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        step(model, tokens, compiled=True)
    stats = fresh_dynamo["stats"]
    assert stats["unique_graphs"] == 1, dict(stats)
    assert fresh_dynamo["aot_autograd"]["total"] == 1, dict(fresh_dynamo["aot_autograd"])


def test_nine_blocks_with_a_bf16_last_block_stay_under_the_recompile_limit(fresh_dynamo) -> None:
    """9 blocks, the last kept in BF16 by the recipe (nn.Linear layers, another graph): 2
    graphs, fullgraph=True never reaches dynamo's recompile limit (8), and the compiled step
    gives eager mode's loss and gradients bit for bit."""
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    model = llama(9, LAST_BLOCK_BF16)
    assert not isinstance(model.model.layers[8].mlp.up_proj, fp4gen.nn.Linear)
    assert isinstance(model.model.layers[7].mlp.up_proj, fp4gen.nn.Linear)
    got = step(model, tokens, compiled=True)  # first: the non-finite mode not read yet
    want = step(llama(9, LAST_BLOCK_BF16), tokens, compiled=False)
    stats = fresh_dynamo["stats"]
    assert stats["unique_graphs"] == 2, dict(stats)
    assert not stats.get("recompiles_due_to_cache_limit"), dict(stats)
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)


def test_a_kv_cache_gives_every_block_its_graph_with_or_without_fp4gen(fresh_dynamo) -> None:
    """The control: with ``use_cache=True`` transformers' cache update specializes each block's
    ``layer_idx``, so BF16 and the converted model both make one graph per block (3 here), no
    more for fp4gen."""
    tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(3))
    graphs = []
    for recipe in (None, "nvfp4_no_sr"):
        torch._dynamo.reset()
        fresh_dynamo.clear()
        step(llama(3, recipe), tokens, compiled=True, use_cache=True)
        graphs.append(fresh_dynamo["stats"]["unique_graphs"])
    assert graphs == [3, 3]

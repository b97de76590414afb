"""torch.compile sees a converted block as one graph: no graph breaks in fp4gen's demo GPT block
or a converted transformers Llama decoder layer (``torch._dynamo.explain``, the eager backend),
the whole block compiles with fullgraph=True forward and backward with eager mode's bits, and
the custom ops behind fp4gen.nn.Linear pass ``torch.library.opcheck`` (schema, autograd
registration, fake kernels, AOT dispatch) with fake outputs of exactly the real shape, dtype,
strides and device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fp4gen
from fp4gen.demo.gpt import GPT, GPTConfig

# SR and RHT (nvfp4_no_bf16), per-tensor MoR, MX blocks, FP8 2D blocks
RECIPES = ("nvfp4_no_bf16", "mor_tensor", "mxfp4_small", "fp8_blockwise")
# opcheck calls an op several times and compares the results: no stochastic rounding
DETERMINISTIC = ("nvfp4_no_sr", "mor_tensor")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def gpt_block(recipe: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(layers=2, width=64, heads=4, context=32))
    fp4gen.convert(model, recipe, total_steps=10)
    block = model.blocks[0]
    assert isinstance(block.attn.qkv, fp4gen.nn.Linear)
    return block


def llama(recipe: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    fp4gen.convert(model, recipe, total_steps=10)
    assert isinstance(model.model.layers[0].self_attn.q_proj, fp4gen.nn.Linear)
    return model


def explain(fn, *args, **kwargs):
    torch._dynamo.reset()
    found = torch._dynamo.explain(fn)(*args, **kwargs)
    reasons = [str(r.reason).splitlines()[0] for r in found.break_reasons]
    return found, reasons


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_demo_gpt_block_has_no_graph_breaks(recipe: str, autocast: bool) -> None:
    block = gpt_block(recipe)
    x = torch.randn(2, 32, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        found, reasons = explain(block, x)
    assert (found.graph_break_count, reasons) == (0, [])
    assert found.graph_count == 1
    # the four layers are four calls of the forward op in that graph
    ops = [n for g in found.graphs for n in g.graph.nodes if "linear_forward" in str(n.target)]
    assert len(ops) == 4


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_llama_decoder_layer_has_no_graph_breaks(recipe: str, autocast: bool) -> None:
    model = llama(recipe)
    ids = torch.randint(0, 256, (2, 16))
    for step in range(3):  # eager steps first: what they set up must not break the trace
        fp4gen.set_step(model, step)
        model(input_ids=ids, labels=ids).loss.backward()
    layer = model.model.layers[0]
    h = torch.randn(2, 16, 64, requires_grad=True)
    positions = torch.arange(16)[None].expand(2, 16)
    rotary = model.model.rotary_emb(h, positions)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        found, reasons = explain(
            layer, h, position_embeddings=rotary, attention_mask=None, position_ids=positions
        )
    assert (found.graph_break_count, reasons) == (0, [])
    assert found.graph_count == 1
    ops = [n for g in found.graphs for n in g.graph.nodes if "linear_forward" in str(n.target)]
    assert len(ops) == 7  # q, k, v, o, gate, up, down


def test_whole_converted_llama_with_its_loss_has_no_graph_breaks() -> None:
    model = llama("nvfp4_small")  # the last block and lm_head stay nn.Linear
    ids = torch.randint(0, 256, (2, 16))
    found, reasons = explain(model, input_ids=ids, labels=ids)
    assert (found.graph_break_count, reasons) == (0, [])


@pytest.mark.parametrize("recipe", ["nvfp4_no_bf16", "mor_tensor"])
def test_fullgraph_block_matches_eager_forward_and_backward(recipe: str) -> None:
    """Two identical blocks (same seeds, stochastic rounding on), one eager and one compiled
    with fullgraph=True (aot_eager: the backward goes through the backward op): the same y, dx
    and weight gradients bit for bit; the LayerNorm and residual math is traced the same."""
    eager, compiled = gpt_block(recipe), gpt_block(recipe)
    torch._dynamo.reset()
    run = torch.compile(compiled, backend="aot_eager", fullgraph=True)
    torch.manual_seed(1)
    x, dy = torch.randn(2, 32, 64), torch.randn(2, 32, 64)
    outputs = []
    for block in (eager, run):
        xi = x.clone().requires_grad_()
        y = block(xi)
        y.backward(dy)
        outputs.append((y.detach(), xi.grad))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1], outputs[1][1])
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def op_cases(device: str):
    """(tokens, in, out, x dtype, weight dtype, out dtype, bias): odd token counts and widths
    (padded inside), mixed dtypes as under autocast, no bias."""
    return [
        (30, 72, 40, torch.float32, torch.float32, torch.float32, True),
        (17, 64, 48, torch.bfloat16, torch.float32, torch.bfloat16, True),
        (1, 16, 8, torch.bfloat16, torch.bfloat16, torch.float32, False),
    ]


def op_args(layer, tokens, x_dtype, w_dtype, out_dtype, bias, device, contiguous=True):
    torch.manual_seed(2)
    x = torch.randn(tokens, layer.in_features, device=device, dtype=x_dtype)
    w = layer.weight.detach().to(device, w_dtype)
    if not contiguous:  # a transposed x, and a Conv1D-style [in, out] weight seen as [out, in]
        x = x.t().contiguous().t()
        w = w.t().contiguous().t()
    b = layer.bias.detach().to(device) if bias else None
    dy = torch.randn(tokens, layer.out_features, device=device, dtype=out_dtype)
    return x, w, b, dy


OP_PAIRS = {
    "captured": ("linear_forward", "linear_backward"),
    # the twins a MoR layer compiles to (tagged cudagraph_unsafe): the same kernels
    "uncaptured": ("linear_forward_uncaptured", "linear_backward_uncaptured"),
}


@pytest.mark.parametrize("ops", OP_PAIRS)
@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("recipe", DETERMINISTIC)
def test_custom_ops_pass_opcheck(recipe: str, case: int, ops: str) -> None:
    tokens, n_in, n_out, x_dtype, w_dtype, out_dtype, bias = op_cases("cpu")[case]
    layer = fp4gen.nn.Linear(n_in, n_out, recipe=recipe)
    x, w, b, dy = op_args(layer, tokens, x_dtype, w_dtype, out_dtype, bias, "cpu")
    passed = {
        "test_schema": "SUCCESS",
        "test_autograd_registration": "SUCCESS",
        "test_faketensor": "SUCCESS",
        "test_aot_dispatch_dynamic": "SUCCESS",
    }
    x.requires_grad_()
    w.requires_grad_()
    forward_op, backward_op = (getattr(torch.ops.fp4gen, name).default for name in OP_PAIRS[ops])
    forward = (x, w, b, layer._op_id, out_dtype)
    assert torch.library.opcheck(forward_op, forward) == passed
    backward = (dy, x.detach(), w.detach(), layer._op_id)
    assert torch.library.opcheck(backward_op, backward) == passed


def metadata(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.stride(), t.device


def check_fake_outputs(recipe: str, case: int, contiguous: bool, device: str) -> None:
    """The fake kernels' outputs have the real outputs' shape, dtype, strides and device."""
    tokens, n_in, n_out, x_dtype, w_dtype, out_dtype, bias = op_cases(device)[case]
    layer = fp4gen.nn.Linear(n_in, n_out, recipe=recipe, device=device)
    x, w, b, dy = op_args(layer, tokens, x_dtype, w_dtype, out_dtype, bias, device, contiguous)
    real = [torch.ops.fp4gen.linear_forward(x, w, b, layer._op_id, out_dtype)]
    real += torch.ops.fp4gen.linear_backward(dy, x, w, layer._op_id)
    with FakeTensorMode() as mode:
        fx, fw, fdy = (mode.from_tensor(t) for t in (x, w, dy))
        fb = None if b is None else mode.from_tensor(b)
        fake = [torch.ops.fp4gen.linear_forward(fx, fw, fb, layer._op_id, out_dtype)]
        fake += torch.ops.fp4gen.linear_backward(fdy, fx, fw, layer._op_id)
    assert [metadata(t) for t in fake] == [metadata(t) for t in real]
    assert metadata(real[0])[:2] == ((tokens, n_out), out_dtype)
    assert metadata(real[1])[:2] == ((tokens, n_in), x_dtype)  # dx in x's dtype
    assert metadata(real[2])[:2] == ((n_out, n_in), w_dtype)  # dW in the weight's


@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("recipe", RECIPES)
def test_fake_kernels_give_the_real_metadata(recipe: str, case: int, contiguous: bool) -> None:
    check_fake_outputs(recipe, case, contiguous, "cpu")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "transposed"])
@pytest.mark.parametrize("case", range(3))
@pytest.mark.parametrize("recipe", RECIPES)
def test_fake_kernels_give_the_real_metadata_on_cuda(
    recipe: str, case: int, contiguous: bool
) -> None:
    """On CUDA the generated kernels and cuBLAS write the outputs: the fakes still match."""
    check_fake_outputs(recipe, case, contiguous, "cuda")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("recipe", DETERMINISTIC)
def test_custom_ops_pass_opcheck_on_cuda(recipe: str) -> None:
    layer = fp4gen.nn.Linear(64, 48, recipe=recipe, device="cuda")
    x, w, b, dy = op_args(layer, 32, torch.bfloat16, torch.float32, torch.bfloat16, True, "cuda")
    forward = (x.requires_grad_(), w.requires_grad_(), b, layer._op_id, torch.bfloat16)
    result = torch.library.opcheck(torch.ops.fp4gen.linear_forward.default, forward)
    assert set(result.values()) == {"SUCCESS"}
    backward = (dy, x.detach(), w.detach(), layer._op_id)
    result = torch.library.opcheck(torch.ops.fp4gen.linear_backward.default, backward)
    assert set(result.values()) == {"SUCCESS"}


def test_a_converted_moe_model_compiles_around_its_experts_loop() -> None:
    """A converted Mixtral's experts loop (data-dependent routing) runs eagerly inside a
    compiled model (torch.compiler.disable): the graph breaks only where the loop is entered
    (traced, it broke the graph at every expert: 18 breaks in this model), no retrace per
    expert (each expert's GEMM has its own op id, a constant to dynamo), and the compiled model
    computes eager mode's bits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    model = transformers.MixtralForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16))
    original, _ = explain(model, input_ids=ids)
    # every GEMM operand NVFP4, round to nearest: no layer rule keeps the experts in BF16
    fp4gen.convert(model, fp4gen.parse_recipe("operands {\n    * : nvfp4\n}\n"))
    assert type(model.model.layers[1].mlp.experts).__name__ == "GroupedExperts"
    found, reasons = explain(model, input_ids=ids)
    assert original.graph_break_count == 0
    # only where the experts' loop is entered (explain counts each frame that reaches it)
    assert set(reasons) == {"Skip inlining `torch.compiler.disable()`d function"}, reasons
    want = model(input_ids=ids).logits
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    got = torch.compile(model, backend="eager")(input_ids=ids).logits
    assert torch.equal(got, want)
    assert not counters["stats"].get("recompiles_due_to_cache_limit"), dict(counters["stats"])
    assert counters["stats"]["unique_graphs"] <= 8


SHIPPED = sorted(p.stem for p in (Path(fp4gen.__file__).parent / "recipes").glob("*.fp4r"))


def deep_gpt(recipe: str, blocks: int = 12) -> GPT:
    """A GPT deep enough that every shipped recipe converts some block (nvfp4 keeps the first
    two and the last eight in BF16)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=blocks, width=64, heads=4, context=32))
    fp4gen.convert(model, recipe, total_steps=10)
    return model


@pytest.mark.parametrize("recipe", SHIPPED)
def test_every_shipped_recipe_gives_a_block_without_graph_breaks(recipe: str) -> None:
    """The first converted block of a 12-block GPT, for each shipped recipe: one graph, no
    break, its four layers four calls of the forward op."""
    model = deep_gpt(recipe)
    converted = [b for b in model.blocks if isinstance(b.attn.qkv, fp4gen.nn.Linear)]
    assert converted, recipe
    x = torch.randn(2, 32, 64, requires_grad=True)
    found, reasons = explain(converted[0], x)
    assert (found.graph_break_count, reasons, found.graph_count) == (0, [], 1)
    ops = [n for g in found.graphs for n in g.graph.nodes if "linear_forward" in str(n.target)]
    assert len(ops) == 4


def per_block_run(model: GPT, tokens: torch.Tensor, backend: str | None) -> tuple:
    """Loss and gradients of one step, each block compiled on its own with fullgraph=True (as
    torchtitan compiles a model) where ``backend`` is given."""
    if backend is not None:
        for block in model.blocks:
            block.compile(backend=backend, fullgraph=True)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def test_blocks_compiled_one_by_one_share_a_graph() -> None:
    """9 converted blocks, each compiled with fullgraph=True: the layers' op ids are graph
    inputs (``ops.OP_ID_SOURCE``), so the blocks share graphs instead of compiling once each
    (which fails at the ninth block on dynamo's recompile limit of 8: the second half of this
    test), and the step computes eager mode's loss and gradients bit for bit (stochastic
    rounding on: nvfp4_no_bf16)."""
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(3))
    want = per_block_run(deep_gpt("nvfp4_no_bf16", 9), tokens, None)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    got = per_block_run(deep_gpt("nvfp4_no_bf16", 9), tokens, "aot_eager")
    # one graph for the blocks (tests/test_compile_recompiles.py: no recompile of fp4gen's)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert torch.equal(got[0], want[0])
    for a, b in zip(got[1], want[1], strict=True):
        assert torch.equal(a, b)


def test_constant_op_ids_would_compile_every_block() -> None:
    """The control: with the op ids specialized (not a dynamic source), every block compiles
    on its own and fullgraph=True fails on the recompile limit (8) at the ninth. The setting
    is changed by torch's own ``config.patch``: pytest's monkeypatch (9.2) undoes a setattr on
    a config module, whose values are not in its ``__dict__``, by deleting the key, which hides
    it from every later compile in the process."""
    model = deep_gpt("nvfp4_no_bf16", 9)
    with torch.compiler.config.patch(dynamic_sources=""):
        torch._dynamo.reset()
        tokens = torch.randint(0, 256, (2, 33))
        limit_hit = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", RuntimeError)
        with pytest.raises(limit_hit):
            per_block_run(model, tokens, "eager")
    assert hasattr(torch.compiler.config, "dynamic_sources")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_inductor_modes_compile_a_block_and_match_eager(mode: str) -> None:
    """A converted block compiled by inductor with ``mode`` (on the CPU: C++ kernels; no CUDA
    graphs there) with fullgraph=True: the output and the input gradient within 1e-6 of eager
    mode's (the GEMMs are fp4gen's opaque ops in both; inductor's own fused fp32 LayerNorm and
    residual, forward and backward, may round in another order: on an AVX-512 host the output
    differed by one ulp in 991 of 4096 values, 2.4e-7 on values of up to ~4, and was bit for
    bit eager's with inductor's vectorization off; the gradient 4.8e-7 on values of ~1)."""
    eager, compiled = gpt_block("nvfp4_no_bf16"), gpt_block("nvfp4_no_bf16")
    torch._dynamo.reset()
    run = torch.compile(compiled, mode=mode, fullgraph=True)
    torch.manual_seed(1)
    x, dy = torch.randn(2, 32, 64), torch.randn(2, 32, 64)
    outputs = []
    for block in (eager, run):
        xi = x.clone().requires_grad_()
        y = block(xi)
        y.backward(dy)
        outputs.append((y.detach(), xi.grad))
    torch.testing.assert_close(outputs[1][0], outputs[0][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(outputs[1][1], outputs[0][1], rtol=0, atol=1e-6)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_backward_quantizes_each_layers_wgrad_copy(monkeypatch) -> None:
    """A Llama compiled with aot_eager quantizes x's wgrad copy per layer in its backward (14
    in two decoder layers: without inductor no pass merges the ops that read one x,
    tests/test_compile_sharing.py), where the
    eager route's forward makes one per input its layers share (q, k and v read one x; gate and
    up another: 8); the step's gradients are eager mode's bit for bit (nvfp4_no_bf16: the
    copies are rounded to nearest, the gradients stochastically from the same streams)."""
    made: list[str] = []
    original = fp4gen.nn.Linear.wgrad_activation

    def counted(self, x2, table, call, **kw):
        made.append(self.name)
        return original(self, x2, table, call, **kw)

    monkeypatch.setattr(fp4gen.nn.Linear, "wgrad_activation", counted)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    grads = []
    for compiled in (False, True):
        model = llama("nvfp4_no_bf16")
        torch._dynamo.reset()
        run = torch.compile(model, backend="aot_eager") if compiled else model
        made.clear()
        run(input_ids=ids, labels=ids).loss.backward()
        assert len(made) == (14 if compiled else 8), made
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def traced_fp4gen_ops(module: torch.nn.Module, x: torch.Tensor) -> list[str]:
    """The fp4gen ops of the forward and backward graphs AOT autograd gives for ``module``."""
    from torch._dynamo.backends.common import aot_autograd

    seen: list[str] = []

    def record(gm: torch.fx.GraphModule, _inputs):
        for node in gm.graph.nodes:
            name = getattr(node.target, "name", lambda: "")()
            if name.startswith("fp4gen::"):
                seen.append(name.removeprefix("fp4gen::").removesuffix(".default"))
        return gm

    torch._dynamo.reset()
    run = torch.compile(module, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    run(x.requires_grad_()).sum().backward()
    return seen


@pytest.mark.parametrize(
    ("recipe", "forward", "backward"),
    [
        ("nvfp4_no_sr", "linear_forward", "linear_backward"),
        ("mor_tensor", "linear_forward_uncaptured", "linear_backward_uncaptured"),
    ],
)
def test_mor_layers_compile_to_the_ops_cuda_graphs_leave_out(
    recipe: str, forward: str, backward: str
) -> None:
    """A Mixture-of-Representations layer reads its values on the host to choose each block's
    format, which a CUDA graph capture refuses: compiled, it runs as the twin ops tagged
    ``cudagraph_unsafe``, which inductor's CUDA graphs (mode "reduce-overhead") run between
    their replays; a block-format layer keeps the capturable ops. Both pairs run the same
    kernels (the opcheck test above)."""
    layer = fp4gen.nn.Linear(64, 32, recipe=recipe)
    assert traced_fp4gen_ops(layer, torch.randn(16, 64)) == [forward, backward]
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    if tag is not None:
        unsafe = {
            name: tag in getattr(torch.ops.fp4gen, name).default.tags
            for name in OP_PAIRS["uncaptured"] + OP_PAIRS["captured"]
        }
        assert unsafe == {
            "linear_forward_uncaptured": True,
            "linear_backward_uncaptured": True,
            "linear_forward": False,
            "linear_backward": False,
        }

"""fp4gen.runtime.attention.MultiheadAttention: nn.MultiheadAttention's computation with its
projections as linear layers, and what convert does with it.

CPU tests. Self-attention (query, key and value one tensor) gives nn.MultiheadAttention's bits:
the same ops in the same order, the packed projection's output sliced as torch slices it. For
cross-attention the projection runs on each input whole and keeps its part, where torch
multiplies by the weight's rows of that part: the same products, summed in an order the GEMM
picks for each weight shape, so those cases match to fp32 summation order (relative 1e-5 of the
outputs' scale)."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from torch import nn

import fp4gen
from fp4gen.errors import FP4GenError
from fp4gen.runtime import convert as convert_module
from fp4gen.runtime.attention import MultiheadAttention, unsupported_reason
from fp4gen.runtime.linear import Linear

E, HEADS, L, S, N = 32, 4, 7, 5, 3

MASKS = ["none", "bool 2d", "float 3d", "key padding", "key padding + bool 2d", "causal"]


def masks(kind: str, tgt: int, src: int, g: torch.Generator) -> dict:
    """forward's mask arguments of ``kind`` for a batch of N (every query attends to the first
    key: no row is masked whole, which would give NaN on both sides)."""
    drawn = torch.rand(tgt, src, generator=g) < 0.3
    drawn[:, 0] = False
    if kind == "none":
        return {}
    if kind == "bool 2d":
        return {"attn_mask": drawn}
    if kind == "float 3d":
        return {"attn_mask": torch.randn(N * HEADS, tgt, src, generator=g)}
    padding = torch.zeros(N, src, dtype=torch.bool)
    padding[0, -2:] = True  # the first sequence's last two keys are padding
    if kind == "key padding":
        return {"key_padding_mask": padding}
    if kind == "key padding + bool 2d":
        return {"key_padding_mask": padding, "attn_mask": drawn}
    causal = nn.Transformer.generate_square_subsequent_mask(tgt)
    return {"attn_mask": causal, "is_causal": True}


def inputs(kind: str, batch_first: bool, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(query, key, value): one tensor for "self", key = value for "kv", three for "qkv"."""

    def make(length: int) -> torch.Tensor:
        shape = (N, length, E) if batch_first else (length, N, E)
        return torch.randn(shape, generator=g).requires_grad_()

    q = make(L)
    if kind == "self":
        return q, q, q
    k = make(S)
    return (q, k, k) if kind == "kv" else (q, k, make(S))


# (inputs, batch_first, bias, need_weights, average_attn_weights, mask): a causal mask is square
# (self-attention), average_attn_weights applies to the returned weights only
CASES = [
    case
    for case in itertools.product(
        ["self", "kv", "qkv"], [False, True], [True, False], [True, False], [True, False], MASKS
    )
    if (case[5] != "causal" or case[0] == "self") and (case[3] or case[4])
]


@pytest.mark.parametrize("kind, batch_first, bias, need_weights, average, mask", CASES)
def test_the_same_attention_as_torch(
    kind: str, batch_first: bool, bias: bool, need_weights: bool, average: bool, mask: str
) -> None:
    """Outputs, attention weights and the gradients of the inputs and every parameter, as
    nn.MultiheadAttention gives them: bit for bit for self-attention, to fp32 summation order
    for cross-attention."""
    g = torch.Generator().manual_seed(hash((kind, batch_first, bias, mask)) % 2**31)
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, HEADS, bias=bias, batch_first=batch_first)
    ours = MultiheadAttention.from_torch(ref)
    assert ours.in_proj.weight is ref.in_proj_weight  # the parameters, not copies
    q, k, v = inputs(kind, batch_first, g)
    kw = {"need_weights": need_weights, "average_attn_weights": average}
    kw.update(masks(mask, L, L if kind == "self" else S, g))
    want, want_w = ref(q, k, v, **kw)
    (want * torch.linspace(-1, 1, want.numel()).view_as(want)).sum().backward()
    want_grads = [t.grad.clone() for t in (q, k, v) if t.grad is not None]
    want_grads += [p.grad.clone() for p in ref.parameters()]
    for t in (q, k, v, *ref.parameters()):
        t.grad = None
    got, got_w = ours(q, k, v, **kw)
    (got * torch.linspace(-1, 1, got.numel()).view_as(got)).sum().backward()
    got_grads = [t.grad for t in (q, k, v) if t.grad is not None]
    got_grads += [p.grad for p in ours.parameters()]
    pairs = [(got, want), *zip(got_grads, want_grads, strict=True)]
    if need_weights:
        pairs.append((got_w, want_w))
    else:
        assert got_w is None and want_w is None
    for a, b in pairs:
        assert a.shape == b.shape
        if kind == "self":
            assert torch.equal(a, b)
        else:
            scale = float(b.detach().abs().max())
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("need_weights", [True, False])
def test_unbatched_inputs(need_weights: bool) -> None:
    torch.manual_seed(1)
    ref = nn.MultiheadAttention(E, HEADS)
    ours = MultiheadAttention.from_torch(ref)
    x = torch.randn(L, E)
    padding = torch.zeros(L, dtype=torch.bool)
    padding[-1] = True
    for kw in ({}, {"key_padding_mask": padding}):
        want, want_w = ref(x, x, x, need_weights=need_weights, **kw)
        got, got_w = ours(x, x, x, need_weights=need_weights, **kw)
        assert torch.equal(got, want)
        assert (got_w is None) == (want_w is None)
        if got_w is not None:
            assert torch.equal(got_w, want_w)


def test_dropout_draws_as_torch() -> None:
    """Training with dropout: the same draws from the same generator state, so the same bits."""
    ref = nn.MultiheadAttention(E, HEADS, dropout=0.25, batch_first=True)
    ours = MultiheadAttention.from_torch(ref)
    assert ours.training and ours.dropout == 0.25
    x = torch.randn(N, L, E)
    for need_weights in (True, False):
        torch.manual_seed(5)
        want = ref(x, x, x, need_weights=need_weights)[0]
        torch.manual_seed(5)
        assert torch.equal(ours(x, x, x, need_weights=need_weights)[0], want)


def test_fp4gen_nn_names_it() -> None:
    assert fp4gen.nn.MultiheadAttention is MultiheadAttention
    module = fp4gen.nn.MultiheadAttention(E, HEADS, batch_first=True)
    x = torch.randn(N, L, E)
    out, weights = module(x, x, x)
    assert out.shape == (N, L, E) and weights.shape == (N, L, L)
    with pytest.raises(ValueError, match="not divisible"):
        fp4gen.nn.MultiheadAttention(E, 5)
    # nn.MultiheadAttention's initial values: xavier-uniform packed weight, zero biases
    ours = fp4gen.nn.MultiheadAttention(E, HEADS)
    bound = (6 / (E + 3 * E)) ** 0.5
    assert ours.in_proj_weight.abs().max() <= bound < 2 * ours.in_proj_weight.abs().max()
    assert not ours.in_proj_bias.any() and not ours.out_proj.bias.any()


def test_unsupported_modules_are_refused_with_the_reason() -> None:
    cases = [
        (nn.MultiheadAttention(E, HEADS, kdim=16, vdim=16), "separate q, k and v weights"),
        (nn.MultiheadAttention(E, HEADS, add_bias_kv=True), "add_bias_kv"),
        (nn.MultiheadAttention(E, HEADS, add_zero_attn=True), "add_zero_attn"),
    ]
    for module, reason in cases:
        assert reason in unsupported_reason(module)
        with pytest.raises(ValueError, match=reason):
            MultiheadAttention.from_torch(module)
    assert unsupported_reason(nn.MultiheadAttention(E, HEADS)) is None


def test_state_dict_keys_are_torchs() -> None:
    """The state_dict has nn.MultiheadAttention's keys; either module loads the other's."""
    ref = nn.MultiheadAttention(E, HEADS)
    ours = MultiheadAttention(E, HEADS)
    assert list(ours.state_dict()) != [] and set(ours.state_dict()) == set(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    assert torch.equal(ours.in_proj_weight, ref.in_proj_weight)
    fresh = nn.MultiheadAttention(E, HEADS)
    fresh.load_state_dict(ours.state_dict())
    assert torch.equal(fresh.out_proj.weight, ref.out_proj.weight)


def encoder(layers: int = 3, **kw) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True, **kw)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def test_convert_quantizes_the_attention_projections(caplog: pytest.LogCaptureFixture) -> None:
    """convert plans and replaces the attention's projections as linear layers: every block's
    in_proj and out_proj (but the last block's, which nvfp4_small keeps in bf16), the
    state_dict keys of the original, and a training step that reaches their weights."""
    model = encoder()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 16, 64)
    with torch.no_grad():
        high = model(x)
    with caplog.at_level(logging.WARNING, logger="fp4gen"):
        fp4gen.convert(model, "nvfp4_small", report_min_elements=1)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        assert isinstance(attn, MultiheadAttention)
        kept = i == len(model.layers) - 1
        for proj in (attn.in_proj, attn.out_proj):
            assert isinstance(proj, Linear) != kept
    names = {d.name: d for d in fp4gen.runtime.convert.layer_decisions(model)}
    assert not names["layers.0.self_attn.in_proj"].kept
    assert names["layers.2.self_attn.out_proj"].kept
    assert set(model.state_dict()) == set(before)
    report = fp4gen.runtime.convert.report(model)
    first = [p.name for p in report.kept if p.name.startswith("layers.0.self_attn")]
    assert first == ["layers.0.self_attn.in_proj.bias", "layers.0.self_attn.out_proj.bias"]
    y = model(x)
    assert y.shape == high.shape and not torch.equal(y, high)  # quantized projections
    y.square().mean().backward()
    assert model.layers[0].self_attn.in_proj_weight.grad.abs().sum() > 0
    model.load_state_dict(before)  # the original's checkpoint loads


def test_eval_runs_the_converted_projections() -> None:
    """Eval mode without grad runs the module's own forward (torch's fused encoder path, which
    reads in_proj_weight itself, is closed), so it gives the training forward's bits."""
    model = encoder()
    fp4gen.convert(model, "nvfp4_small")
    x = torch.randn(2, 16, 64)
    fp4gen.set_step(model, 0, total_steps=10)
    train_y = model(x).detach()
    model.eval()
    with torch.no_grad():
        eval_y = model(x)
    assert not model.layers[0].activation_relu_or_gelu
    assert torch.equal(eval_y, train_y)


def test_unsupported_attention_is_reported() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.MultiheadAttention(64, 4, kdim=32, vdim=32), nn.Linear(64, 64))
    fp4gen.convert(model, "nvfp4_small", report_min_elements=1)
    assert type(model[0]) is nn.MultiheadAttention
    reasons = {p.name: p.reason for p in fp4gen.runtime.convert.report(model).kept}
    assert "separate q, k and v weights" in reasons["0.q_proj_weight"]
    assert "output projection of a MultiheadAttention" in reasons["0.out_proj.weight"]


def test_a_refused_conversion_puts_the_attention_back(monkeypatch: pytest.MonkeyPatch) -> None:
    model = encoder(2)
    originals = [layer.self_attn for layer in model.layers]

    def refuse(self: Linear) -> None:
        raise FP4GenError("refused for the test")

    monkeypatch.setattr(Linear, "check_supported", refuse)
    with pytest.raises(FP4GenError, match="refused for the test"):
        fp4gen.convert(model, "nvfp4_small")
    assert [layer.self_attn for layer in model.layers] == originals
    assert not hasattr(model, "_fp4gen_conversion")
    assert convert_module.MultiheadAttention is MultiheadAttention


def test_a_second_convert_changes_nothing() -> None:
    model = encoder(2)
    fp4gen.convert(model, "nvfp4_small")
    attn = model.layers[0].self_attn
    fp4gen.convert(model, "nvfp4_small")
    assert model.layers[0].self_attn is attn


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_converted_encoder_layer_has_no_graph_breaks(autocast: bool) -> None:
    """torch.compile traces a converted nn.TransformerEncoderLayer whole: its attention's two
    projections and the feed-forward's two layers are four calls of the forward op."""
    model = encoder(2)
    fp4gen.convert(model, "nvfp4_small", total_steps=10)
    layer = model.layers[0]
    x = torch.randn(2, 16, 64, requires_grad=True)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        found = torch._dynamo.explain(layer)(x)
    reasons = [str(r.reason).splitlines()[0] for r in found.break_reasons]
    assert (found.graph_break_count, reasons) == (0, [])
    ops = [n for g in found.graphs for n in g.graph.nodes if "linear_forward" in str(n.target)]
    assert len(ops) == 4


@pytest.mark.parametrize("precision", ["bf16", "fp32 autocast"])
def test_a_converted_encoder_trains_in_bf16_and_under_autocast(precision: str) -> None:
    """A bf16 model, and an fp32 one under bf16 autocast: finite steps that reach every
    attention weight; a deep copy (an EMA model) keeps torch's state_dict keys."""
    import copy

    model = encoder(2)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    fp4gen.convert(model, "nvfp4_small", total_steps=4)
    x = torch.randn(2, 16, 64, dtype=next(model.parameters()).dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(2):
        fp4gen.set_step(model, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != "bf16"):
            loss = model(x).float().square().mean()
        opt.zero_grad()
        loss.backward()
        assert torch.isfinite(loss)
        for layer in model.layers:
            for name in ("in_proj_weight", "out_proj.weight"):
                grad = layer.self_attn.get_parameter(name.replace("_weight", ".weight")).grad
                assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
        opt.step()
    twin = copy.deepcopy(model)
    assert set(twin.state_dict()) == set(model.state_dict())
    assert "layers.0.self_attn.in_proj_weight" in twin.state_dict()


def test_export_writes_the_input_projection_quantized(tmp_path) -> None:
    """fp4gen's export writes each converted projection under its module's name, the input
    projection quantized like the others (its state_dict key is torch's in_proj_weight, which
    export reads back as in_proj.weight); the import loads into the converted model."""
    model = encoder(3)
    fp4gen.convert(model, "nvfp4_small")
    report = fp4gen.export_quantized(model, tmp_path / "out")
    assert report.quantized["layers.0.self_attn.in_proj"] == "NVFP4"
    assert report.quantized["layers.0.self_attn.out_proj"] == "NVFP4"
    assert "layers.2.self_attn.in_proj" in report.excluded  # the block nvfp4_small keeps
    state, _ = fp4gen.import_quantized(tmp_path / "out")
    assert "layers.0.self_attn.in_proj.weight" in state
    model.load_state_dict(state)  # strict: every key of the converted model

"""What a training forward of fp4gen.nn.Linear saves for its backward (fp4gen.runtime.ops): x's
wgrad copy Q(x^T; wgrad.activation), quantized in the forward, instead of x itself, where the
recipe rounds that copy to nearest. The backward then computes the same bits as one that
quantizes the copy from a saved x (``keep_quantized_input = False``), and holds a fraction of
the memory."""

from __future__ import annotations

import pytest
import torch
from device_params import CPU_AND_CUDA
from torch.utils.checkpoint import checkpoint

import fp4gen
from fp4gen.dsl import load_recipe, parse_recipe
from fp4gen.numerics import QuantizedTensor, quantize
from fp4gen.numerics.layout import pack
from fp4gen.numerics.quantize import PackedCodes
from fp4gen.runtime.linear import _last_copy

KEPT = ["nvfp4_small", "nvfp4_no_sr", "mxfp4_small", "mxfp8", "fp8_blockwise", "nvfp4"]
# the wgrad copy of x drawn from the backward call's random stream: x itself is saved
SR_WGRAD_X = parse_recipe("operands {\n * : nvfp4\n wgrad.activation : round stochastic\n}\n")


def _layer(recipe, keep: bool, in_f: int = 64, out_f: int = 48) -> fp4gen.nn.Linear:
    torch.manual_seed(0)
    layer = fp4gen.nn.Linear(in_f, out_f, recipe=recipe, seed=5, name="l")
    layer.keep_quantized_input = keep
    return layer


def _steps(layer: fp4gen.nn.Linear, batches, checkpointed: bool = False):
    """Forward + backward per batch with an SGD update in between; every result."""
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    out = []
    for x, dy in batches:
        x = x.clone().requires_grad_(True)
        y = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
        y.backward(dy)
        out.append((y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def _batches(tokens: tuple[int, ...], in_f: int = 64, out_f: int = 48):
    gen = torch.Generator().manual_seed(2)
    return [
        (torch.randn(t, in_f, generator=gen), torch.randn(t, out_f, generator=gen)) for t in tokens
    ]


def _assert_same(a, b) -> None:
    for step_a, step_b in zip(a, b, strict=True):
        for name, u, v in zip(("y", "dx", "dW", "db"), step_a, step_b, strict=True):
            assert torch.equal(u, v), name


DEVICES = CPU_AND_CUDA


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", KEPT)
def test_the_kept_copy_gives_the_bits_of_a_saved_x(name: str, device: str) -> None:
    """Steps of token counts that need padding of the wgrad K (7, 1) and one that does not,
    each three times (on CUDA the layer graphs capture and replay the kept copy's pieces):
    outputs and gradients equal bit for bit whether the forward keeps x's wgrad copy or the
    backward quantizes it from x."""
    recipe = load_recipe(f"{name}.fp4r")
    batches = [(x.to(device), dy.to(device)) for x, dy in _batches((32, 32, 32, 7, 7, 7, 1))]
    kept, saved = _layer(recipe, True).to(device), _layer(recipe, False).to(device)
    assert kept.keeps_wgrad_input(kept.operands)
    _assert_same(_steps(kept, batches), _steps(saved, batches))


def _saved_tensors(layer: fp4gen.nn.Linear, x: torch.Tensor) -> list[torch.Tensor]:
    """The tensors autograd saves for one forward of ``layer`` on ``x``."""
    saved: list[torch.Tensor] = []

    def pack_hook(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        layer(x.requires_grad_(True))
    return saved


# bytes of the saved NVFP4 copy of n values: on CUDA the kernels' output (E4M3 scale codes,
# the global scale, packed 4-bit codes), which a layer graph's call (from the first one, the
# warm-up) hands over packed in one buffer, each piece at a 16-byte boundary (ops.Packing); on
# a CPU the reference's pieces, which also hold unpacked codes and fp32 scales
COPY_BYTES = {
    "cuda": lambda n: -(-(n // 16) // 16) * 16 + 16 + n // 2,
    "cpu": lambda n: n + n // 16 * 4 + n // 16 + 4,
}


@pytest.mark.parametrize("device", DEVICES)
def test_a_training_forward_saves_the_quantized_copy_not_x(device: str) -> None:
    """NVFP4 (1x16 blocks, E4M3 scales), bf16 x [256, 64]: the forward saves the weight and
    x's wgrad copy, not x. On CUDA the copy is the kernels' packed codes, a scale byte per 16
    values and the global scale, in one buffer: 0.28x x's bytes. With keep_quantized_input
    off, x is saved."""
    recipe = load_recipe("nvfp4_small.fp4r")
    x = torch.randn(256, 64, dtype=torch.bfloat16, device=device)
    layer = _layer(recipe, True).to(device=device, dtype=torch.bfloat16)
    saved = _saved_tensors(layer, x.clone())
    weight = [t for t in saved if t.shape == layer.weight.shape]
    others = [t for t in saved if t.shape != layer.weight.shape]
    assert len(weight) == 1 and not any(t.dtype == torch.bfloat16 for t in others)
    copy_bytes = sum(t.numel() * t.element_size() for t in others)
    assert copy_bytes == COPY_BYTES[device](x.numel())
    if device == "cuda":
        assert len(others) == 1 and others[0].dtype == torch.uint8  # packed
    if device == "cuda":
        assert copy_bytes / (x.numel() * x.element_size()) < 0.29
    layer.keep_quantized_input = False
    saved = _saved_tensors(layer, x.clone())
    assert [tuple(t.shape) for t in saved] == [(256, 64), tuple(layer.weight.shape)]


@pytest.mark.parametrize("case", ["stochastic", "frozen weight", "no_grad"])
def test_x_is_saved_where_the_copy_cannot_be_kept(case: str) -> None:
    """A stochastically rounded wgrad copy (its random stream is the backward call's) and a
    frozen weight (no dW) keep x; under no_grad nothing is quantized for a backward."""
    recipe = SR_WGRAD_X if case == "stochastic" else load_recipe("nvfp4_small.fp4r")
    layer = _layer(recipe, True)
    x = torch.randn(32, 64)
    if case == "frozen weight":
        layer.weight.requires_grad_(False)
    if case == "no_grad":
        calls = []
        real = layer.wgrad_activation
        layer.wgrad_activation = lambda *a: calls.append(a) or real(*a)  # type: ignore[method-assign]
        with torch.no_grad():
            layer(x)
        assert calls == []
        return
    saved = _saved_tensors(layer, x.clone())
    assert any(t.shape == (32, 64) and t.dtype == torch.float32 for t in saved)


def test_activation_checkpointing_with_a_kept_copy() -> None:
    """torch.utils.checkpoint (non-reentrant) recomputes the forward, kept copy included: the
    same bits as without checkpointing."""
    recipe = load_recipe("nvfp4_no_sr.fp4r")
    batches = _batches((32, 7))
    _assert_same(
        _steps(_layer(recipe, True), batches, checkpointed=True),
        _steps(_layer(recipe, True), batches),
    )


def test_split_and_join_give_back_the_same_tensor() -> None:
    """QuantizedTensor.split / join (the saved pieces): the same tensors, not copies, for the
    reference's output and for a kernel's (packed codes, scale codes, the rest derived)."""
    fmt = fp4gen.formats.BUILTIN_FORMATS["nvfp4"]
    q = quantize(torch.randn(32, 64), fmt)
    tensors, layout = q.split()
    back = QuantizedTensor.join(tensors, layout)
    assert back.codes is q.codes and back.scales is q.scales
    assert back.global_scale is q.global_scale and back.format == q.format
    assert hash(layout) == hash(back.split()[1])

    like_kernel = QuantizedTensor(
        codes=None,
        scales=None,
        scale_codes=q.scale_codes,
        global_scale=q.global_scale,
        format=q.format,
        rounding=q.rounding,
        rht=q.rht,
        seed=q.seed,
        offset=q.offset,
        shape=q.shape,
        dtype=q.dtype,
        packed=PackedCodes(pack(q.codes, 4), 64, 4),
    )
    tensors, layout = like_kernel.split()
    assert tensors[0] is None and tensors[1] is None  # nothing materialized by split
    back = QuantizedTensor.join(tensors, layout)
    assert back.packed_codes() is not None and torch.equal(back.codes, q.codes)
    assert torch.equal(back.dequantize(), q.dequantize())


def test_layers_reading_the_same_x_share_one_copy(monkeypatch) -> None:
    """Three layers on one x (a Llama's q, k and v): the wgrad copy is quantized once and the
    three backward passes read that one tensor; an in-place write to x between two layers, or
    a different x, makes a new copy. Outputs and gradients equal three layers that each save x."""
    recipe = load_recipe("nvfp4_small.fp4r")

    def run(keep: bool, x: torch.Tensor, bump: bool = False) -> list[torch.Tensor]:
        layers = [_layer(recipe, keep, 64, 32) for _ in range(3)]
        x = x.clone().requires_grad_(True)
        h = x * 1.0  # a non-leaf: the layers' x2 are views of it, as a norm's output would be
        ys = []
        for i, layer in enumerate(layers):
            if bump and i == 2:
                with torch.no_grad():
                    h.mul_(1.0)  # the same values, a new version: must not reuse the copy
            ys.append(layer(h.reshape(4, 8, 64)))
        sum((y * (i + 1)).sum() for i, y in enumerate(ys)).backward()
        assert _last_copy.copy is None  # dropped by the backward: it does not outlive training
        return [y.detach() for y in ys] + [x.grad] + [layer.weight.grad for layer in layers]

    copies = []
    real = fp4gen.nn.Linear.wgrad_activation

    def counting(self, *args, **kw):
        copies.append(real(self, *args, **kw))
        return copies[-1]

    monkeypatch.setattr(fp4gen.nn.Linear, "wgrad_activation", counting)
    x = torch.randn(32, 64)
    shared = run(True, x)
    assert len(copies) == 1
    run(True, x, bump=True)
    assert len(copies) == 3
    run(True, x + 1)
    assert len(copies) == 4
    separate = run(False, x)
    assert len(copies) == 7  # each layer's backward quantizes its own
    for a, b in zip(shared, separate, strict=True):
        assert torch.equal(a, b)

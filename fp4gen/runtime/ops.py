"""The torch custom ops behind fp4gen.nn.Linear, opaque to torch.compile.

``fp4gen::linear_forward`` and ``fp4gen::linear_backward`` run a layer's quantize + GEMM steps;
their fake implementations give torch.compile the output shapes without running them, so a
compiled model keeps the exact numerics of eager mode. A layer is named by an integer id (custom
ops take tensors and plain values, not modules).

In eager mode ``linear`` calls the same layer methods through a plain autograd.Function
(``_EagerLinear``) instead: the custom-op machinery (schema dispatch, argument defaults,
aliasing checks, the autograd wrapper around it) costs tens of microseconds of host time per
call, which only torch.compile needs. Both routes run the same code, so their results are
identical bit for bit.

What is saved for the backward: the custom op saves x and W. The eager route, when the weight
needs a gradient and the layer allows it (``Linear.keeps_wgrad_input``), saves x's wgrad copy
instead, Q(x^T; wgrad.activation) quantized in the forward (``WgradInput``: its tensors go
through ``save_for_backward``, so activation checkpointing and saved-tensor hooks see them):
4.5 bits per value for NVFP4 instead of x's 16, the way Transformer Engine saves its inputs.
The copy is the one the backward would quantize (round-to-nearest only, so no random stream
depends on when it is made): the same bits either way.

Under torch.compile each op runs one layer, and whether two ops read one x cannot be decided
when they run: inductor writes a later tensor into a buffer it reuses, the same Python object at
the same address, without bumping its version counter. The graph decides it: an inductor pass
merges the ops that read one x into one op whose layers share x's fprop operand and wgrad copy
(``fp4gen.runtime.compile_sharing``).

The ops' schemas are written out (``_LIBRARY.define``), with one kernel each, a fake kernel
and the forward's autograd formula registered through ``torch.library``.
"""

import contextlib
import itertools
import weakref
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from fp4gen.errors import FP4GenError
from fp4gen.gemm_dispatch import fp8_semantics_setting
from fp4gen.numerics import QuantizedTensor
from fp4gen.numerics.quantize import QuantizedLayout
from fp4gen.runtime import finite

_layers: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_ids = itertools.count()


PIECE_ALIGNMENT = 16  # bytes: where each piece starts in a packed buffer (the kernels' loads)


@dataclass(frozen=True)
class Packing:
    """Where the pieces of a wgrad copy lie in one byte buffer: (byte offset, shape, dtype) per
    piece, or None where a piece is absent. A layer graph's forward writes the copy packed,
    so that a call makes one result tensor for it instead of one per piece (an allocation
    costs the host more than the piece's copy costs the GPU), and autograd saves one tensor."""

    pieces: tuple[tuple[int, torch.Size, torch.dtype] | None, ...]
    nbytes: int

    @classmethod
    def of(cls, tensors: tuple[torch.Tensor | None, ...]) -> "Packing | None":
        """The packing of ``tensors``, or None where one is not contiguous (then they stay
        apart: a packed piece is read back contiguous)."""
        pieces: list[tuple[int, torch.Size, torch.dtype] | None] = []
        end = 0
        for t in tensors:
            if t is None:
                pieces.append(None)
                continue
            if not t.is_contiguous():
                return None
            start = -(-end // PIECE_ALIGNMENT) * PIECE_ALIGNMENT
            pieces.append((start, t.shape, t.dtype))
            end = start + t.numel() * t.element_size()
        return cls(tuple(pieces), end)

    def pack(
        self, tensors: tuple[torch.Tensor | None, ...], into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The pieces copied into ``into`` (a uint8 tensor of ``nbytes``; made where None)."""
        if into is None:
            into = torch.empty(self.nbytes, dtype=torch.uint8, device=_device_of(tensors))
        for view, t in zip(self.unpack(into), tensors, strict=True):
            if view is not None:
                view.copy_(t)
        return into

    def unpack(self, buffer: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The pieces as views of ``buffer`` (nothing copied)."""
        views: list[torch.Tensor | None] = []
        for piece in self.pieces:
            if piece is None:
                views.append(None)
                continue
            start, shape, dtype = piece
            nbytes = shape.numel() * dtype.itemsize
            views.append(buffer[start : start + nbytes].view(dtype).view(shape))
        return tuple(views)


def graph_pieces(
    copy: QuantizedTensor, into: torch.Tensor | None = None, pack: bool = True
) -> tuple[tuple[torch.Tensor | None, ...], tuple[QuantizedLayout, Packing | None]]:
    """A wgrad copy as a layer graph returns it (graph results are tensors): its pieces, packed
    into one buffer (``into`` where given) where ``pack`` and they allow it, and what puts them
    back together (layout, packing)."""
    tensors, layout = copy.split()
    packing = Packing.of(tensors) if pack else None
    if packing is None:
        return tensors, (layout, None)
    return (packing.pack(tensors, into),), (layout, packing)


def _device_of(tensors: tuple[torch.Tensor | None, ...]) -> torch.device:
    return next(t.device for t in tensors if t is not None)


@dataclass(frozen=True, eq=False)  # compared by identity: it holds tensors
class WgradInput:
    """What the backward needs of x when its wgrad copy was quantized in the forward:
    Q(x^T; wgrad.activation) (tokens zero-padded as the wgrad GEMM needs) and x's dtype (dx's).

    Held as ``QuantizedTensor.split`` gives it (its tensors and layout), or, from a layer
    graph, those tensors packed into one (``packing``): what ``save_for_backward`` and a layer
    graph take, so a graphed layer passes the copy from its forward graph to its backward graph
    without putting it together in between."""

    tensors: tuple[torch.Tensor | None, ...]
    layout: QuantizedLayout
    dtype: torch.dtype
    packing: Packing | None = None  # where set, ``tensors`` is the one packed buffer

    @cached_property
    def present(self) -> tuple[bool, ...]:
        """Which of ``tensors`` are there (a layer graph's key names it)."""
        return tuple([t is not None for t in self.tensors])

    @property
    def given(self) -> tuple[torch.Tensor, ...]:
        """The tensors that are there, in order: what a layer graph takes as activations."""
        return tuple([t for t in self.tensors if t is not None])

    def with_given(self, given: "tuple[torch.Tensor, ...]") -> "WgradInput":
        """This copy on other tensors (a graph's inputs): ``given`` in place of the tensors
        that are there, in order."""
        found = iter(given)
        tensors = tuple(next(found) if p else None for p in self.present)
        return WgradInput(tensors, self.layout, self.dtype, self.packing)

    @classmethod
    def of(cls, quantized: QuantizedTensor, dtype: torch.dtype) -> "WgradInput":
        tensors, layout = quantized.split()
        return cls(tensors, layout, dtype)

    @cached_property
    def quantized(self) -> QuantizedTensor:
        """The copy as a QuantizedTensor (put together on first use)."""
        tensors = self.tensors
        if self.packing is not None:
            tensors = self.packing.unpack(tensors[0])  # type: ignore[arg-type]
        return QuantizedTensor.join(tensors, self.layout)


# The layers keep their id in ``_op_id``. torch.compile specializes an nn.Module's int
# attributes: every layer's id would be a constant of its graph, so the blocks of a model
# compiled block by block (as torchtitan compiles them) would each compile once more, and with
# fullgraph=True the ninth block fails on dynamo's recompile limit. Listed as a dynamic source
# (this pattern only), the id is a graph input: one graph serves every block of one shape.
OP_ID_SOURCE = r".*\._op_id$"


def _op_ids_dynamic() -> None:
    """Add ``OP_ID_SOURCE`` to ``torch.compiler.config.dynamic_sources`` (kept as the user set
    it otherwise). torch reads its patterns from 2.8 on; an older torch recompiles per block
    (docs/integrations.md)."""
    config = getattr(torch.compiler, "config", None)
    current = getattr(config, "dynamic_sources", None)
    if not isinstance(current, str):
        return
    entries = [e.strip() for e in current.split(",") if e.strip()]
    if OP_ID_SOURCE not in entries:
        config.dynamic_sources = ",".join([*entries, OP_ID_SOURCE])  # type: ignore[union-attr]


def register(layer: Any) -> int:
    """Give a layer an id the ops can find it by (held weakly)."""
    _op_ids_dynamic()
    layer_id = next(_ids)
    _layers[layer_id] = layer
    return layer_id


def _layer(layer_id: int) -> Any:
    layer = _layers.get(layer_id)
    if layer is None:
        raise RuntimeError(f"fp4gen layer {layer_id} no longer exists")
    return layer


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the row-major strides the fake kernels declare. A GEMM result sliced from a
    padded one can be contiguous with another stride on a size-1 dimension ([1, 8] with stride
    (16, 1)): that stride is re-stated (a view, no copy), as the compiler compares strides."""
    if t.dim() == 2:  # the ops' results: checked without building the strides (per call)
        rows, cols = t.shape
        want: tuple[int, ...] = (cols if cols > 1 else 1, 1)
    else:
        strides, step = [], 1
        for size in reversed(t.shape):
            strides.append(step)
            step *= max(size, 1)
        want = tuple(reversed(strides))
    if t.stride() == want:
        return t
    return t.as_strided(t.shape, want) if t.is_contiguous() else t.contiguous()


# The two ops are defined with torch.library's low-level API (schema, one
# CompositeExplicitAutograd kernel, a fake kernel and the forward's autograd formula) rather
# than ``torch.library.custom_op``, whose Python wrappers (its backend wrapper, the
# dynamo-disable decorator, the runtime aliasing check of every output, an autograd wrapper for
# the backward op too) ran on every layer call of a compiled model: measured with a stub layer
# on a 2-core host, a forward call 17-18 us against 14 us here and a backward call 23-25 us
# against 15 us (docs/integrations.md). The ops return fresh tensors and mutate nothing, as
# their schemas say.
_LIBRARY = torch.library.Library("fp4gen", "FRAGMENT")  # FRAGMENT: other modules may add ops
_FORWARD_SCHEMA = (
    "(Tensor x2, Tensor weight, Tensor? bias, SymInt layer_id, ScalarType out_dtype) -> Tensor"
)
_BACKWARD_SCHEMA = "(Tensor dy2, Tensor x2, Tensor weight, SymInt layer_id) -> (Tensor, Tensor)"
_LIBRARY.define("linear_forward" + _FORWARD_SCHEMA)
_LIBRARY.define("linear_backward" + _BACKWARD_SCHEMA)

# The same two ops for layers whose quantization reads the device on the host (a Mixture-of-
# Representations rule chooses each block's format from its values), tagged cudagraph_unsafe:
# inductor's CUDA graphs (mode "reduce-overhead") run them between the graphs' replays instead
# of capturing them, where a capture would refuse the read (and MoR raises inside one).
_CUDAGRAPH_UNSAFE = tuple(
    tag for tag in (getattr(torch.Tag, "cudagraph_unsafe", None),) if tag is not None
)
_LIBRARY.define("linear_forward_uncaptured" + _FORWARD_SCHEMA, tags=_CUDAGRAPH_UNSAFE)
_LIBRARY.define("linear_backward_uncaptured" + _BACKWARD_SCHEMA, tags=_CUDAGRAPH_UNSAFE)


def _linear_forward(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    layer_id: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """y = Q(x) @ Q(W)^T (+ bias), computed in fp32 and rounded once to ``out_dtype``, for x2
    [tokens, in] and weight [out, in]."""
    layer = _layer(layer_id)
    with finite.layer_scope():  # non-finite inputs: propagated as NaN, or raised at the end
        check_given_inputs(layer.name, x2, weight)
        y = layer.forward_gemm(x2, weight, bias, out_dtype)[0]
        return row_major(y)


@torch.library.register_fake("fp4gen::linear_forward", lib=_LIBRARY)
@torch.library.register_fake("fp4gen::linear_forward_uncaptured", lib=_LIBRARY)
def _(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    layer_id: int,
    out_dtype: torch.dtype,
):
    _install_sharing()
    return x2.new_empty((x2.shape[0], weight.shape[0]), dtype=out_dtype)


def _linear_backward(
    dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, layer_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [tokens, in] in x2's dtype, dW [out, in] in the weight's) from dy2 [tokens, out]."""
    layer = _layer(layer_id)
    with finite.layer_scope():
        check_output_grad(layer.name, dy2)
        dx, dw = layer.backward_gemms(dy2, x2, weight)
        return row_major(dx), row_major(dw)


_LIBRARY.impl("linear_forward", _linear_forward, "CompositeExplicitAutograd")
_LIBRARY.impl("linear_backward", _linear_backward, "CompositeExplicitAutograd")
linear_forward = torch.ops.fp4gen.linear_forward.default
linear_backward = torch.ops.fp4gen.linear_backward.default

_LIBRARY.impl("linear_forward_uncaptured", _linear_forward, "CompositeExplicitAutograd")
_LIBRARY.impl("linear_backward_uncaptured", _linear_backward, "CompositeExplicitAutograd")
linear_forward_uncaptured = torch.ops.fp4gen.linear_forward_uncaptured.default
linear_backward_uncaptured = torch.ops.fp4gen.linear_backward_uncaptured.default


# The group ops that fp4gen.runtime.compile_sharing's inductor pass puts in place of the ops
# that read one x: each runs its layers as their own ops would, sharing x's copies among them
_LIBRARY.define(
    "linear_forward_group(Tensor x2, Tensor[] weights, Tensor?[] biases, SymInt[] layer_ids, "
    "ScalarType out_dtype) -> Tensor[]"
)
_LIBRARY.define(
    "linear_backward_group(Tensor[] dys, Tensor x2, Tensor[] weights, SymInt[] layer_ids) "
    "-> Tensor[]"
)


def _linear_forward_group(
    x2: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    layer_ids: list[int],
    out_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Each layer's y = Q(x) @ Q(W)^T (+ bias), as ``fp4gen::linear_forward`` computes it, the
    layers in order; x's fprop operand made once per ``fprop_input_key`` where it is shared."""
    copies: dict[Any, Any] = {}  # this call's: dies with it
    ys = []
    with finite.layer_scope():
        for weight, bias, layer_id in zip(weights, biases, layer_ids, strict=True):
            layer = _layer(layer_id)
            check_given_inputs(layer.name, x2, weight)
            y = layer.forward_gemm(x2, weight, bias, out_dtype, fprop_copies=copies)[0]
            ys.append(row_major(y))
    return ys


def _linear_backward_group(
    dys: list[torch.Tensor],
    x2: torch.Tensor,
    weights: list[torch.Tensor],
    layer_ids: list[int],
) -> list[torch.Tensor]:
    """[dx, dW] of each layer in order, as ``fp4gen::linear_backward`` computes them; x's wgrad
    copy made once per copy key (``Linear._copy_key``) where the layer keeps one."""
    copies: dict[Any, WgradInput] = {}  # this call's: dies with it
    out: list[torch.Tensor] = []
    with finite.layer_scope():
        for dy, weight, layer_id in zip(dys, weights, layer_ids, strict=True):
            layer = _layer(layer_id)
            check_output_grad(layer.name, dy)
            table = layer.operands
            x: torch.Tensor | WgradInput = x2
            if layer.keeps_wgrad_input(table):
                key = layer._copy_key(table)
                x = copies.get(key)  # type: ignore[assignment]
                if x is None:
                    made = layer.wgrad_activation(x2, table, layer._backward_calls)
                    x = copies[key] = WgradInput.of(made, x2.dtype)
            dx, dw = layer.backward_gemms(dy, x, weight, table=table)
            out += [row_major(dx), row_major(dw)]
    return out


_LIBRARY.impl("linear_forward_group", _linear_forward_group, "CompositeExplicitAutograd")
_LIBRARY.impl("linear_backward_group", _linear_backward_group, "CompositeExplicitAutograd")
linear_forward_group = torch.ops.fp4gen.linear_forward_group.default
linear_backward_group = torch.ops.fp4gen.linear_backward_group.default


@torch.library.register_fake("fp4gen::linear_forward_group", lib=_LIBRARY)
def _(x2, weights, biases, layer_ids, out_dtype):
    return [x2.new_empty((x2.shape[0], w.shape[0]), dtype=out_dtype) for w in weights]


@torch.library.register_fake("fp4gen::linear_backward_group", lib=_LIBRARY)
def _(dys, x2, weights, layer_ids):
    out = []
    for w in weights:
        out += [x2.new_empty(x2.shape), w.new_empty(w.shape)]
    return out


@torch.library.register_fake("fp4gen::linear_backward", lib=_LIBRARY)
@torch.library.register_fake("fp4gen::linear_backward_uncaptured", lib=_LIBRARY)
def _(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, layer_id: int):
    _install_sharing()
    return x2.new_empty(x2.shape), weight.new_empty(weight.shape)


def _install_sharing() -> None:
    """The compile pass that merges the ops reading one x, so that they share its quantized
    copies (``fp4gen.runtime.compile_sharing``): put in place while torch.compile traces."""
    from fp4gen.runtime import compile_sharing  # inductor's modules: imported when compiling

    compile_sharing.install()


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x2, weight, bias, layer_id, _ = inputs
    ctx.save_for_backward(x2, weight)
    ctx.layer_id = layer_id
    ctx.bias_dtype = None if bias is None else bias.dtype


def double_backward_error(name: str) -> FP4GenError:
    """The error of a backward run with create_graph=True (grad mode is on in a backward only
    then, so the backwards check ``torch.is_grad_enabled()``): the GEMMs' gradients are
    computed from quantized operands by opaque kernels and have no graph of their own, so
    gradients of gradients would silently come out zero."""
    return FP4GenError(
        f"{name or 'fp4gen.nn.Linear'}: a backward with create_graph=True (double backward, "
        "gradients of gradients) is not supported through fp4gen's quantized GEMMs; keep the "
        "layers it differentiates twice in torch.nn.Linear"
    )


def _backward_with(op: Any) -> Any:
    """The forward op's autograd formula, its gradients from the backward op ``op``."""

    def backward(ctx: Any, dy: torch.Tensor):
        if torch.is_grad_enabled():
            raise double_backward_error(_layer(ctx.layer_id).name)
        x2, weight = ctx.saved_tensors
        dx, dw = op(dy.contiguous(), x2, weight, ctx.layer_id)
        return dx, dw, bias_grad(dy, ctx.bias_dtype), None, None

    return backward


def bias_grad(dy: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor | None:
    """The bias gradient (None without a bias): the sum accumulates in fp32 without an fp32
    copy of dy."""
    return None if dtype is None else dy.sum(0, dtype=torch.float32).to(dtype)


torch.library.register_autograd(
    "fp4gen::linear_forward",
    _backward_with(linear_backward),
    setup_context=_setup_context,
    lib=_LIBRARY,
)
torch.library.register_autograd(
    "fp4gen::linear_forward_uncaptured",
    _backward_with(linear_backward_uncaptured),
    setup_context=_setup_context,
    lib=_LIBRARY,
)


def context_key() -> tuple[bool, torch.dtype, str]:
    """What a pass depends on besides its tensors and recipe: autocast, and the process-wide
    FP8 GEMM semantics (a graph captured under one must not replay under the other)."""
    return (
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
        fp8_semantics_setting(),
    )


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of a layer's output for input ``x``: autocast's where it is on, else x's."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def profiled(name: str) -> Any:
    """A profiler range named as the custom op (so profiles read the same either way), only
    while torch's profiler runs: a record_function costs host time on every call."""
    if getattr(torch.autograd.profiler, "_is_profiler_enabled", False):
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class _EagerLinear(torch.autograd.Function):
    """linear_forward and its backward without the custom-op dispatch (eager mode)."""

    @staticmethod
    def forward(ctx: Any, x2, weight, bias, layer_id, out_dtype, grad_mode, shape):  # type: ignore[override]
        layer = _layer(layer_id)
        # dW needs x: its wgrad copy may be kept instead. ``grad_mode``: the caller's (forward
        # runs with grad off, and needs_input_grad follows requires_grad even under no_grad)
        wants_dw = grad_mode and ctx.needs_input_grad[1]
        ctx.forward_call = layer.next_forward_call()  # the call forward_gemm makes
        with profiled("fp4gen::linear_forward"), finite.layer_scope():
            y, kept = layer.forward_gemm(x2, weight, bias, out_dtype, keep_wgrad_input=wants_dw)
        if kept is None:
            ctx.save_for_backward(x2, weight)
            ctx.kept = None
        else:
            ctx.save_for_backward(weight, *kept.tensors)
            ctx.kept = (kept.layout, kept.dtype, kept.packing)
        ctx.layer_id = layer_id
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.out_shape = (*shape[:-1], y.shape[1])  # y as the caller gets it (messages name it)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        if torch.is_grad_enabled():
            raise double_backward_error(_layer(ctx.layer_id).name)
        if ctx.kept is None:
            x, weight = ctx.saved_tensors
        else:
            weight, *tensors = ctx.saved_tensors
            x = WgradInput(tuple(tensors), *ctx.kept)
        layer = _layer(ctx.layer_id)
        with profiled("fp4gen::linear_backward"), finite.layer_scope():
            check_output_grad(layer.name, dy, ctx.out_shape)
            dx, dw = layer.backward_gemms(dy.contiguous(), x, weight, forward_call=ctx.forward_call)
        return dx, dw, bias_grad(dy, ctx.bias_dtype), None, None, None, None


def linear(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    layer_id: int,
    out_dtype: torch.dtype,
    shape: tuple[int, ...] | None = None,
    capturable: bool = True,
) -> torch.Tensor:
    """y = Q(x) @ Q(W)^T (+ bias) with its backward: the custom op while torch.compile traces,
    the eager autograd.Function otherwise (module docstring). ``shape``: x's shape as the
    caller gave it (x2 is its 2-D view), which an error about y's gradient names.
    ``capturable``: False for a layer whose quantization reads the device on the host (MoR),
    compiled as the ops that inductor's CUDA graphs leave out."""
    if torch.compiler.is_compiling():
        op = linear_forward if capturable else linear_forward_uncaptured
        return op(x2, weight, bias, layer_id, out_dtype)
    shape = tuple(x2.shape) if shape is None else shape
    return _EagerLinear.apply(x2, weight, bias, layer_id, out_dtype, torch.is_grad_enabled(), shape)


def check_given_inputs(name: str, x2: torch.Tensor, weight: torch.Tensor) -> None:
    """Where the layer's scope checks its given tensors (``FP4GEN_CHECK_FINITE=raise``), x as
    [tokens, in] and the weight, named as the caller gave them; asked once for both (the
    propagating default: no check)."""
    if finite.checks_given():
        label = name or "fp4gen.nn.Linear"
        finite.check_given(x2, "{}: the input (as [tokens, in]) of shape {}", label, x2.shape)
        finite.check_given(weight, "{}: the weight of shape {}", label, weight.shape)


def check_output_grad(name: str, dy: torch.Tensor, shape: tuple[int, ...] | None = None) -> None:
    """The check of a layer's output gradient in a call that raises for non-finite values
    (``finite.check_given``), naming the layer and the gradient's shape (``shape``: y's as the
    caller got it, where dy is its 2-D view)."""
    if not finite.checks_given():
        return
    dy = dy if shape is None else dy.view(shape)
    what = "{}: the gradient of its output, of shape {}"
    finite.check_given(dy, what, name or "fp4gen.nn.Linear", dy.shape)

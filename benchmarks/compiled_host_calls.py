"""The host work of a converted model's training step, counted: Python function calls and torch
operations dispatched, per Linear forward + backward, compiled block by block and eager.

A compiled step runs every converted ``Linear`` as two custom ops (``fp4gen::linear_forward``,
``fp4gen::linear_backward``: ``fp4gen.runtime.ops``) whose bodies call the layer's eager
machinery; wall-clock host time moves with the host and its load, so this counts instead, which
transfers from a CPU to a GPU host:

- fp4gen's calls: function calls (Python and C, what cProfile counts as its total) inside the
  op bodies (``ops._linear_forward`` / ``_linear_backward``; eagerly ``_EagerLinear.forward`` /
  ``backward``), down to the entry of the numerics (``quantize_dispatch.quantize`` /
  ``mor_quantize``, ``gemm_dispatch.gemm``: counted as one call each, their inner work not,
  since the CPU runs the slow reference where a GPU launches a kernel);
- fp4gen's torch operations: aten operations dispatched inside the op bodies, the numerics
  left out the same way (a ``TorchDispatchMode``);
- the step's calls and operations: everything between the step's start and its optimizer-free
  end (model, dynamo's guards and frames, autograd, the op bodies; the numerics left out),
  against the same model in BF16 compiled the same way (torch's share is what is not fp4gen's).

``--graphs`` emulates the layer graphs a GPU runs each pass from: every pass of a converted
layer asks its own ``LayerGraphs`` (CUDA stood in for as ``benchmarks/host_keys.py`` stands it
in: one stream, a capture runs the work once for its meta, a replay does nothing), so the
counts are the graph path's, as on a GPU from the third step on (the pass's ``_graphable``
check, a few calls, is not counted; the eager rows then run without layer groups, each layer
alone as the compiled ops run it). Without it, the passes run their work eagerly, as on the
CPU. The counts are of one torch version's code: compare before and after a change.

    python benchmarks/compiled_host_calls.py [--recipe nvfp4_small] [--blocks 4] [--graphs]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

import fp4gen  # noqa: E402
from fp4gen import gemm_dispatch  # noqa: E402
from fp4gen.runtime import layer_graphs, layer_groups, ops, quantize_dispatch  # noqa: E402
from fp4gen.runtime import linear as linear_module  # noqa: E402

# the op bodies: fp4gen's own host work per layer pass, compiled and eager
OP_BODIES: dict[CodeType, str] = {
    ops._linear_forward.__code__: "forward",
    ops._linear_backward.__code__: "backward",
    ops._EagerLinear.forward.__code__: "forward",
    ops._EagerLinear.backward.__code__: "backward",
    layer_groups._GroupLinear.forward.__code__: "forward",  # eager: a layer group's members
    layer_groups._GroupLinear.backward.__code__: "backward",
}
# the numerics: counted at their entry only (the CPU runs the reference, a GPU a kernel)
NUMERICS: frozenset[CodeType] = frozenset(
    f.__code__
    for f in (quantize_dispatch.quantize, quantize_dispatch.mor_quantize, gemm_dispatch.gemm)
)


class HostCounter:
    """Function calls (``sys.setprofile``: Python and C calls, as cProfile counts them) in the
    step and in the op bodies, with the numerics' inner work left out; with ``ops``, the op
    bodies' torch operations too (its dispatch mode is active inside the bodies only: dynamo
    runs no compiled code while a dispatch mode is active, so a mode around the step would
    count an eager step)."""

    def __init__(self, ops: OpCounter | None = None) -> None:
        self.step_calls = 0
        self.body_calls = 0
        self.in_body = 0
        self.in_numerics = 0
        self.ops = ops
        if ops is not None:
            ops.calls = self

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if not self.in_numerics:
                self.step_calls += 1
                if self.in_body:
                    self.body_calls += 1
            if code in NUMERICS:
                self.in_numerics += 1
            elif code in OP_BODIES:
                self.in_body += 1
                if self.in_body == 1 and self.ops is not None:
                    self.ops.__enter__()
        elif event == "return":
            code = frame.f_code
            if code in NUMERICS:
                self.in_numerics -= 1
            elif code in OP_BODIES:
                self.in_body -= 1
                if self.in_body == 0 and self.ops is not None:
                    self.ops.__exit__(None, None, None)
        elif event == "c_call" and not self.in_numerics:
            self.step_calls += 1
            if self.in_body:
                self.body_calls += 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        previous = sys.getprofile()
        sys.setprofile(self)
        try:
            yield
        finally:
            sys.setprofile(previous)


class OpCounter(TorchDispatchMode):
    """aten operations dispatched inside the op bodies (``HostCounter`` enters it there), the
    numerics left out."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: HostCounter | None = None
        self.body_ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if self.calls is not None and not self.calls.in_numerics:
            self.body_ops += 1
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class Counts:
    """One step's counts; ``linears``: the converted layers that ran a forward in it."""

    step_calls: int
    body_calls: int
    body_ops: int
    linears: int
    in_place_replays: int = 0  # layer passes served by an in-place graph replay (``graphs``)

    def per_linear(self, value: int) -> float:
        return value / self.linears if self.linears else 0.0


def llama(blocks: int, recipe: str | None, hidden: int = 64) -> torch.nn.Module:
    """A tiny transformers Llama, converted with ``recipe`` (None: BF16)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=blocks,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        max_position_embeddings=64,
        use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config)
    if recipe is not None:
        fp4gen.convert(model, recipe)
    return model


def _strides(tensors: tuple[torch.Tensor | None, ...]) -> tuple[Any, ...]:
    """Where a graph finds ``tensors``, the addresses left out (they repeat on a GPU)."""
    return tuple([None if t is None else t.stride() for t in tensors])


def _zeros(shapes: tuple, device: torch.device) -> tuple:
    """A call's result tensors, new per call as on a GPU (``host_keys``' stand-in keeps one
    set per shape, which the layers of a step would share); zeros, as no replay writes them
    (one torch operation, as torch.empty is)."""
    return tuple(None if s is None else torch.zeros(s[0], dtype=s[1]) for s in shapes)


@contextlib.contextmanager
def emulated_graphs() -> Iterator[None]:
    """Every converted layer's passes served by its own ``LayerGraphs`` with CUDA stood in for
    (``host_keys.stand_ins``: one stream, never capturing, a capture runs the work once for
    its meta, a replay does nothing), the result tensors made anew per call, and addresses
    taken as repeating, as a training loop's CUDA caching allocator repeats them (the CPU's
    does not): every pass replays in place from the third step on."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import host_keys

    def own_graphs(self: Any, t: torch.Tensor, table: Any, *, forward: bool) -> Any:
        if self._graphs is None:
            self._graphs = layer_graphs.LayerGraphs(self.name)
        return self._graphs

    with (
        host_keys.stand_ins(layer_graphs.LayerGraphs("unused")),
        mock.patch.object(linear_module.Linear, "_graphs_for", own_graphs),
        mock.patch.object(layer_graphs, "_fresh", _zeros),
        mock.patch.object(layer_graphs, "_addresses", _strides),
        mock.patch.object(layer_graphs, "_result_addresses", _strides),
    ):
        yield


def count_step(
    recipe: str | None,
    *,
    compiled: bool,
    blocks: int = 4,
    graphs: bool = False,
    warm: int = 3,
    tokens: int = 16,
) -> Counts:
    """The counts of one training step (forward, loss, backward) of a ``blocks``-block Llama
    after ``warm`` uncounted steps, its blocks compiled one by one with ``aot_eager`` where
    ``compiled`` (as ``benchmarks/train.py --compile blocks`` compiles them)."""
    model = llama(blocks, recipe)
    torch._dynamo.reset()
    if compiled:
        for block in model.model.layers:
            block.compile(backend="aot_eager")
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids, use_cache=False).loss.backward()

    with emulated_graphs() if graphs else contextlib.nullcontext():
        for _ in range(warm):
            step()
        layers = [m for m in model.modules() if isinstance(m, fp4gen.nn.Linear)]
        replays = _in_place_replays(layers)
        calls = HostCounter()
        with calls.counting():  # the calls, with no dispatch mode's calls among them
            step()
        replays = _in_place_replays(layers) - replays
        op_counter = OpCounter()
        before = [m._forward_calls for m in layers]
        with HostCounter(op_counter).counting():
            step()
    ran = sum(m._forward_calls > n for m, n in zip(layers, before, strict=True))
    return Counts(calls.step_calls, calls.body_calls, op_counter.body_ops, ran, replays)


def _in_place_replays(layers: list[Any]) -> int:
    return sum(m._graphs.in_place_replays for m in layers if m._graphs is not None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="nvfp4_small")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--graphs", action="store_true", help="emulate the layer graphs")
    args = parser.parse_args(argv)
    print(
        f"{args.recipe}, {args.blocks}-block Llama, {'graph' if args.graphs else 'eager'} "
        "passes; per converted Linear forward + backward:"
    )
    for compiled in (False, True):
        how = "compiled blocks (aot_eager)" if compiled else "eager"
        bf16 = count_step(None, compiled=compiled, blocks=args.blocks)
        # eager with graphs: no layer groups (each layer alone, as the compiled ops run it;
        # the emulation does not serve the groups' graphs)
        alone = {"FP4GEN_LAYER_GROUPS": "0"} if args.graphs and not compiled else {}
        with mock.patch.dict(os.environ, alone):
            got = count_step(args.recipe, compiled=compiled, blocks=args.blocks, graphs=args.graphs)
        print(
            f"{how}: fp4gen's op bodies {got.per_linear(got.body_calls):.0f} calls and "
            f"{got.per_linear(got.body_ops):.1f} torch operations; the rest of the step "
            f"{got.per_linear(got.step_calls - got.body_calls - bf16.step_calls):+.0f} calls "
            f"against BF16's (step: {got.step_calls} calls, {got.body_calls} in the bodies; "
            f"BF16 {bf16.step_calls}; {got.linears} converted Linears)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

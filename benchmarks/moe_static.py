"""The experts' fwd+bwd with every size on the device, replayed in one CUDA graph per step.

An MoE layer's experts part at ``--hidden`` / ``--inner``, ``--experts`` experts, top
``--topk`` of ``--tokens`` tokens: the routed rows sorted by expert, the gate/up projection,
SiLU(gate) x up, the down projection, and the backward of all three (dx and both weights'
gradients). Every timed step draws a new routing on the device (uniform top-k). Rows, all in
one process, BF16 first:

- ``bf16 grouped_mm eager``: torch._grouped_mm in BF16 with autograd, the baseline (ratios);
- ``bf16 grouped_mm graph``: the same, captured once in a CUDA graph (its offsets are device
  tensors, so one graph replays every routing);
- ``<recipe> grouped eager``: fp4gen's grouped path (``grouped.GroupedProjection``): the
  host reads the routing's counts and sizes every launch from them;
- ``<recipe> static graph``: ``static_experts.StaticProjection`` captured once and replayed
  (the route built inside the graph from the device counts).

``--block``: the same for transformers' whole Qwen3-MoE sparse block (router, top-k, experts,
the weighted sum: what ``benchmarks/moe.py``'s layer section times), a new batch of tokens per
step so that the routing moves: ``bf16 block eager`` (transformers' grouped_mm experts, the
baseline of this section), ``bf16 block graphed`` (``torch.cuda.make_graphed_callables``),
``<recipe> block eager`` (fp4gen's grouped path) and ``<recipe> block static graphed`` (the
converted block with ``GroupedExperts.static = True``, graphed).

``--model``: a training step of ``benchmarks/moe.py``'s model (transformers' Qwen3-MoE at
``--model-layers`` layers of the same widths, ``--tokens`` tokens, AdamW, bf16 autocast with
fp32 master weights): ``bf16 model eager`` (its baseline), ``bf16 model graphed blocks`` (every
sparse MoE block captured by ``make_graphed_callables``), ``<recipe> model eager`` and
``<recipe> model static graphed blocks``.

``--wgrad``: the experts' weight gradients alone, both projections (dW = dY_e^T X_e over each
expert's tokens): ``bf16 wgrad grouped_mm`` (torch._grouped_mm grouped along K over the real
rows, BF16's wgrad and this section's baseline); ``fp8_blockwise wgrad K-grouped coalesced``
(``fp8_kgrouped.k_grouped_sides`` as the static path runs it: each expert's tokens padded to
128, MN-major scales and whole-sector stores, the scales' transposing copy included); and
``... row-major`` (``fp8_kgrouped.set_k_grouped_coalesced(False)``). With TFLOP/s of the real
rows' products.

Printed: ms per step (median of ``--steps`` timed steps, CUDA events around each), the ratio
to the eager BF16 row and to the BF16 graph. ``--profile N``: under each graph row, the N
kernels with the most GPU time in one replay (torch.profiler, after the row is timed).

    python benchmarks/moe_static.py [--hidden 2048] [--inner 768] [--experts 64] [--topk 8]
                                    [--tokens 8192] [--recipes nvfp4_no_bf16,fp8_blockwise]
                                    [--steps 20] [--profile N] [--block]
                                    [--model] [--model-layers 4] [--seq 1024] [--wgrad]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

import fp4gen  # noqa: E402
from fp4gen.runtime import grouped  # noqa: E402
from fp4gen.runtime.static_experts import (  # noqa: E402
    StaticCalls,
    backward_multiple,
    static_calls,
    static_projection,
    static_route,
)


def act(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def experts_module(args: argparse.Namespace, recipe: str) -> torch.nn.Module:
    """Qwen3-MoE's experts at the benchmark's widths, converted by ``recipe`` (bf16, CUDA)."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.inner,
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        holder = torch.nn.Module()
        holder.experts = Qwen3MoeExperts(cfg)
        with torch.no_grad():
            for p in holder.experts.parameters():
                p.normal_(0.0, 0.02)
    holder.to(torch.bfloat16)
    if recipe != "bf16":
        fp4gen.convert(holder, recipe)
    return holder.experts


def routings(args: argparse.Namespace, n: int) -> list[torch.Tensor]:
    """``n`` routings' rows per expert (int32 [E] on the GPU), each a uniform top-k draw."""
    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for _ in range(n):
        scores = torch.rand(args.tokens, args.experts, device="cuda", generator=g)
        index = scores.topk(args.topk, dim=1).indices.reshape(-1)
        out.append(torch.bincount(index, minlength=args.experts).to(torch.int32))
    return out


def time_steps(step: Callable[[int], None], steps: int) -> float:
    """Median ms of ``steps`` calls of ``step(i)`` after two warm-up calls (CUDA events)."""
    for i in range(2):
        step(i)
    times = []
    for i in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def captured(body: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``body`` warmed up on a side stream, then captured once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


class Bench:
    """The inputs every row shares: the routed rows x [R, hidden], dy [R, hidden], the
    routings, and the device counts buffer a graph reads."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rows = args.tokens * args.topk
        self.x = torch.randn(self.rows, args.hidden, device="cuda", dtype=torch.bfloat16)
        self.dy = torch.randn_like(self.x)
        self.routes = routings(args, 8)
        self.counts = torch.zeros(args.experts, dtype=torch.int32, device="cuda")
        self.ends = torch.zeros(args.experts, dtype=torch.int32, device="cuda")

    def load(self, i: int) -> torch.Tensor:
        counts = self.routes[i % len(self.routes)]
        self.counts.copy_(counts)
        torch.cumsum(self.counts, 0, dtype=torch.int32, out=self.ends)
        return counts

    def bf16_body(self, module: torch.nn.Module) -> Callable[[], object]:
        w1, w2 = module.gate_up_proj, module.down_proj
        x = self.x.detach().requires_grad_()

        def body() -> object:
            h = torch._grouped_mm(x, w1.transpose(1, 2), offs=self.ends)
            y = torch._grouped_mm(act(h), w2.transpose(1, 2), offs=self.ends)
            return torch.autograd.grad(y, (x, w1, w2), self.dy)

        return body

    def grouped_step(self, module: torch.nn.Module) -> Callable[[int], None]:
        x = self.x.detach().requires_grad_()
        w1, w2 = module.gate_up_proj, module.down_proj
        name = type(module).__name__

        def step(i: int) -> None:
            counts = self.load(i).tolist()  # the host reads the routing, as the layer does
            hit = [e for e, c in enumerate(counts) if c]
            h = x
            for proj, w in ((0, w1), (1, w2)):
                every = [pair[proj] for pair in module.gemms]
                groups = grouped.Groups(
                    hit, [counts[e] for e in hit], [every[e] for e in hit], False,
                    torch.bfloat16, f"{name}.{proj}", every,
                )  # fmt: skip
                h = grouped.GroupedProjection.apply(h, w, None, groups)
                if proj == 0:
                    h = act(h)
            torch.autograd.grad(h, (x, w1, w2), self.dy)

        return step

    def static_body(self, module: torch.nn.Module) -> Callable[[], object]:
        x = self.x.detach().requires_grad_()
        w1, w2 = module.gate_up_proj, module.down_proj
        every = [[pair[p] for pair in module.gemms] for p in (0, 1)]
        groups = [
            grouped.Groups(
                list(range(len(e))), [0] * len(e), e, False, torch.bfloat16, f"experts.{p}", e
            )  # fmt: skip
            for p, e in enumerate(every)
        ]
        calls = [static_calls(e, x.device) for e in every]
        multiple = backward_multiple(every[0][0].operands)

        def body() -> object:
            route = static_route(self.counts, self.rows, multiple)
            h = act(static_projection(x, w1, route, calls[0], groups[0]))
            y = static_projection(h, w2, route, calls[1], groups[1])
            grads = torch.autograd.grad(y, (x, w1, w2), self.dy)
            for c in calls:  # the next pass's Philox streams, as the layers' counters move
                advance(c)
            return grads

        return body


def replaying(bench: Bench, graph: torch.cuda.CUDAGraph) -> Callable[[int], None]:
    """A step that loads routing ``i`` into the counts buffer and replays ``graph``."""

    def step(i: int) -> None:
        bench.load(i)
        graph.replay()

    return step


def profile_replay(bench: Bench, graph: torch.cuda.CUDAGraph, top: int) -> None:
    """The ``top`` kernels by GPU time in one replay of ``graph``, and their sum."""
    from torch.profiler import ProfilerActivity, profile

    bench.load(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time)
    total = sum(sum(t) for t in kernels.values()) / 1000
    print(f"      GPU kernels: {total:.3f} ms in one replay")
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    for name, times in ranked:
        print(f"      {sum(times) / 1000:8.3f} ms {len(times):4d}x  {name[:90]}")


def block_section(args: argparse.Namespace) -> None:
    """The whole sparse MoE block's fwd+bwd (module docstring, ``--block``)."""
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from fp4gen.runtime.experts import GroupedExperts

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.inner,
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
    )
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    with torch.device("cuda"):
        source = Qwen3MoeSparseMoeBlock(cfg)
        with torch.no_grad():
            for p in source.parameters():
                p.normal_(0.0, 0.02)
    state = source.state_dict()
    batches = [
        torch.randn(1, args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
        for _ in range(4)
    ]
    dy = torch.randn_like(batches[0])

    def make(recipe: str | None, static: bool = False) -> torch.nn.Module:
        with torch.device("cuda"):
            block = Qwen3MoeSparseMoeBlock(cfg)
        block.load_state_dict(state)
        block.to(torch.bfloat16)
        if recipe is not None:
            fp4gen.convert(block, recipe)
            for m in block.modules():
                if isinstance(m, GroupedExperts):
                    m.static = static
        return block

    def stepper(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[int], None]:
        inp = batches[0].detach().requires_grad_()

        def step(i: int) -> None:
            with torch.no_grad():
                inp.copy_(batches[i % len(batches)])
            fn(inp).backward(dy)

        return step

    def graphed(block: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        sample = batches[0].detach().requires_grad_()
        return torch.cuda.make_graphed_callables(block, (sample,))

    print(f"\nwhole sparse block fwd+bwd ({args.tokens} tokens, a new batch per step)")
    print(f"  {'row':36} {'ms':>9} {'x eager bf16':>13} {'x bf16 graph':>13}")
    base = time_steps(stepper(make(None)), args.steps)
    print(f"  {'bf16 block eager':36} {base:9.3f} {1.0:13.3f}")
    try:
        graph = time_steps(stepper(graphed(make(None))), args.steps)
        print(f"  {'bf16 block graphed':36} {graph:9.3f} {graph / base:13.3f} {1.0:13.3f}")
    except RuntimeError as err:
        graph = None
        print(f"  bf16 block graphed: not capturable: {str(err)[:200]}")
    for recipe in args.recipes.split(","):
        rows = [("eager", lambda r=recipe: make(r)), ("static graphed", None)]
        for label, build in rows:
            try:
                fn = build() if build is not None else graphed(make(recipe, static=True))
                ms = time_steps(stepper(fn), args.steps)
            except (fp4gen.FP4GenError, RuntimeError) as err:
                print(f"  {recipe} block {label}: not run: {str(err)[:300]}")
                continue
            versus = f"{ms / graph:13.3f}" if graph else ""
            print(f"  {recipe + ' block ' + label:36} {ms:9.3f} {ms / base:13.3f} {versus}")
        torch.cuda.empty_cache()


class GraphedBlock(torch.nn.Module):
    """A sparse MoE block replayed by CUDA graphs: its forward and backward captured once by
    ``torch.cuda.make_graphed_callables`` for inputs like ``sample`` (under bf16 autocast
    without its cast cache, as the model's step runs it); the block stays a child (its
    parameters are the model's)."""

    def __init__(self, block: torch.nn.Module, sample: torch.Tensor) -> None:
        super().__init__()
        self.block = block
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            self.__dict__["replay"] = torch.cuda.make_graphed_callables(block, (sample,))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.replay(hidden_states)


def graph_moe_blocks(model: torch.nn.Module, forward: Callable[[], None], static: bool) -> str:
    """Every sparse MoE block of ``model`` (a module with an ``experts`` child) replaced by a
    ``GraphedBlock``, captured for the inputs one eager ``forward`` gives it (without
    autograd: a graph kept from an eager step would keep the parameters' AccumulateGrad nodes on
    the eager step's stream, which a captured backward cannot wait for); with ``static`` its
    fp4gen experts run with every size on the device (else they could not be captured), and a
    block whose fp4gen experts cannot (``GroupedExperts.static_reason``: e.g. a block the
    recipe keeps in BF16) stays eager. Returns how many blocks were graphed, and why not."""
    from fp4gen.runtime.experts import GroupedExperts

    blocks = [(n, m) for n, m in model.named_modules() if hasattr(m, "experts")]
    eager = []
    for name, block in blocks:  # static first: the recording forward runs the static path too
        if isinstance(block.experts, GroupedExperts):
            probe = torch.empty(0, block.experts.layout.hidden, device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                reason = block.experts.static_reason(probe) if static else "not static"
            if reason is not None:
                eager.append(name)
                continue
            block.experts.static = True
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        block.register_forward_pre_hook(
            lambda _, args, name=name: seen.__setitem__(name, args[0].detach())
        )
        for name, block in blocks
    ]
    with torch.no_grad():
        forward()
    for hook in hooks:
        hook.remove()
    for name, block in blocks:
        if name in eager:
            continue
        sample = seen[name].detach().clone().requires_grad_()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, GraphedBlock(block, sample))
    note = f"{len(blocks) - len(eager)} of {len(blocks)} blocks graphed"
    return note + "".join(f"; eager {e} (static_reason)" for e in eager)


def model_section(args: argparse.Namespace) -> None:
    """A model's training step with its MoE blocks eager or graphed (``--model``)."""
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from moe import BASELINE, VOCAB, moe_config, register_baseline

    register_baseline()
    args.seq = min(args.seq, args.tokens)
    cfg = moe_config("qwen3_moe", args, args.experts, args.topk, args.model_layers)
    torch.manual_seed(0)
    with torch.device("cuda"):
        state = transformers.Qwen3MoeForCausalLM(cfg).state_dict()
    tokens = torch.randint(0, VOCAB, (args.tokens // args.seq, args.seq), device="cuda")

    def make(recipe: str | None) -> torch.nn.Module:
        cfg._experts_implementation = BASELINE
        with torch.device("cuda"):
            model = transformers.Qwen3MoeForCausalLM(cfg)
        model.load_state_dict(state)
        return model if recipe is None else fp4gen.convert(model, recipe)

    def run(model: torch.nn.Module, graph: bool, static: bool = False) -> tuple[float, str]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def forward() -> torch.Tensor:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return model(input_ids=tokens, labels=tokens).loss

        def step(_: int = 0) -> None:
            forward().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        note = graph_moe_blocks(model, forward, static) if graph else ""
        return time_steps(step, args.steps), note

    print(
        f"\nQwen3MoeForCausalLM training step: {args.model_layers} layers, {args.tokens} "
        f"tokens (seq {args.seq}), AdamW, bf16 autocast"
    )
    print(f"  {'row':36} {'ms':>9} {'x eager bf16':>13} {'x bf16 graphed':>15}")
    base, _ = run(make(None), graph=False)
    print(f"  {'bf16 model eager':36} {base:9.3f} {1.0:13.3f}", flush=True)
    graphed, note = run(make(None), graph=True)
    name = "bf16 model graphed blocks"
    print(f"  {name:36} {graphed:9.3f} {graphed / base:13.3f} {1.0:15.3f}  {note}", flush=True)
    for recipe in args.recipes.split(","):
        for label, graph in (("eager", False), ("static graphed blocks", True)):
            try:
                ms, note = run(make(recipe), graph=graph, static=graph)
            except (fp4gen.FP4GenError, RuntimeError) as err:
                print(f"  {recipe} model {label}: not run: {str(err)[:300]}")
                traceback.print_exc(file=sys.stderr)  # the first error of a failed capture too
                continue
            name = f"{recipe} model {label}"
            ratios = f"{ms / base:13.3f} {ms / graphed:15.3f}"
            print(f"  {name:36} {ms:9.3f} {ratios}  {note}", flush=True)
            gc.collect()  # the graphs' pools go with the model
            torch.cuda.empty_cache()


def advance(calls: StaticCalls) -> None:
    calls.forward.add_(1)
    calls.backward.add_(1)


def experts_section(args: argparse.Namespace) -> None:
    """The experts part alone (module docstring)."""
    bench = Bench(args)
    print(
        f"experts fwd+bwd: hidden {args.hidden}, inner {args.inner}, {args.experts} experts, "
        f"top-{args.topk}, {args.tokens} tokens ({bench.rows} routed rows), a new routing "
        "per step"
    )
    print(f"  {'row':36} {'ms':>9} {'x eager bf16':>13} {'x bf16 graph':>13}")
    base = bench_graph = None

    def row(name: str, ms: float) -> None:
        ratios = [f"{ms / b:13.3f}" if b else f"{'':>13}" for b in (base, bench_graph)]
        print(f"  {name:36} {ms:9.3f} {ratios[0]} {ratios[1]}", flush=True)

    bf16 = experts_module(args, "bf16")
    body = bench.bf16_body(bf16)
    base = time_steps(lambda i: (bench.load(i), body()), args.steps)
    row("bf16 grouped_mm eager", base)
    graph = captured(body)
    bench_graph = time_steps(replaying(bench, graph), args.steps)
    row("bf16 grouped_mm graph", bench_graph)
    if args.profile:
        profile_replay(bench, graph, args.profile)
    for recipe in args.recipes.split(","):
        module = experts_module(args, recipe)
        row(f"{recipe} grouped eager", time_steps(bench.grouped_step(module), args.steps))
        try:
            graph = captured(bench.static_body(module))
        except fp4gen.FP4GenError as err:
            print(f"  {recipe} static graph: not served: {err}")
            continue
        row(f"{recipe} static graph", time_steps(replaying(bench, graph), args.steps))
        if args.profile:
            profile_replay(bench, graph, args.profile)


def wgrad_section(args: argparse.Namespace) -> None:
    """The experts' wgrad GEMMs alone (module docstring, ``--wgrad``)."""
    from fp4gen.runtime import fp8_kgrouped

    counts = routings(args, 1)[0]
    padded = (counts + 127) // 128 * 128  # each expert's tokens in whole K-blocks
    ends = padded.cumsum(0).to(torch.int32)
    offsets = torch.cat([ends.new_zeros(1), ends])
    rows = int(ends[-1])
    real = torch.zeros(rows, dtype=torch.bool, device="cuda")  # rows past an expert's tokens
    starts = (ends - padded).tolist()
    for start, count in zip(starts, counts.tolist(), strict=True):
        real[start : start + count] = True
    fmt = fp4gen.load_recipe("fp8_blockwise").operands.wgrad_gradient.format  # e4m3 1x128
    g = torch.Generator(device="cuda").manual_seed(2)
    ones = torch.ones(args.experts, device="cuda")
    flops = 0.0
    cases = []
    for n_out, n_in in ((2 * args.inner, args.hidden), (args.hidden, args.inner)):
        dy_t = torch.randn(n_out, rows, device="cuda", generator=g) * real  # dY^T, padded
        x_t = torch.randn(n_in, rows, device="cuda", generator=g) * real  # X^T
        flops += 2.0 * n_out * n_in * float(counts.sum())
        a, b = fp4gen.quantize(dy_t, fmt), fp4gen.quantize(x_t, fmt)
        # BF16 reads the real rows only, grouped at their own ends (no padding to 128), as
        # the autograd of its fprop does: dY^T and X both views of row-major [rows, features]
        dy_bf = dy_t[:, real].t().contiguous().bfloat16()
        x_bf = x_t[:, real].t().contiguous().bfloat16()
        cases.append((dy_bf, x_bf, a, b))
    real_ends = counts.cumsum(0).to(torch.int32)

    def bf16(_: int) -> None:
        for dy_bf, x_bf, _a, _b in cases:
            torch._grouped_mm(dy_bf.t(), x_bf, offs=real_ends)

    def fp8(_: int) -> None:  # what the static path's wgrad runs
        for _dy, _x, a, b in cases:
            fp8_kgrouped.k_grouped_sides(a, b, (ones, ones), offsets, args.experts, torch.bfloat16)

    base = time_steps(bf16, args.steps)
    print(f"bf16 wgrad grouped_mm {base:.3f} ms {flops / base / 1e9:.0f} TFLOP/s 1.000x")
    for name, coalesced in (("coalesced", True), ("row-major", False)):
        previous = fp8_kgrouped.set_k_grouped_coalesced(coalesced)
        try:
            ms = time_steps(fp8, args.steps)
        finally:
            fp8_kgrouped.set_k_grouped_coalesced(previous)
        print(
            f"fp8_blockwise wgrad K-grouped {name} {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s "
            f"{ms / base:.3f}x"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inner", type=int, default=768)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--recipes", default="nvfp4_no_bf16,fp8_blockwise")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--profile", type=int, default=0, help="kernels to list per graph row")
    parser.add_argument("--block", action="store_true", help="also the whole sparse block")
    parser.add_argument("--model", action="store_true", help="also a whole model's step")
    parser.add_argument("--model-layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--skip-experts", action="store_true", help="no experts-only section")
    parser.add_argument("--wgrad", action="store_true", help="also the wgrad GEMMs alone")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the static launches and graphs run on CUDA)")
    if not args.skip_experts:
        experts_section(args)
    if args.block:
        block_section(args)
    if args.model:
        model_section(args)
    if args.wgrad:
        wgrad_section(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

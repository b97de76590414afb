"""Training-step time of a Llama-architecture model: BF16 against recipes, in one run.

The model is transformers' LlamaForCausalLM built from a config (no download) when transformers
is installed, otherwise fp4gen's built-in GPT of the same width and depth. Byte vocabulary (256),
``--tokens`` tokens per step in sequences of ``--seq``, AdamW, bf16 autocast (fp32 master
weights), as a user would train it. For each hidden size and recipe it prints:

- ms/step eager (CUDA events over ``--steps`` steps run back to back) and, with ``--graphs``,
  with the whole step (forward, backward, optimizer) captured in one CUDA graph and replayed
  (or the reason it could not be captured);
- host us per Linear forward+backward: the host's time in fp4gen's ops per layer call
  (``Linear.forward_gemm`` + ``backward_gemms``, or a layer group's two passes divided among its
  members), timed with ``time.perf_counter`` and no profiler over steps on one sequence
  (forward + backward), where the GPU waits for the host: no launch waits for room in the
  launch queue, the same kernels, layer graphs and Python per call as the full batch's;
- call us per Linear forward+backward: the same steps' time in the whole layer call as a
  training step makes it: the module's ``__call__`` (the autograd.Function's apply, a layer
  group's checks and hand-overs included) plus the body of its autograd node's backward (the
  engine's own work between nodes is not in it);
- wall us per Linear forward+backward: the wall time the host spends in the same two ops
  (``Linear.forward_gemm`` + ``backward_gemms``) over three steps of the full batch run back to
  back, no profiler: where the GPU is the bottleneck this includes the launches' waits for room
  in the full launch queue, so it reads above the host column there
  and equals the host's own cost only where the host is the bottleneck (docs/training-step.md);
- peak memory of a step (torch.cuda.max_memory_allocated);
- the ratio of each figure to BF16's.

Then, once every row (eager, compiled, of every hidden size) is timed, each row's profile
(its model built and warmed up again): a torch.profiler session leaves every later kernel
launch of the process slower (6.9 -> 9.5 us per small launch on an H200 host), so no figure
above is taken after one. Per row:

- GPU-busy ms/step: the sum of the kernel times of a step (torch.profiler, the mean of three
  steps after one it discards: the profiler's own start-up lands in that one), and its ratio
  to BF16's of the same group (where ms/step is well above it the host is the bottleneck);
- prof us per Linear: the ops' CPU time as torch.profiler records it (CPU + CUDA activities,
  the three profiled steps, each started on an idle GPU): the profiler's own instrumentation of
  every op and launch is in it, so it reads above the host column (docs/training-step.md);
- GPU ms per step by kernel kind (GEMM, quantize, decode, attention, optimizer, copies, other
  fp4gen kernels, the rest), BF16's beside; with ``--kernels N`` the N kernels with the most
  GPU time (``--kernel-width C`` characters of each name).

The header line times a bare ``x + 1`` and a ``torch.empty`` on the GPU's host: where the host's
time meets the GPU's (hidden 1024-2048 eagerly) the eager columns follow the host's speed, and
these two tell a slow host from a regression.

    python benchmarks/train.py [--hidden 1024,2048] [--layers 8,6] [--tokens 8192] [--seq 1024]
                               [--recipes bf16,recipes/nvfp4.fp4r] [--steps 10] [--graphs]
                               [--rounds R] [--model llama|gpt] [--host-profile N]
                               [--compare-saved-x] [--layer-graph-flops F,...]
                               [--compile blocks,model] [--compile-modes default,...]
                               [--compile-backend inductor] [--compile-only]

``--rounds R`` runs every hidden size's rows R times and then prints, per recipe, the median and
range of its eager and graph ratios (each round's against that round's BF16 run) and of its host
time per Linear. Where the host's time meets the GPU's, the eager ratio moves with the speed of
the machine's host from minute to minute (docs/training-step.md, "Runs on different hosts"): a
single run is one draw from that spread. Compiled rows (``--compile``) are compiled and timed
again in every round too, and their ratios to compiled BF16 printed the same way.

``--host-profile N`` prints the N most expensive Python functions of the eager fp4gen steps
(cProfile, cumulative time), which is where the host path's time goes. ``--compare-saved-x``
adds a run of each recipe whose layers save x for the backward instead of x's quantized wgrad
copy (``Linear.keep_quantized_input = False``): the peak-memory difference of that choice.
``--layer-graph-flops 0,1e11`` adds runs of each recipe with another layer-graph threshold (the
largest GEMM a graphed pass may have; 0 turns layer graphs off): where graphs stop paying.
``--compile blocks,model`` adds compiled rows: every recipe (BF16 first) with each decoder
block compiled on its own (``blocks``, as torchtitan compiles a model: embedding, head and loss
eager) and/or the whole model with its loss compiled (``model``), in each mode of
``--compile-modes default,reduce-overhead,max-autotune`` (``--compile-backend``, default
inductor): ms/step, its ratio to compiled BF16 of the same scope and mode, to eager BF16 and to
the recipe's own eager run, and dynamo's distinct graphs, graph breaks and frames compiled
(their profiles come with the others, after every row). Under each compiled row, where the
host's time goes (``HostBreakdown``: 3 more steps, the GPU synchronized after each phase): the
host ms of the forward, the backward and the optimizer step, within them fp4gen's op bodies
(and of the backward's, x's wgrad copies, quantized outside any layer graph), and per step the
fp4gen layer passes served by a layer graph, captured (also over the timed steps: a capture
costs milliseconds) or run eagerly; ``--host-profile N`` adds a cProfile of 3 compiled steps. A
Llama step runs with ``use_cache=False``: a training step reads no KV cache, and transformers'
default builds one whose update gives every compiled block a graph of its own.
``--compile-only`` skips the eager rows.
``--loss-steps N`` then trains each recipe N steps on real text (the Python standard library's
source bytes, ``fp4gen.demo.data``) from the same initial weights and batches, with the demo's
learning-rate schedule, and compares the loss curves to BF16's: the mean loss of the last tenth
of the steps, its paired difference to BF16's (the same batches) and BF16's step-to-step
standard deviation over those steps, the noise a difference is measured against.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import pstats
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

import fp4gen  # noqa: E402
from fp4gen.demo.data import ByteBatches, stdlib_corpus  # noqa: E402
from fp4gen.demo.lr_schedule import lr_at  # noqa: E402
from fp4gen.runtime import layer_graphs, layer_groups, ops  # noqa: E402

VOCAB = 256
LAYERS_BY_HIDDEN = {1024: 8, 2048: 6, 4096: 4}
# untimed steps first: kernels load, and layer graphs capture in the first steps (a warm-up
# call, a graph on static buffers, then graphs on the addresses the allocator settles on)
WARMUP_STEPS = 5
WALL_STEPS = 3  # eager steps timed back to back for the wall us per Linear
HOST_STEPS = 5  # steps on one sequence timed for the host and call us per Linear
PROFILED_STEPS = 3  # steps whose kernels and op ranges torch.profiler sums (after one discarded)
# what a GPU kernel is, by its name (lowercased): the first kind one of whose words it holds.
# Attention comes before the GEMMs (cuDNN's flash kernels name their wgmma); fp4gen's generated
# kernels are named by their class (QuantizeKernel, AmaxKernel, the MoR kernels' Measure /
# Decide / Emit / Scales / Tile kernels, DequantKernel, GemmSm90*Kernel)
QUANTIZE_KERNELS = tuple(
    f"{w}kernel" for w in ("quantize", "amax", "measure", "decide", "emit", "scales", "tile")
)
KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("quantize", QUANTIZE_KERNELS),
    ("decode", ("dequant", "decode")),
    ("gemm", ("gemm", "nvjet", "xmma")),
    ("fp4gen other", ("fp4gen",)),
    ("optimizer", ("multi_tensor_apply",)),
    ("copies", ("memcpy", "copy_kernel", "catarray")),
)


@dataclass
class Result:
    ms_eager: float
    ms_graph: float | None
    graph_note: str
    wall_us_per_linear: float | None  # the ops' wall time, back to back (wall_us_per_linear())
    host_us_per_linear: float | None  # the ops' time, host-bound, no profiler (host_us())
    call_us_per_linear: float | None  # the whole layer calls' time, the same steps (host_us())
    peak_gib: float
    graph_calls: float = 0.0  # per timed step: layer calls served by a layer graph
    in_place: float = 0.0  # of those, replays of graphs that read and write in place


@dataclass
class Profiled:
    """What ``profile_step`` measured of one row: GPU-busy ms per step, the fp4gen ops' CPU us
    per Linear under the profiler (None without fp4gen Linears), GPU ms per step by kernel
    kind, and (GPU ms, launches) per step by kernel name (for --kernels)."""

    gpu_busy_ms: float
    prof_us_per_linear: float | None
    gpu_kinds: dict[str, float]
    gpu_kernels: dict[str, tuple[float, float]]


@dataclass
class ProfileJob:
    """One row's profile, run after every timed row (``run_profiles``): ``group`` names the
    rows compared with each other (the first one, BF16, is their base), ``run`` rebuilds the
    row's model, warms it up and profiles it."""

    group: str
    label: str
    run: Callable[[], Profiled | None]


# torch.profiler leaves every later kernel launch of the process slower (on an H200 host: 6.9 us
# per small launch before a profiler session, 9.5 us after), which taxed every row timed after
# another row's profile, the host-bound ones most (an MoE model step: 1.22x BF16 timed before
# any profile, 1.66x after). So nothing is timed after a profile: each row leaves a job here,
# run once every row is timed.
_PROFILE_JOBS: list[ProfileJob] = []


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel (``KERNEL_KINDS``), "other" for the rest (elementwise ops,
    norms, reductions, the loss)."""
    low = name.lower()
    for kind, words in KERNEL_KINDS:
        if any(w in low for w in words):
            return kind
    return "other"


def kinds_line(kinds: dict[str, float], base: dict[str, float]) -> str:
    """GPU ms per step by kernel kind, largest first, BF16's beside where it has the kind."""
    shown = []
    for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        was = base.get(kind)
        shown.append(f"{kind} {ms:.2f}" + ("" if was is None or base is kinds else f" ({was:.2f})"))
    return ", ".join(shown)


def build_model(kind: str, hidden: int, layers: int, seq: int, device: str) -> nn.Module:
    """A Llama-architecture causal LM from a config (fp32 master weights)."""
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=256 * round(8 * hidden / 3 / 256),
            num_hidden_layers=layers,
            num_attention_heads=max(hidden // 128, 1),
            num_key_value_heads=max(hidden // 128, 1),
            max_position_embeddings=seq,
            tie_word_embeddings=False,
        )
        config._attn_implementation = "sdpa"
        return LlamaForCausalLM(config).to(device)
    from fp4gen.demo.gpt import GPT, GPTConfig

    heads = max(hidden // 128, 1)
    cfg = GPTConfig(layers=layers, width=hidden, heads=heads, context=seq, vocab=VOCAB)
    return GPT(cfg).to(device)


def loss_fn(kind: str) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    if kind == "llama":
        # no KV cache: a training step reads none, and transformers' default (use_cache=True)
        # would build one every step, whose update specializes each decoder block's layer_idx
        # (compiled per block: one graph per block, with or without fp4gen)
        return lambda model, tokens: model(input_ids=tokens, labels=tokens, use_cache=False).loss
    return lambda model, tokens: model(tokens[:, :-1], tokens[:, 1:])


def make_step(
    model: nn.Module,
    loss: Callable,
    tokens: torch.Tensor,
    capturable: bool,
    cudagraph_steps: bool = False,
    params: nn.Module | None = None,
    phases: list[list[float]] | None = None,
):
    """One training step (bf16 autocast on the tokens' device, AdamW). ``cudagraph_steps``: a
    step of a model compiled with mode="reduce-overhead" starts a new CUDA-graph-trees step
    (its replays' outputs may then be overwritten). ``params``: the module whose parameters
    the optimizer updates, where ``model`` wraps it (a compiled whole model). ``phases``: where
    given, each step appends the host's seconds in its forward, backward and optimizer step,
    the GPU synchronized after each (so that no launch waits for room in the queue: the host's
    own time, ``HostBreakdown``)."""
    opt = torch.optim.AdamW((params or model).parameters(), lr=1e-4, capturable=capturable)
    device = tokens.device.type

    def mark(times: list[float]) -> None:
        times.append(time.perf_counter())
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter())

    def step() -> torch.Tensor:
        times: list[float] = [time.perf_counter()]
        if cudagraph_steps:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(device, dtype=torch.bfloat16):
            value = loss(model, tokens)
        if phases is not None:
            mark(times)
        value.backward()
        if phases is not None:
            mark(times)
        opt.step()
        opt.zero_grad(set_to_none=False)  # graphs need the gradients' storage to stay put
        if phases is not None:
            mark(times)
            # (forward, backward, optimizer): each from the end of the previous sync
            phases.append([times[i + 1] - times[i] for i in range(0, 6, 2)])
        return value.detach()

    return step


def timed_ms(step: Callable[[], object], steps: int, device: str = "cuda") -> float:
    if device != "cuda":  # the CPU (the tests): wall time
        begin = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - begin) * 1e3 / steps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def graph_ms(step: Callable[[], object], steps: int) -> tuple[float | None, str]:
    """ms/step of the step captured in one CUDA graph, or (None, why it could not be)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return timed_ms(graph.replay, steps), "captured"
    except Exception as err:  # report the reason and go on with the other runs
        torch.cuda.synchronize()
        return None, f"not capturable: {type(err).__name__}: {str(err).splitlines()[0][:160]}"


def graph_counts(model: nn.Module) -> tuple[int, int]:
    """(layer calls served by a layer graph, in-place replays) summed over the model's fp4gen
    Linears so far (fp4gen.runtime.layer_graphs.LayerGraphs' counters); a layer group's graph
    call serves each of its members (fp4gen.runtime.layer_groups)."""
    served = in_place = 0
    groups = {}
    for module in model.modules():
        if not isinstance(module, fp4gen.nn.Linear):
            continue
        graphs = getattr(module, "_graphs", None)
        if graphs is not None:
            served += graphs.graph_calls
            in_place += graphs.in_place_replays
        group = layer_groups.group_of(module)
        if group is not None:
            groups[id(group)] = group
    for group in groups.values():
        served += group.graphs.graph_calls * group.size
        in_place += group.graphs.in_place_replays * group.size
    return served, in_place


def linear_forwards(model: nn.Module) -> int:
    """Forward calls of the model's fp4gen Linears so far, alone or in a layer group."""
    return sum(m._forward_calls for m in model.modules() if isinstance(m, fp4gen.nn.Linear))


# (class, attribute) pairs timed per layer call: fp4gen's ops, and the whole call
OPS = (
    (fp4gen.nn.Linear, "forward_gemm"),
    (fp4gen.nn.Linear, "backward_gemms"),
    (layer_groups.LayerGroup, "forward_pass"),
    (layer_groups.LayerGroup, "backward_pass"),
)
CALLS = (
    (fp4gen.nn.Linear, "__call__"),
    (ops._EagerLinear, "backward"),
    (layer_groups._GroupLinear, "backward"),
)


@contextlib.contextmanager
def timers(*groups: tuple[tuple[Any, str], ...]) -> Iterator[list[int]]:
    """Wrap each (class or module, attribute) of every group in a ``perf_counter`` timer for
    the block; yields one nanosecond total per group. Within a group an outer call is timed
    once (a group's pass can call a member's ``backward_gemms``; a module call runs the forward
    op)."""
    spent = [0] * len(groups)
    depth = [0] * len(groups)
    saved: list[tuple[Any, str, Any]] = []

    def timer(fn: Callable[..., Any], g: int) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            depth[g] += 1
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[g] -= 1
                if depth[g] == 0:
                    spent[g] += time.perf_counter_ns() - start

        return timed

    try:
        for g, targets in enumerate(groups):
            for cls, name in targets:
                own = cls.__dict__.get(name)  # None: inherited (nn.Module.__call__)
                saved.append((cls, name, own))
                if isinstance(own, staticmethod):  # an autograd.Function's backward
                    setattr(cls, name, staticmethod(timer(own.__func__, g)))
                else:
                    setattr(cls, name, timer(getattr(cls, name), g))
        yield spent
    finally:
        for cls, name, own in reversed(saved):
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)


def wall_us_per_linear(model: nn.Module, step: Callable[[], object], steps: int) -> float | None:
    """Wall microseconds the host spends per fp4gen Linear forward + backward in ``steps``
    eager steps (``forward_gemm`` + ``backward_gemms``, and a layer group's passes, each wrapped
    in a ``perf_counter`` timer for the duration), or None when the model has no fp4gen
    Linear."""
    before = linear_forwards(model)
    with timers(OPS) as spent:
        for _ in range(steps):
            step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    calls = linear_forwards(model) - before
    return spent[0] / 1e3 / calls if calls else None


def host_us(
    model: nn.Module, loss: Callable, tokens: torch.Tensor
) -> tuple[float | None, float | None]:
    """(host us in fp4gen's ops, us in the whole layer calls) per fp4gen Linear forward +
    backward, over ``HOST_STEPS`` forward + backward steps on one sequence of ``tokens`` after
    ``WARMUP_STEPS`` (its layer graphs captured): the GPU waits for the host there, so no
    launch waits for room in the queue, and no profiler adds its own work."""
    one = tokens[:1]

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            value = loss(model, one)
        value.backward()

    for _ in range(WARMUP_STEPS):
        step()
    torch.cuda.synchronize()
    before = linear_forwards(model)
    with timers(OPS, CALLS) as spent:
        for _ in range(HOST_STEPS):
            step()
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=False)
    calls = linear_forwards(model) - before
    if not calls:
        return None, None
    return spent[0] / 1e3 / calls, spent[1] / 1e3 / calls


def profile_step(model: nn.Module, step: Callable[[], object]) -> Profiled:
    """The row's ``Profiled`` figures (GPU-busy ms per step, profiled us per fp4gen Linear
    forward+backward or None, GPU ms per step by kernel kind, (GPU ms, launches) per step by
    kernel name) over ``PROFILED_STEPS`` steps after one the profiler runs but discards (its
    first step pays for the profiler's own start: CUPTI's instrumentation of launches it meets
    first). The second figure is the CPU time of the ranges of fp4gen's ops (a Linear's, and a
    layer group's for its members) over the Linear forwards they served, the profiler's own
    work on every op and launch inside them included."""
    from torch.profiler import ProfilerActivity, profile, schedule

    cpu_us = 0.0
    forwards = 0
    plan = schedule(wait=0, warmup=1, active=PROFILED_STEPS, repeat=1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=plan) as prof:
        for i in range(1 + PROFILED_STEPS):
            before = linear_forwards(model)
            step()
            torch.cuda.synchronize()  # each step starts on an idle GPU: no launch waits
            if i > 0:
                forwards += linear_forwards(model) - before
            prof.step()
    events = prof.events()
    kinds: dict[str, float] = {}
    kernels: dict[str, tuple[float, float]] = {}
    for e in events:  # kernels only: a named range (record_function) spans kernels too
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(
            e, "is_user_annotation", False
        ):
            ms = e.device_time / 1e3 / PROFILED_STEPS
            kind = kernel_kind(e.name)
            kinds[kind] = kinds.get(kind, 0.0) + ms
            was_ms, was_n = kernels.get(e.name, (0.0, 0.0))
            kernels[e.name] = (was_ms + ms, was_n + 1 / PROFILED_STEPS)
    ranges = [e for e in events if e.name.startswith(("fp4gen::linear_", "fp4gen::group_"))]
    cpu_us = sum(e.cpu_time_total for e in ranges)
    return Profiled(sum(kinds.values()), cpu_us / forwards if forwards else None, kinds, kernels)


def kernel_lines(kernels: dict[str, tuple[float, float]], top: int, width: int = 90) -> list[str]:
    """The ``top`` kernels by GPU time per step: ms, launches, kind and the name's start."""
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return [
        f"{ms:8.3f} ms {n:5.0f}x  {kernel_kind(name):12} {name[:width]}" for name, (ms, n) in ranked
    ]


def prepare_eager(
    args: argparse.Namespace, hidden: int, layers: int, recipe: str, saves_x: bool
) -> tuple[nn.Module, Callable[[], object], torch.Tensor]:
    """(model, step, tokens) of one eager row, the step warmed up (``run_one``)."""
    torch.manual_seed(0)
    model = build_model(args.model, hidden, layers, args.seq, "cuda")
    if recipe != "bf16":
        fp4gen.convert(model, fp4gen.load_recipe(recipe))
        for module in model.modules():
            if isinstance(module, fp4gen.nn.Linear):
                module.keep_quantized_input = not saves_x
    batch = args.tokens // args.seq
    tokens = torch.randint(0, VOCAB, (batch, args.seq + (args.model == "gpt")), device="cuda")
    # eager: AdamW as a training loop makes it; the graph replays need a capturable one (its
    # step count on the device), which adds launches, so it is made for those only
    step = make_step(model, loss_fn(args.model), tokens, capturable=False)
    for _ in range(WARMUP_STEPS):
        step()
    torch.cuda.synchronize()
    return model, step, tokens


@contextlib.contextmanager
def graph_flops(flops: float | None) -> Iterator[None]:
    """``layer_graphs.MAX_GEMM_FLOPS`` set to ``flops`` (None: left as it is) while it runs."""
    default = layer_graphs.MAX_GEMM_FLOPS
    layer_graphs.MAX_GEMM_FLOPS = default if flops is None else flops
    try:
        yield
    finally:
        layer_graphs.MAX_GEMM_FLOPS = default


def profile_eager(
    args: argparse.Namespace,
    hidden: int,
    layers: int,
    recipe: str,
    saves_x: bool,
    flops: float | None,
) -> Profiled:
    """An eager row's profile: its model built and warmed up again (``_PROFILE_JOBS``)."""
    with graph_flops(flops):
        model, step, _ = prepare_eager(args, hidden, layers, recipe, saves_x)
        got = profile_step(model, step)
    del model, step
    gc.collect()
    torch.cuda.empty_cache()
    return got


def run_one(
    args: argparse.Namespace, hidden: int, layers: int, recipe: str, saves_x: bool = False
) -> Result:
    """One model and recipe, timed (its profile is a job for later: ``_PROFILE_JOBS``);
    ``saves_x``: the converted layers save x for the backward instead of its quantized wgrad
    copy (``keep_quantized_input = False``), to compare memory."""
    model, step, tokens = prepare_eager(args, hidden, layers, recipe, saves_x)
    torch.cuda.reset_peak_memory_stats()
    before = graph_counts(model)
    ms = timed_ms(step, args.steps)
    replays = [(b - a) / args.steps for a, b in zip(before, graph_counts(model), strict=True)]
    peak = torch.cuda.max_memory_allocated() / 2**30
    wall = wall_us_per_linear(model, step, WALL_STEPS) if recipe != "bf16" else None
    host, call = host_us(model, loss_fn(args.model), tokens) if recipe != "bf16" else (None, None)
    if args.host_profile and recipe != "bf16":
        host_profile(step, args.host_profile)
    ms_graph, note = None, "not run"
    if args.graphs:
        ms_graph, note = graph_ms(make_step(model, loss_fn(args.model), tokens, True), args.steps)
    del model, step
    gc.collect()  # modules in reference cycles: freed now, not in a later run's peak or step
    torch.cuda.empty_cache()
    return Result(ms, ms_graph, note, wall, host, call, peak, *replays)


def loss_curve(
    args: argparse.Namespace, hidden: int, layers: int, recipe: str, steps: int, device: str
) -> list[float]:
    """The training losses of ``steps`` AdamW steps of a fresh seed-0 model with ``recipe`` on
    the standard library's source bytes: the same batches for every recipe (data seed 1), the
    demo's schedule (warm-up, cosine decay) peaking at ``args.loss_lr``, bf16 autocast."""
    torch.manual_seed(0)
    model = build_model(args.model, hidden, layers, args.seq, device)
    if recipe != "bf16":
        fp4gen.convert(model, fp4gen.load_recipe(recipe))
    batches = ByteBatches(stdlib_corpus(), args.seq, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.loss_lr)
    loss = loss_fn(args.model)
    per_step = max(args.tokens // args.seq, 1)
    values = []
    for i in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(i, steps, args.loss_lr)
        x, y = batches.batch(per_step)
        tokens = x if args.model == "llama" else torch.cat([x, y[:, -1:]], dim=1)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            value = loss(model, tokens.to(device, non_blocking=True))
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        values.append(value.detach().float())  # read at the end: no sync per step
    return torch.stack(values).cpu().tolist()


@dataclass
class CurveSummary:
    recipe: str
    mean: float  # mean loss over the last window steps
    diff: float  # mean of (loss - BF16's loss) over them, step by step (the same batches)
    diff_se: float  # the standard error of that mean
    noise: float  # BF16's step-to-step standard deviation over the window

    @property
    def within_noise(self) -> bool:
        return abs(self.diff) <= self.noise


def summarize_curves(curves: dict[str, list[float]], window: int) -> list[CurveSummary]:
    """Each curve's last ``window`` steps against BF16's (``curves["bf16"]``)."""
    base = torch.tensor(curves["bf16"][-window:], dtype=torch.float64)
    noise = float(base.std()) if window > 1 else 0.0
    out = []
    for recipe, losses in curves.items():
        tail = torch.tensor(losses[-window:], dtype=torch.float64)
        diff = tail - base
        se = float(diff.std()) / window**0.5 if window > 1 else 0.0
        out.append(CurveSummary(recipe, float(tail.mean()), float(diff.mean()), se, noise))
    return out


def print_curves(curves: dict[str, list[float]], points: int = 10) -> None:
    """The mean loss of each tenth of the steps per recipe, then the last tenth against BF16."""
    steps = len(curves["bf16"])
    chunk = max(steps // points, 1)
    names = list(curves)
    print(f"  loss curves, {steps} steps (mean of each {chunk} steps):")
    print("  " + f"{'steps':>11}" + "".join(f" {Path(n).stem:>14}" for n in names))
    for start in range(0, steps - chunk + 1, chunk):
        means = [sum(curves[n][start : start + chunk]) / chunk for n in names]
        print("  " + f"{start + 1:>5}-{start + chunk:<5}" + "".join(f" {m:14.4f}" for m in means))
    for s in summarize_curves(curves, chunk):
        if s.recipe == "bf16":
            continue
        verdict = "within" if s.within_noise else "OUTSIDE"
        print(
            f"  {Path(s.recipe).stem}: last {chunk} steps {s.mean:.4f} vs bf16 "
            f"{s.mean - s.diff:.4f}, difference {s.diff:+.4f} +- {s.diff_se:.4f} (same batches), "
            f"{verdict} bf16's step-to-step noise {s.noise:.4f}"
        )


def host_profile(step: Callable[[], object], top: int, what: str = "eager") -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.disable()
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(top)
        print(f"  host profile of 3 {what} steps (cProfile, {order}):")
        print("\n".join("    " + line for line in out.getvalue().splitlines() if line.strip()))


def host_speed(device: str, calls: int = 2000) -> tuple[float, float]:
    """Microseconds per bare ``x + 1`` and per ``torch.empty`` on ``device``, the host's part
    of a launch and of an allocation: the eager columns follow the host's speed where its time
    meets the GPU's, so a run prints them beside its figures (docs/training-step.md)."""
    x = torch.zeros(8, device=device)

    def per_call(fn: Callable[[], object]) -> float:
        for _ in range(50):
            fn()
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if x.is_cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls * 1e6

    return per_call(lambda: x + 1), per_call(lambda: torch.empty(8, device=device))


COMPILE_SCOPES = ("blocks", "model")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")


@dataclass
class CompiledResult:
    """One compiled run: ms/step (None where it failed: ``note`` says why), what dynamo made of
    the model (distinct graphs, graph breaks and frames compiled; a recompile counts again)
    and where the host's time goes (``host``). Its GPU-busy ms comes from its profile job
    (``_PROFILE_JOBS``), run after every row is timed."""

    ms: float | None
    graphs: int
    breaks: int
    compiles: int
    note: str = ""
    host: HostBreakdown | None = None


# what the host does in fp4gen's ops under torch.compile (the ops' bodies: the custom ops call
# these, looked up when they run): the forward pass and the backward pass
FORWARD_OP = ((fp4gen.nn.Linear, "forward_gemm"), (layer_groups.LayerGroup, "forward_pass"))
BACKWARD_OP = (
    (fp4gen.nn.Linear, "backward_gemms"),
    (layer_groups.LayerGroup, "backward_pass"),
)
BREAKDOWN_STEPS = 3  # steps timed for the host breakdown of a compiled run


@dataclass
class HostBreakdown:
    """Where the host's time of a training step goes (ms per step, the GPU synchronized after
    the forward, the backward and the optimizer step, so that no launch waits for room in the
    queue): each phase, and within them fp4gen's ops (their bodies as the custom ops run
    them); what is left of a phase is torch's (dynamo's guards, AOT autograd's wrappers, the
    compiled graphs' own launches) and the model's eager parts. Per step too: fp4gen layer
    passes (a forward or a backward of one layer), those served by a layer graph (replayed in
    place, or captured in that step), and the others, run eagerly."""

    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    forward_op_ms: float
    backward_op_ms: float
    passes: float
    from_graphs: float
    in_place: float
    captured: float
    timed_captures: float = 0.0  # per step of the ms/step timing before (captures cost ms)

    def line(self) -> str:
        if not self.passes:
            return (
                f"host ms/step: forward {self.forward_ms:.2f}, backward {self.backward_ms:.2f}, "
                f"optimizer {self.optimizer_ms:.2f}"
            )
        eager = self.passes - self.from_graphs
        return (
            f"host ms/step: forward {self.forward_ms:.2f} (fp4gen ops {self.forward_op_ms:.2f}), "
            f"backward {self.backward_ms:.2f} (fp4gen ops {self.backward_op_ms:.2f}), "
            f"optimizer {self.optimizer_ms:.2f}; "
            f"fp4gen layer passes per step {self.passes:.0f}: {self.from_graphs:.0f} from layer "
            f"graphs ({self.in_place:.0f} in place, "
            f"{self.from_graphs - self.in_place - self.captured:.0f} on static copies, "
            f"{self.captured:.0f} captured; "
            f"{self.timed_captures:.1f} captured per timed step), {eager:.0f} eager"
        )


def graph_stats(model: nn.Module) -> tuple[int, int, int]:
    """(layer passes served by a layer graph, in-place replays, captures) summed over the
    model's fp4gen Linears' own graphs (a compiled model runs no layer group)."""
    served = in_place = captured = 0
    for module in model.modules():
        graphs = getattr(module, "_graphs", None) if isinstance(module, fp4gen.nn.Linear) else None
        if graphs is not None:
            served += graphs.graph_calls
            in_place += graphs.in_place_replays
            captured += graphs.graph_calls - graphs.replays
    return served, in_place, captured


def host_breakdown(
    model: nn.Module, step: Callable[[], object], phases: list[list[float]]
) -> HostBreakdown:
    """``HostBreakdown`` over ``BREAKDOWN_STEPS`` steps of ``step`` (made by ``make_step`` with
    ``phases``, which it fills) of ``model`` (the module whose fp4gen Linears run)."""
    phases.clear()
    before_forwards = linear_forwards(model)
    before = graph_stats(model)
    with timers(FORWARD_OP, BACKWARD_OP) as spent:
        for _ in range(BREAKDOWN_STEPS):
            step()
    n = BREAKDOWN_STEPS
    served, in_place, captured = (
        (b - a) / n for a, b in zip(before, graph_stats(model), strict=True)
    )
    forward, backward, optimizer = (1e3 * sum(p[i] for p in phases) / n for i in range(3))
    return HostBreakdown(
        forward,
        backward,
        optimizer,
        *(ns / 1e6 / n for ns in spent),
        passes=2 * (linear_forwards(model) - before_forwards) / n,
        from_graphs=served,
        in_place=in_place,
        captured=captured,
    )


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks torchtitan compiles one by one: a transformers Llama's decoder
    layers, the built-in GPT's blocks."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "layers"):
        return list(inner.layers)
    return list(model.blocks)


def compile_model(model: nn.Module, scope: str, mode: str, backend: str = "inductor") -> nn.Module:
    """``model`` compiled per ``scope``: "blocks" compiles each decoder block on its own (as
    torchtitan does; the model's embedding, head and loss stay eager), "model" the whole model
    with its loss. ``mode``: torch.compile's (``default`` is None; the modes are inductor's, so
    another ``backend`` takes the default)."""
    kwargs: dict[str, Any] = {"backend": backend}
    if backend == "inductor":
        kwargs["mode"] = None if mode == "default" else mode
    if scope == "blocks":
        for block in decoder_blocks(model):
            block.compile(**kwargs)
        return model
    if scope == "model":
        return torch.compile(model, **kwargs)
    raise ValueError(f"compile scope {scope!r}: expected one of {', '.join(COMPILE_SCOPES)}")


def prepare_compiled(
    args: argparse.Namespace,
    hidden: int,
    layers: int,
    recipe: str,
    scope: str,
    mode: str,
    device: str,
) -> tuple[nn.Module, nn.Module, torch.Tensor, bool, Callable[[], object]]:
    """(model, compiled model, tokens, CUDA graphs on, step) of one compiled row, the step
    warmed up (compiled during the warm-up steps)."""
    torch.manual_seed(0)
    model = build_model(args.model, hidden, layers, args.seq, device)
    if recipe != "bf16":
        fp4gen.convert(model, fp4gen.load_recipe(recipe))
    batch = max(args.tokens // args.seq, 1)
    tokens = torch.randint(0, VOCAB, (batch, args.seq + (args.model == "gpt")), device=device)
    compiled = compile_model(model, scope, mode, args.compile_backend)
    graphs_on = mode == "reduce-overhead" and device == "cuda"
    if graphs_on:
        # a gradient autograd would take over from a CUDA graph's output buffer (the first
        # backward's, with .grad None) is overwritten by the next replay: the parameters'
        # gradients get buffers of their own, which backward adds into
        for param in model.parameters():
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
    step = make_step(compiled, loss_fn(args.model), tokens, False, graphs_on, model)
    for _ in range(WARMUP_STEPS):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return model, compiled, tokens, graphs_on, step


def profile_compiled(
    args: argparse.Namespace, hidden: int, layers: int, recipe: str, scope: str, mode: str
) -> Profiled | None:
    """A compiled row's profile: its model built, compiled and warmed up again
    (``_PROFILE_JOBS``); None where that fails (the timed row reported why)."""
    torch._dynamo.reset()
    try:
        model, _, _, _, step = prepare_compiled(args, hidden, layers, recipe, scope, mode, "cuda")
        got = profile_step(model, step)
        del model, step
    except Exception:  # noqa: BLE001 - the timed row already printed the failure
        got = None
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()
    return got


def run_compiled(
    args: argparse.Namespace,
    hidden: int,
    layers: int,
    recipe: str,
    scope: str,
    mode: str,
    device: str = "cuda",
    profile: bool = True,
) -> CompiledResult:
    """ms/step of one model and recipe compiled per ``scope`` and ``mode`` (compiled during the
    warm-up steps), with dynamo's counts; a failure is reported, not raised. With ``profile``
    its profile is a job for later (``_PROFILE_JOBS``)."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    ms: float | None = None
    host: HostBreakdown | None = None
    note = ""
    model: nn.Module | None = None
    try:
        model, compiled, tokens, graphs_on, step = prepare_compiled(
            args, hidden, layers, recipe, scope, mode, device
        )
        phases: list[list[float]] = []
        captures = graph_stats(model)[2]
        ms = timed_ms(step, args.steps, device)
        captures = (graph_stats(model)[2] - captures) / args.steps
        # a step that records its phases has an AdamW of its own: stepped once before it is
        # timed (a first step allocates the optimizer's state)
        timed = make_step(compiled, loss_fn(args.model), tokens, False, graphs_on, model, phases)
        timed()
        host = host_breakdown(model, timed, phases)
        host.timed_captures = captures
        if getattr(args, "host_profile", 0):
            host_profile(step, args.host_profile, "compiled")
    except Exception as err:  # report the reason and go on with the other runs
        if device == "cuda":
            torch.cuda.synchronize()
        note = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"
        traceback.print_exc()  # the whole error, on stderr: the note keeps the row short
    stats = counters["stats"]
    result = CompiledResult(
        ms,
        int(stats.get("unique_graphs", 0)),
        int(sum(counters["graph_break"].values())),
        int(counters["frames"].get("ok", 0)),
        note,
        host,
    )
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    if device == "cuda" and profile:
        _PROFILE_JOBS.append(
            ProfileJob(
                f"hidden {hidden}, {layers} layers, compiled {scope} {mode}",
                Path(recipe).stem,
                lambda: profile_compiled(args, hidden, layers, recipe, scope, mode),
            )
        )
    torch._dynamo.reset()
    return result


def run_compiled_table(
    args: argparse.Namespace,
    hidden: int,
    layers: int,
    recipes: list[str],
    eager: dict[str, tuple[Result, Result]] | None,
    device: str = "cuda",
    profile: bool = True,
) -> dict[tuple[str, str, str], CompiledResult]:
    """Every recipe (BF16 first) compiled per each scope of ``args.compile`` and mode of
    ``args.compile_modes``; prints ms/step against compiled BF16 of the same scope and mode,
    against eager BF16 and against the recipe's own eager run (where ``eager`` holds this
    round's eager rows). Returns (scope, mode, recipe) -> result; ``profile``: each row leaves
    its profile job."""
    scopes = [c for c in args.compile.split(",") if c]
    modes = [m for m in args.compile_modes.split(",") if m]
    for name, given, allowed in (("scope", scopes, COMPILE_SCOPES), ("mode", modes, COMPILE_MODES)):
        for value in given:
            if value not in allowed:
                raise SystemExit(f"compile {name} {value!r}: expected one of {', '.join(allowed)}")
    print(
        f"  {'compiled':28} {'scope':6} {'mode':15} {'ms/step':>9} {'x bf16':>7} "
        f"{'x eager bf16':>12} {'x own eager':>11} "
        f"{'graphs':>6} {'breaks':>6} {'frames':>6}"
    )
    eager_base = None if not eager else next(iter(eager.values()))[1].ms_eager
    results: dict[tuple[str, str, str], CompiledResult] = {}
    for scope in scopes:
        for mode in modes:
            base: CompiledResult | None = None
            for recipe in recipes:
                t0 = time.perf_counter()
                res = run_compiled(args, hidden, layers, recipe, scope, mode, device, profile)
                base = base or res
                results[(scope, mode, recipe)] = res
                label = Path(recipe).stem
                own = eager.get(label) if eager else None
                ms = "-" if res.ms is None else f"{res.ms:.2f}"
                print(
                    f"  {label:28} {scope:6} {mode:15} {ms:>9} {ratio(res.ms, base.ms):>7} "
                    f"{ratio(res.ms, eager_base):>12} "
                    f"{ratio(res.ms, own[0].ms_eager if own else None):>11} "
                    f"{res.graphs:6d} {res.breaks:6d} {res.compiles:6d}   "
                    f"({time.perf_counter() - t0:.0f} s)"
                )
                if res.host is not None:
                    print(f"    {res.host.line()}")
                if res.note:
                    print(f"    {res.note}")
    return results


def run_round(
    args: argparse.Namespace,
    hidden: int,
    layers: int,
    runs: list[tuple[str, bool, float | None]],
    profile: bool = True,
) -> dict[str, tuple[Result, Result]]:
    """One row per run (BF16 first, the base of the ratios), timed; with ``profile`` each row
    leaves its profile job (``_PROFILE_JOBS``). Returns label -> (result, base)."""
    base: Result | None = None
    rows: dict[str, tuple[Result, Result]] = {}
    for recipe, saves_x, flops in runs:
        t0 = time.perf_counter()
        with graph_flops(flops):
            res = run_one(args, hidden, layers, recipe, saves_x)
        base = base or res
        label = Path(recipe).stem + (" (saves x)" if saves_x else "")
        label += "" if flops is None else f" (graphs <= {flops:.0e})"
        rows[label] = (res, base)
        if profile:
            _PROFILE_JOBS.append(
                ProfileJob(
                    f"hidden {hidden}, {layers} layers, eager",
                    label,
                    lambda r=recipe, x=saves_x, f=flops: profile_eager(
                        args, hidden, layers, r, x, f
                    ),
                )
            )
        host, call = (
            "-" if v is None else f"{v:.0f}"
            for v in (res.host_us_per_linear, res.call_us_per_linear)
        )
        wall = "-" if res.wall_us_per_linear is None else f"{res.wall_us_per_linear:.0f}"
        graph = "-" if res.ms_graph is None else f"{res.ms_graph:.2f}"
        eager = ratio(res.ms_eager, base.ms_eager)
        print(
            f"  {label:28} {res.ms_eager:9.2f} {eager:>7} "
            f"{graph:>9} {ratio(res.ms_graph, base.ms_graph):>7} "
            f"{host:>8} {call:>8} {wall:>8} "
            f"{res.peak_gib:9.2f} {ratio(res.peak_gib, base.peak_gib):>7}   "
            f"({time.perf_counter() - t0:.0f} s)"
        )
        if res.graph_calls:
            print(
                f"    layer graphs: {res.graph_calls:.0f} layer calls per step from a graph, "
                f"{res.in_place:.0f} of them in place (no copies in or out)"
            )
        if args.graphs and res.ms_graph is None:
            print(f"    graphs: {res.graph_note}")
    return rows


def run_profiles(args: argparse.Namespace, jobs: list[ProfileJob]) -> None:
    """Every row's profile, after every row was timed (``_PROFILE_JOBS``), by group: its
    GPU-busy ms per step and ratio to the group's first row (BF16), the fp4gen ops' CPU us per
    Linear under the profiler, GPU ms by kernel kind and, with --kernels, the top kernels."""
    if not jobs:
        return
    print(
        "\nGPU time per step, profiled after every row was timed (a torch.profiler session "
        "slows every later launch of the process)"
    )
    group, base = None, None
    for job in jobs:
        if job.group != group:
            group, base = job.group, None
            print(f"  {group}")
            print(f"  {'recipe':28} {'gpu-busy':>9} {'x bf16':>7} {'prof us':>8}")
        t0 = time.perf_counter()
        got = job.run()
        if got is None:
            print(f"  {job.label:28} {'-':>9}  (its profile failed)")
            continue
        base = base or got
        prof = "-" if got.prof_us_per_linear is None else f"{got.prof_us_per_linear:.0f}"
        print(
            f"  {job.label:28} {got.gpu_busy_ms:9.2f} "
            f"{ratio(got.gpu_busy_ms, base.gpu_busy_ms):>7} {prof:>8}   "
            f"({time.perf_counter() - t0:.0f} s)"
        )
        print(f"    GPU ms by kind: {kinds_line(got.gpu_kinds, base.gpu_kinds)}")
        for line in kernel_lines(got.gpu_kernels, args.kernels, args.kernel_width):
            print(f"      {line}")


def spread(values: list[float], unit: str = "x", digits: int = 2) -> str:
    """The median of ``values`` and their range, e.g. '1.40x (1.32x-1.55x)'."""
    if not values:
        return "-"
    shown = [statistics.median(values), min(values), max(values)]
    median, low, high = (f"{v:.{digits}f}{unit}" for v in shown)
    return f"{median} ({low}-{high})"


def print_rounds(rounds: list[dict[str, tuple[Result, Result]]]) -> None:
    """Each run's figures over the rounds: median (min-max), each round's ratio taken against
    that round's BF16 (the host's speed drifts between rounds; a ratio within one is paired)."""
    print(f"  over {len(rounds)} rounds, median (min-max):")
    for label in rounds[0]:
        if label == "bf16":
            continue
        got = [r[label] for r in rounds if label in r]
        eager = [res.ms_eager / base.ms_eager for res, base in got]
        graph = [
            res.ms_graph / base.ms_graph for res, base in got if res.ms_graph and base.ms_graph
        ]
        per_linear = {
            name: [getattr(res, f"{name}_us_per_linear") for res, _ in got]
            for name in ("host", "call")
        }
        figures = ", ".join(
            f"{name} us/lin {spread([v for v in values if v is not None], ' us', 0)}"
            for name, values in per_linear.items()
        )
        print(f"  {label:28} eager x bf16 {spread(eager)}, graph x bf16 {spread(graph)}, {figures}")


def print_compiled_rounds(rounds: list[dict[tuple[str, str, str], CompiledResult]]) -> None:
    """Each compiled row's ratio to compiled BF16 of its scope and mode over the rounds: median
    (min-max), each round's ratio against that round's BF16 (compiled again every round)."""
    print(f"  compiled, over {len(rounds)} rounds, median (min-max) x compiled bf16:")
    for scope, mode, recipe in rounds[0]:
        if Path(recipe).stem == "bf16":
            continue
        got = []
        for r in rounds:
            res, base = r.get((scope, mode, recipe)), r.get((scope, mode, "bf16"))
            if res and base and res.ms and base.ms:
                got.append(res.ms / base.ms)
        print(f"  {Path(recipe).stem:28} {scope:6} {mode:15} {spread(got)}")


def ratio(value: float | None, base: float | None) -> str:
    return "-" if value is None or not base else f"{value / base:.2f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="1024,2048")
    parser.add_argument("--layers", default="", help="per hidden size (default: 8, 6, 4)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--recipes", default="bf16,recipes/nvfp4.fp4r")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--graphs", action="store_true", help="also time CUDA-graph replays")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="R",
        help="run every hidden size's rows R times, compiled rows included (each round's ratios "
        "against its own BF16 run) and print each figure's median and range: the host's speed "
        "drifts",
    )
    parser.add_argument("--model", choices=["llama", "gpt"], default=None)
    parser.add_argument("--host-profile", type=int, default=0, metavar="N")
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="under each row, its N kernels with the most GPU time per step (ms, launches, "
        "kind, name)",
    )
    parser.add_argument(
        "--kernel-width",
        type=int,
        default=90,
        metavar="C",
        help="characters of each kernel's name that --kernels prints",
    )
    parser.add_argument(
        "--layer-graph-flops",
        default="",
        metavar="F,...",
        help="also run each recipe with layer graphs only for passes whose GEMMs have at most F "
        "FLOPs (fp4gen.runtime.layer_graphs.MAX_GEMM_FLOPS; 0: no layer graphs)",
    )
    parser.add_argument(
        "--compare-saved-x",
        action="store_true",
        help="also run each recipe with its layers saving x instead of x's quantized wgrad copy",
    )
    parser.add_argument(
        "--loss-steps",
        type=int,
        default=0,
        metavar="N",
        help="also train each recipe N steps on real text and compare its loss curve to BF16's",
    )
    parser.add_argument("--loss-lr", type=float, default=3e-4, help="peak learning rate of those")
    parser.add_argument(
        "--compile",
        default="",
        metavar="SCOPES",
        help="also time every recipe under torch.compile: blocks (each decoder block compiled "
        "on its own, as torchtitan does) and/or model (the whole model with its loss), "
        "comma-separated; each against compiled BF16 of the same scope and mode",
    )
    parser.add_argument(
        "--compile-modes",
        default="default",
        metavar="MODES",
        help="torch.compile modes of those runs: default, reduce-overhead, max-autotune",
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend of those runs (aot_eager: dynamo and AOT autograd without "
        "inductor's kernels)",
    )
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="run only the compiled rows (no eager rows, profiles or host timings)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    if args.model is None:
        try:
            import transformers  # noqa: F401

            args.model = "llama"
        except ImportError:
            args.model = "gpt"
    hiddens = [int(h) for h in args.hidden.split(",")]
    layer_counts = [int(n) for n in args.layers.split(",")] if args.layers else []
    recipes = [r for r in args.recipes.split(",") if r]
    if "bf16" not in recipes:
        recipes.insert(0, "bf16")
    print(
        f"model {args.model}, {args.tokens} tokens/step (seq {args.seq}), AdamW, bf16 autocast, "
        f"{torch.cuda.get_device_name()}"
    )
    add_us, empty_us = host_speed("cuda")
    print(
        f"host: x + 1 {add_us:.1f} us, torch.empty {empty_us:.1f} us per call (the eager "
        "columns follow the host's speed where its time meets the GPU's)"
    )
    for i, hidden in enumerate(hiddens):
        layers = layer_counts[i] if i < len(layer_counts) else LAYERS_BY_HIDDEN.get(hidden, 4)
        print(f"\nhidden {hidden}, {layers} layers")
        if not args.compile_only:
            print(
                f"  {'recipe':28} {'ms/step':>9} {'x bf16':>7} {'graph ms':>9} {'x bf16':>7} "
                f"{'host us':>8} {'call us':>8} {'wall us':>8} {'peak GiB':>9} {'x bf16':>7}"
            )
        runs: list[tuple[str, bool, float | None]] = [(r, False, None) for r in recipes]
        if args.compare_saved_x:
            runs += [(r, True, None) for r in recipes if r != "bf16"]
        for flops in (float(f) for f in args.layer_graph_flops.split(",") if f):
            runs += [(r, False, flops) for r in recipes if r != "bf16"]
        rounds: list[dict[str, tuple[Result, Result]]] = []
        for n in range(0 if args.compile_only else args.rounds):
            if args.rounds > 1:
                print(f"  round {n + 1} of {args.rounds}")
            rounds.append(run_round(args, hidden, layers, runs, profile=n == 0))
        if args.rounds > 1 and rounds:
            print_rounds(rounds)
        if args.compile:
            compiled_rounds = []
            for n in range(args.rounds):
                if args.rounds > 1:
                    print(f"  compiled, round {n + 1} of {args.rounds}")
                eager = rounds[min(n, len(rounds) - 1)] if rounds else None
                compiled_rounds.append(
                    run_compiled_table(args, hidden, layers, recipes, eager, profile=n == 0)
                )
            if args.rounds > 1:
                print_compiled_rounds(compiled_rounds)
        if args.loss_steps:
            curves = {}
            for recipe in recipes:
                curves[recipe] = loss_curve(args, hidden, layers, recipe, args.loss_steps, "cuda")
                torch.cuda.empty_cache()
            print_curves(curves)
    run_profiles(args, _PROFILE_JOBS)
    return 0


if __name__ == "__main__":
    sys.exit(main())

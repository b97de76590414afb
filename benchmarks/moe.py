"""MoE training time: an MoE layer's fwd+bwd and an MoE model's step, BF16 against recipes.

The layer is transformers' Qwen3-MoE sparse block (router, top-k, experts) in BF16 at
``--hidden`` / ``--inner`` for every ``--experts`` x ``--topk`` pair, ``--tokens`` tokens. The
model is transformers' Qwen3MoeForCausalLM (or MixtralForCausalLM, ``--model mixtral``) built
from a config (no download) at the same widths, ``--model-layers`` layers of
``--model-experts`` experts, top ``--model-topk``, byte vocabulary, AdamW, bf16 autocast
(fp32 master weights) as benchmarks/train.py trains. Every row of a section runs in the same
process, after the BF16 baseline:

- ``bf16 grouped_mm``: the transformers experts with ``grouped_mm`` (torch._grouped_mm in
  BF16; under autocast with the weights cast to bf16, ``register_baseline``: transformers
  would run an fp32 model's grouped GEMMs in fp32), the baseline every ratio divides by;
- ``bf16 eager``: the transformers experts' own per-expert loop (layer section only);
- each recipe (``--recipes``), converted by ``fp4gen.convert`` from the baseline's model (the
  layers a recipe keeps in BF16, e.g. ``nvfp4_small``'s last block, run ``grouped_mm`` as the
  baseline's do; the transformers loop waits for the GPU 5 times per expert), with its
  default path (on sm_90a
  NVFP4 / MX experts run grouped GEMMs, FP8 blockwise too: its fprop and dgrad by the grouped
  FP8 GEMM, its wgrad per expert: docs/moe.md), and for recipes whose experts run grouped also
  ``<recipe> loop`` (the same recipe expert by expert, ``GroupedExperts.grouped = False``)
  and, with ``--quantize-per-expert``, ``<recipe> quantize per expert`` (grouped GEMMs, each
  expert's operands quantized by its own launches: ``set_grouped_quantize(False)``); with
  ``--fp8-per-expert``, ``<recipe> fp8 GEMMs per expert`` (the grouped path with the grouped
  FP8 GEMM off, each expert's dense FP8 GEMM: ``fp8_grouped.set_grouped_fp8(False)``); with
  ``--numpy-tables``, ``<recipe> numpy tables`` (every per-CTA table of the grouped quantize
  filled by numpy on the host: ``host_tables.set_device_built_rows(None)``).

On CUDA a recipe row with a goal of the MoE issue says whether it is met (``TARGETS``): the
layer's fwd+bwd at most 0.85x BF16 for ``fp8_blockwise`` and 1.2x for the ``nvfp4`` recipes, a
model step at most 1.0x and 1.25x.

Printed per row: ms per forward+backward (layer) or per training step (model), median of
``--steps`` timed runs after warm-up (CUDA events; ``time.perf_counter`` on the CPU), its
ratio to ``bf16 grouped_mm``, the peak memory on CUDA, and for a recipe how its experts' GEMMs
ran (grouped, or per expert and why: ``GroupedExperts.loop_reason``).

    python benchmarks/moe.py [--hidden 2048] [--inner 768] [--experts 8,64] [--topk 2,8]
                             [--tokens 8192] [--recipes nvfp4_small,fp8_blockwise]
                             [--model qwen3_moe|mixtral] [--model-layers 4]
                             [--model-experts 64] [--model-topk 8] [--seq 1024] [--steps 10]
                             [--skip-layer] [--skip-model] [--device cuda|cpu]
                             [--grouped-product bf16|fp32] [--quantize-per-expert]
                             [--fp8-per-expert]

``--profile N`` runs every row a second time, after all of them are timed (a torch.profiler
session slows every later kernel launch of the process, so no timed row follows one), and
prints under each row of that pass one more step profiled: its wall time against the time
the GPU's kernels ran (a path bound by its host shows far less kernel time than wall time),
and the N functions with the most own time (cProfile: Python functions, and the C functions
they call, such as kernel launches and torch's bindings), where that host time goes; on CUDA
also how often the step made the host wait for the GPU, and at which lines (torch's sync debug
mode).

``--device cpu`` runs the same code on the CPU (the float64 reference GEMMs: only for a smoke
run at tiny sizes, not a timing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, uninstalled

import fp4gen  # noqa: E402
from benchmarks.common import cuda_time_ms, require_cuda  # noqa: E402
from fp4gen.runtime.experts import GroupedExperts  # noqa: E402
from fp4gen.runtime.fp8_grouped import set_grouped_fp8  # noqa: E402
from fp4gen.runtime.fp8_kgrouped import set_k_grouped_fp8  # noqa: E402
from fp4gen.runtime.grouped import set_grouped_product, set_grouped_quantize  # noqa: E402
from fp4gen.runtime.host_tables import set_device_built_rows  # noqa: E402

VOCAB = 256  # bytes, as benchmarks/train.py


def time_ms(fn: Callable[[], object], device: str, steps: int, warmup: int = 2) -> float:
    """Median time of ``fn`` in milliseconds: ``benchmarks.common.cuda_time_ms`` (CUDA events)
    on CUDA, perf_counter elsewhere (a smoke run)."""
    if device == "cuda":
        return cuda_time_ms(fn, warmup=warmup, repeats=steps)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def host_split(
    forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None], steps: int
) -> str:
    """Where a fwd+bwd's wall time goes between the host and the GPU (CUDA, synchronized before
    each pass), medians of ``steps``: the forward until it returns (the experts wait once for
    the routing's counts inside it), the backward until the host has issued its last launch
    (autograd returns; nothing in it waits), and the rest of the backward the GPU still had
    queued then. An issue time close to the backward's whole time means the host, not the GPU,
    paced it."""
    fwd, issue, drain = [], [], []
    for _ in range(steps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = forward()
        t1 = time.perf_counter()
        backward(out)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        fwd.append(t1 - t0)
        issue.append(t2 - t1)
        drain.append(t3 - t2)
    f, i, d = (statistics.median(v[2:]) * 1e3 for v in (fwd, issue, drain))
    return (
        f"host split: forward {f:.2f} ms (to its return); backward issued in {i:.2f} ms, "
        f"then {d:.2f} ms of queued GPU work"
    )


# what --profile found for the row being measured, printed under it by print_row
_PROFILE_LINES: list[str] = []
# --profile-dir: where each profiled step's cProfile stats and kernel table are written
_PROFILE_DIR: list[Path] = []


def profile_step(fn: Callable[[], object], device: str, top: int) -> None:
    """One more call of ``fn`` under ``torch.profiler`` (its wall time against the time the
    GPU's kernels ran: a path bound by its host shows far less GPU time than wall time) and one
    under ``cProfile`` (the ``top`` functions by their own time, Python and C: where that host
    time goes, which the torch profiler shows only as one autograd function's self time)."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    gpu = gpu_busy_ms(prof.key_averages())
    _PROFILE_LINES.append(f"      profile: wall {wall:.2f} ms (profiled), GPU kernels {gpu:.2f} ms")
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    profiler.disable()
    if _PROFILE_DIR:  # the whole profile, for pstats (e.g. sorted by cumulative time)
        out = _PROFILE_DIR[0]
        stem = out / f"{len(list(out.glob('*.prof'))) + 1:02d}"
        profiler.dump_stats(f"{stem}.prof")
        sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        Path(f"{stem}.ops.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
        _PROFILE_LINES.append(f"      written: {stem}.prof (cProfile), {stem}.ops.txt (torch ops)")
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    own = [
        (tottime, calls, _where(file, line, name))
        for (file, line, name), (_, calls, tottime, _, _) in stats.items()
        if "disable" not in name  # the profiler's own switch
    ]
    for tottime, calls, where in sorted(own, reverse=True)[:top]:
        _PROFILE_LINES.append(
            f"        {tottime * 1e3:8.2f} ms own time in {calls:5d} calls  {where}"
        )
    if device == "cuda":
        _PROFILE_LINES.append("      " + count_syncs(fn))


def gpu_busy_ms(events: object) -> float:
    """The GPU's own time in ``events`` (a profiler's key averages), in ms: the device events
    alone, as torch's table totals it (an aten op's row repeats the time of the kernels it
    launched, which summing every row counted twice)."""
    from torch.autograd import DeviceType

    return (
        sum(
            e.self_device_time_total
            for e in events  # type: ignore[attr-defined]
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        )
        / 1e3
    )


def count_syncs(fn: Callable[[], object]) -> str:
    """One more call of ``fn`` with torch's sync debug mode warning at every operation that
    makes the host wait for the GPU (a ``.tolist()``, a copy from pageable memory): how many,
    and where (the Python line that asked, most frequent first)."""
    import collections
    import warnings

    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    sites = collections.Counter(
        f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    where = ", ".join(f"{site} x{n}" for site, n in sites.most_common(8))
    return f"host waits for the GPU: {sum(sites.values())} per call ({where or 'none'})"


def _where(file: str, line: int, name: str) -> str:
    """A cProfile entry's place: fp4gen's files relative to the package, others by their file
    name, C functions (kernel launches through TVM-FFI, torch's bindings) by their name."""
    if file == "~":
        return name
    path = Path(file)
    package = Path(fp4gen.__file__).resolve().parent
    shown = (
        path.resolve().relative_to(package) if path.resolve().is_relative_to(package) else path.name
    )
    return f"{shown}:{line}({name})"


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def moe_config(kind: str, args: argparse.Namespace, experts: int, topk: int, layers: int) -> object:
    """A transformers config of the MoE family ``kind`` at the benchmark's widths."""
    import transformers

    heads = max(args.hidden // 128, 1)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        num_experts_per_tok=topk,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(
            intermediate_size=args.inner, num_local_experts=experts, **common
        )
    else:
        cfg = transformers.Qwen3MoeConfig(
            intermediate_size=4 * args.inner,
            moe_intermediate_size=args.inner,
            num_experts=experts,
            head_dim=args.hidden // heads,
            **common,
        )
    cfg._attn_implementation = "sdpa"
    return cfg


# the experts implementation of the baseline row, and of the BF16 layers a recipe keeps:
# transformers' grouped_mm with the weights cast to the autocast dtype (register_baseline)
BASELINE = "grouped_mm_autocast"


class _CastParameters:
    """An experts module seen with its floating-point parameters cast to ``dtype`` (a
    differentiable copy per forward, as autocast casts a Linear's weight), everything else its
    own."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        self._module, self._dtype = module, dtype

    def __getattr__(self, name: str) -> object:
        value = getattr(self._module, name)
        if isinstance(value, nn.Parameter) and value.is_floating_point():
            return value.to(self._dtype)
        return value


def register_baseline() -> None:
    """Register ``BASELINE`` with transformers' experts implementations: its ``grouped_mm``
    under autocast. torch's grouped GEMM is not autocast-enabled and transformers casts the
    tokens to the weights' dtype, so a model with fp32 parameters under bf16 autocast would
    run its experts' grouped GEMMs in fp32 (a baseline several times slower than BF16); this
    one casts the weights to the autocast dtype instead, as autocast does for a Linear."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

    def forward(
        self: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        kind = hidden.device.type
        if not torch.is_autocast_enabled(kind):
            return grouped_mm_experts_forward(self, hidden, index, weights)
        dtype = torch.get_autocast_dtype(kind)
        cast = _CastParameters(self, dtype)
        return grouped_mm_experts_forward(cast, hidden.to(dtype), index, weights.to(dtype))

    ALL_EXPERTS_FUNCTIONS[BASELINE] = forward


# the issue's goals, as a ratio to BF16 grouped_mm (a recipe's name prefix -> the largest ratio):
# the MoE layer's fwd+bwd and a whole model's step
TARGETS: dict[str, dict[str, float]] = {
    "layer": {"fp8_blockwise": 0.85, "nvfp4": 1.2},
    "model": {"fp8_blockwise": 1.0, "nvfp4": 1.25},
}


def target_note(section: str, recipe: str, ratio: float) -> str:
    """ "target <= R: met" (or "missed") for a recipe with a goal in ``section``, else ""."""
    for prefix, limit in TARGETS[section].items():
        if recipe.startswith(prefix):
            return f"target <= {limit:.2f}x: {'met' if ratio <= limit else 'missed'}"
    return ""


def experts_rows(model: nn.Module) -> list[GroupedExperts]:
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


# a row variant: (the row's suffix, a function that applies its setting and returns the undo,
# the row's note)
Variant = tuple[str, Callable[[], Callable[[], object]], str]


def _setting(setter: Callable[[Any], Any], value: Any) -> Callable[[], Callable[[], object]]:
    def apply() -> Callable[[], object]:
        previous = setter(value)
        return lambda: setter(previous)

    return apply


def variants_of(args: argparse.Namespace) -> list[Variant]:
    """The extra rows the options ask for under each recipe whose experts run grouped."""
    found: list[Variant] = []
    if args.quantize_per_expert:
        found.append(
            ("quantize per expert", _setting(set_grouped_quantize, False), "grouped GEMMs")
        )
    if args.fp8_per_expert:
        note = "grouped path, each expert's dense FP8 GEMM"
        found.append(("fp8 GEMMs per expert", _setting(set_grouped_fp8, False), note))
    if args.numpy_tables:
        note = "grouped path, every per-CTA table filled by numpy on the host and copied"
        found.append(("numpy tables", _setting(set_device_built_rows, None), note))
    return found


def recipe_rows(
    make: Callable[[str], nn.Module],
    recipes: list[str],
    device: str,
    measure: Callable[[nn.Module], tuple[float, float | None]],
    base: float,
    section: str,
    variants: list[Variant] | None = None,
    loop: bool = True,
) -> None:
    """Print each recipe's row (with the issue's goal where it has one, on CUDA), then, where
    its experts ran grouped, a row per variant (``variants_of``) and ``<recipe> loop``
    (unless not ``loop``)."""
    for recipe in recipes:
        model = fp4gen.convert(make(BASELINE), recipe)
        ms, peak = measure(model)
        dev = torch.device(device)
        reasons = {e.loop_reason(e.operands, dev) for e in experts_rows(model)}
        grouped = None in reasons
        paths = sorted("grouped GEMMs" if r is None else f"per expert: {r}" for r in reasons)
        goal = target_note(section, recipe, ms / base) if device == "cuda" else ""
        print_row(recipe, ms, base, peak, "; ".join([*paths, *([goal] if goal else [])]))
        del model
        for suffix, apply, note in (variants or []) if grouped else []:
            undo = apply()
            try:
                model = fp4gen.convert(make(BASELINE), recipe)
                ms, peak = measure(model)
            finally:
                undo()
            print_row(f"{recipe} {suffix}", ms, base, peak, note)
            del model
        if grouped and loop:
            model = fp4gen.convert(make(BASELINE), recipe)
            for module in experts_rows(model):
                module.grouped = False
            ms, peak = measure(model)
            print_row(f"{recipe} loop", ms, base, peak, "per expert (grouped = False)")
            del model


def print_row(name: str, ms: float, base: float | None, peak: float | None, note: str = "") -> None:
    ratio = "" if base is None else f"{ms / base:7.2f}x"
    memory = "" if peak is None else f"{peak:9.2f}"
    print(f"  {name:34} {ms:10.2f} {ratio:>8} {memory:>9} {note}", flush=True)
    for line in _PROFILE_LINES:
        print(line)
    _PROFILE_LINES.clear()


def llama4_config(args: argparse.Namespace, experts: int, topk: int) -> object:
    """Llama 4's text config at the benchmark's widths (its MoE block runs every expert on
    every token, each token's rows scaled by its router score)."""
    import transformers

    heads = max(args.hidden // 128, 1)
    return transformers.Llama4TextConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=args.inner,
        intermediate_size_mlp=4 * args.inner,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        head_dim=args.hidden // heads,
        num_local_experts=experts,
        num_experts_per_tok=topk,
        max_position_embeddings=args.seq,
    )


def layer_block(args: argparse.Namespace, experts: int, topk: int) -> tuple:
    """(the MoE block's class, its config, the BF16 rows: (name, experts implementation or
    None for the module's own forward)) of ``--layer-family``."""
    if args.layer_family == "llama4":
        from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

        return Llama4TextMoe, llama4_config(args, experts, topk), [("bf16 bmm", None)]
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = moe_config("qwen3_moe", args, experts, topk, 1)
    return Qwen3MoeSparseMoeBlock, cfg, [("bf16 grouped_mm", BASELINE), ("bf16 eager", "eager")]


def layer_section(args: argparse.Namespace, device: str, recipes: list[str]) -> None:
    for experts in args.experts:
        for topk in args.topk:
            block_class, cfg, baselines = layer_block(args, experts, topk)
            every = " (Llama 4's block: every expert on every token)"
            print(
                f"\nMoE layer fwd+bwd: hidden {args.hidden}, inner {args.inner}, {experts} "
                f"experts, top-{topk}, {args.tokens} tokens, BF16"
                f"{every if args.layer_family == 'llama4' else ''}"
            )
            print(f"  {'row':34} {'ms':>10} {'x bf16':>8} {'peak GiB':>9}")
            torch.manual_seed(0)
            source = block_class(cfg)
            with torch.no_grad():  # a bare block is not initialized by transformers (empty)
                for param in source.parameters():
                    param.normal_(0.0, cfg.initializer_range)
            state = source.state_dict()

            def make(
                impl: str | None, cfg: object = cfg, state: dict = state, cls: type = block_class
            ) -> nn.Module:
                if impl is not None:
                    cfg._experts_implementation = impl  # type: ignore[attr-defined]
                block = cls(cfg)
                block.load_state_dict(state)
                return block.to(device=device, dtype=torch.bfloat16)

            x = torch.randn(1, args.tokens, args.hidden, device=device, dtype=torch.bfloat16)
            dy = torch.randn_like(x)

            def measure(
                block: nn.Module, x: torch.Tensor = x, dy: torch.Tensor = dy
            ) -> tuple[float, float | None]:
                inp = x.detach().requires_grad_()

                def step() -> None:
                    out = block(inp)
                    out = out[0] if isinstance(out, tuple) else out
                    out.backward(dy.view_as(out))  # Llama 4's block returns [tokens, hidden]

                reset_peak(device)
                ms = time_ms(step, device, args.steps)
                peak = peak_gib(device)
                if args.host_split and device == "cuda":

                    def forward() -> torch.Tensor:
                        out = block(inp)
                        return out[0] if isinstance(out, tuple) else out

                    def backward(out: torch.Tensor) -> None:
                        out.backward(dy.view_as(out))

                    _PROFILE_LINES.append("      " + host_split(forward, backward, args.steps))
                if args.profile:
                    profile_step(step, device, args.profile)
                return ms, peak

            (base_name, base_impl), *others = baselines
            base, peak = measure(make(base_impl))
            print_row(base_name, base, base, peak)
            for name, impl in others:
                ms, peak = measure(make(impl))
                print_row(name, ms, base, peak)
            recipe_rows(
                lambda impl, make=make, base_impl=base_impl: make(base_impl),
                recipes, device, measure, base, "layer",
                variants_of(args), not args.no_loop,
            )  # fmt: skip


def model_section(args: argparse.Namespace, device: str, recipes: list[str]) -> None:
    import transformers

    family = transformers.MixtralForCausalLM if args.model == "mixtral" else None
    family = family or transformers.Qwen3MoeForCausalLM
    cfg = moe_config(args.model, args, args.model_experts, args.model_topk, args.model_layers)
    torch.manual_seed(0)
    state = family(cfg).state_dict()
    params = sum(v.numel() for v in state.values())
    print(
        f"\n{family.__name__} training step: {args.model_layers} layers, hidden {args.hidden}, "
        f"{args.model_experts} experts top-{args.model_topk}, inner {args.inner}, "
        f"{params / 1e6:.0f}M parameters, {args.tokens} tokens/step (seq {args.seq}), AdamW, "
        "bf16 autocast"
    )
    print(f"  {'row':34} {'ms/step':>10} {'x bf16':>8} {'peak GiB':>9}")

    def make(impl: str) -> nn.Module:
        cfg._experts_implementation = impl  # type: ignore[attr-defined]
        model = family(cfg)
        model.load_state_dict(state)
        return model.to(device)

    seqs = max(args.tokens // args.seq, 1)
    tokens = torch.randint(0, VOCAB, (seqs, args.seq), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(device)

    def measure(model: nn.Module) -> tuple[float, float | None]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> None:
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        reset_peak(device)
        ms = time_ms(step, device, args.steps)
        peak = peak_gib(device)
        if args.profile:
            profile_step(step, device, args.profile)
        return ms, peak

    base, peak = measure(make(BASELINE))
    print_row("bf16 grouped_mm", base, base, peak)
    recipe_rows(
        make, recipes, device, measure, base, "model",
        variants_of(args), not args.no_loop,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inner", type=int, default=768, help="each expert's intermediate size")
    parser.add_argument("--experts", type=ints, default=[8, 64], help="layer rows, e.g. 8,64")
    parser.add_argument("--topk", type=ints, default=[2, 8], help="layer rows, e.g. 2,8")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--recipes", default="nvfp4_small,fp8_blockwise")
    parser.add_argument(
        "--layer-family",
        choices=["qwen3_moe", "llama4"],
        default="qwen3_moe",
        help="the layer section's MoE block: Qwen3-MoE's sparse block (routed experts, BF16 "
        "baseline transformers' grouped_mm) or Llama 4's (every expert on every token, "
        "baseline its own bmm)",
    )
    parser.add_argument("--model", choices=["qwen3_moe", "mixtral"], default="qwen3_moe")
    parser.add_argument("--model-layers", type=int, default=4)
    parser.add_argument("--model-experts", type=int, default=64)
    parser.add_argument("--model-topk", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip-layer", action="store_true", help="no MoE layer section")
    parser.add_argument("--skip-model", action="store_true", help="no whole-model section")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--grouped-product",
        choices=["bf16", "fp32"],
        default="bf16",
        help="the grouped experts' products on CUDA (fp4gen.runtime.grouped.set_grouped_product)",
    )
    parser.add_argument(
        "--quantize-per-expert",
        action="store_true",
        help="also each grouped recipe with the grouped quantize off "
        "(fp4gen.runtime.grouped.set_grouped_quantize)",
    )
    parser.add_argument(
        "--fp8-per-expert",
        action="store_true",
        help="also each grouped recipe with the grouped FP8 GEMM off "
        "(fp4gen.runtime.fp8_grouped.set_grouped_fp8)",
    )
    parser.add_argument(
        "--numpy-tables",
        action="store_true",
        help="also each grouped recipe with every per-CTA table of the grouped quantize kernels "
        "filled by numpy on the host and copied, as before they were built on the device "
        "(fp4gen.runtime.host_tables.set_device_built_rows(None))",
    )
    parser.add_argument(
        "--host-split",
        action="store_true",
        help="under each layer row (CUDA): the forward's time, the time the host takes to issue "
        "the backward and the GPU work still queued after it (is the host or the GPU pacing?)",
    )
    parser.add_argument(
        "--no-loop",
        action="store_true",
        help="no '<recipe> loop' rows (the same recipe expert by expert: the slowest rows, "
        "some 10x the grouped step)",
    )
    parser.add_argument(
        "--fp8-wgrad-per-expert",
        action="store_true",
        help="the experts' FP8 wgrad GEMMs one dense GEMM per expert instead of one K-grouped "
        "launch per projection (fp4gen.runtime.fp8_kgrouped.set_k_grouped_fp8(False))",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="under each row, one more step profiled: its wall time against the GPU kernels' "
        "time, the N functions (Python and C) with the most own time (cProfile), and the "
        "host's waits for the GPU by line",
    )
    parser.add_argument(
        "--profile-dir",
        type=Path,
        metavar="DIR",
        help="with --profile: also write each profiled step's cProfile stats (NN.prof, for "
        "python -m pstats) and its torch ops by time (NN.ops.txt) to DIR",
    )
    args = parser.parse_args(argv)
    register_baseline()
    if args.profile_dir is not None:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        _PROFILE_DIR.append(args.profile_dir)
    if args.device == "cuda":
        require_cuda()  # --device cpu: a smoke run
    recipes = [r for r in args.recipes.split(",") if r and r != "bf16"]
    set_grouped_product(args.grouped_product)
    # the grouped quantize is the default (docs/moe.md); made sure of here, since the timings
    # name it
    previous_quantize = set_grouped_quantize(True)
    # the grouped FP8 GEMM is the default; made sure of here, since the rows name it
    previous_fp8 = set_grouped_fp8(True)
    previous_k = set_k_grouped_fp8(not args.fp8_wgrad_per_expert)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (smoke run)"
    wgrad = "per expert" if args.fp8_wgrad_per_expert else "K-grouped"
    print(
        f"fp4gen MoE benchmark on {where}, torch {torch.__version__}, grouped experts' "
        f"products {args.grouped_product}, grouped quantize on, grouped FP8 GEMM on, FP8 "
        f"wgrad {wgrad}"
    )
    try:
        # a torch.profiler session leaves every later launch of the process slower (6.9 -> 9.5
        # us per small launch on an H200 host), so the rows are timed in a pass without one,
        # and --profile's rows come in a second pass of their own
        passes = [0, args.profile] if args.profile else [0]
        for profile in passes:
            if profile:
                print(
                    "\nprofiled pass (--profile): its times follow a profiler session, which "
                    "slows every later launch; the times to compare are the pass above"
                )
            args.profile = profile
            if not args.skip_layer:
                layer_section(args, args.device, recipes)
            if not args.skip_model:
                model_section(args, args.device, recipes)
    finally:
        set_grouped_quantize(previous_quantize)
        set_grouped_fp8(previous_fp8)
        set_k_grouped_fp8(previous_k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
